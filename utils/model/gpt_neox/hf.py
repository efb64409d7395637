"""GPT-NeoX <-> transformers: its config both ways, its state-dict adapter both ways, and transformers'
GPTNeoXForCausalLM with the engine's interface (`model_impl=hf`, the reference).

Names: the engine's parameters are transformers' in-memory names (`gpt_neox.*`, `lm_head.weight`). GPT-NeoX
files on disk have called the head `embed_out` (transformers writes that name) and `lm_head`: both are read.
Buffers older files carry (`attention.bias`, `attention.masked_bias`, `rotary_emb.inv_freq`) are not weights
and are dropped.
"""
from __future__ import annotations

import re

import torch

from configs.model_config import ConfigError, ModelSpec

HF_MODEL_TYPES = ("gpt_neox",)
# the Linears of a block that write into the residual stream (init=neox draws them with wang_init)
RESIDUAL_OUTPUTS = ("attention.dense", "mlp.dense_4h_to_h")
_NOT_WEIGHTS = re.compile(r"(attention\.(bias|masked_bias)|rotary_emb\.inv_freq)$")


def hf_config(spec: ModelSpec, attn_implementation: str = "sdpa", special_ids: dict | None = None):
    """transformers' GPTNeoXConfig; `special_ids` ({"bos_token_id", "eos_token_id", "pad_token_id"}) come
    from the tokenizer the model was trained with (utils/model/hf.py), None where it is unknown."""
    from transformers import GPTNeoXConfig

    special_ids = special_ids or {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    cfg = GPTNeoXConfig(
        vocab_size=spec.padded_vocab_size, hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_hidden_layers, num_attention_heads=spec.num_attention_heads,
        intermediate_size=spec.intermediate_size, max_position_embeddings=spec.max_position_embeddings,
        rotary_pct=spec.rotary_pct, rotary_emb_base=spec.rotary_emb_base,
        use_parallel_residual=spec.use_parallel_residual, layer_norm_eps=spec.layer_norm_eps,
        attention_bias=spec.attention_bias, hidden_act=spec.hidden_act,
        tie_word_embeddings=spec.tie_word_embeddings, initializer_range=spec.initializer_range,
        hidden_dropout=0.0, attention_dropout=0.0, use_cache=False, **special_ids,
    )
    cfg._attn_implementation = attn_implementation
    return cfg


def spec_from_hf_config(config: dict, name: str, source: str = "config.json") -> ModelSpec:
    """A spec from an HF GPT-NeoX config.json (old `rotary_pct`/`rotary_emb_base` keys or transformers 5's
    `rope_parameters`). The embedding rows are the config's `vocab_size`, kept as they are."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise ConfigError(f"{source}: rope scaling {rope.get('rope_type', rope.get('type'))!r} is not supported; "
                          f"only plain rotary embeddings")
    try:
        return ModelSpec(
            name=name, vocab_size=int(config["vocab_size"]), hidden_size=int(config["hidden_size"]),
            num_hidden_layers=int(config["num_hidden_layers"]),
            num_attention_heads=int(config["num_attention_heads"]),
            intermediate_size=int(config["intermediate_size"]),
            max_position_embeddings=int(config["max_position_embeddings"]),
            rotary_pct=float(rope.get("partial_rotary_factor", config.get("rotary_pct", 0.25))),
            rotary_emb_base=float(rope.get("rope_theta", config.get("rotary_emb_base", 10000.0))),
            use_parallel_residual=bool(config.get("use_parallel_residual", True)),
            layer_norm_eps=float(config.get("layer_norm_eps", 1e-5)),
            attention_bias=bool(config.get("attention_bias", True)),
            hidden_act=str(config.get("hidden_act", "gelu")),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            initializer_range=float(config.get("initializer_range", 0.02)),
            pad_vocab_multiple=1)
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{source}: not a usable GPT-NeoX config ({type(exc).__name__}: {exc})") from None


def from_hf_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An HF GPT-NeoX state dict (either head name, buffers or not) -> the engine's parameter names."""
    out = {k: v for k, v in state.items() if not _NOT_WEIGHTS.search(k)}
    if "embed_out.weight" in out:
        out["lm_head.weight"] = out.pop("embed_out.weight")
    return out


def to_hf_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The engine's names are transformers' in-memory names: a copy of the dict."""
    return dict(state)


def native_model(spec: ModelSpec):
    from utils.model.gpt_neox.model import GPTNeoX

    return GPTNeoX(spec)


def causal_lm_class(spec: ModelSpec | None = None):
    from transformers import GPTNeoXForCausalLM

    return GPTNeoXForCausalLM


def finish_transformers(model, config) -> None:
    """After a meta-device build and `load_state_dict(assign=True)`: the rotary buffers (in no state dict)."""
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding

    model.gpt_neox.rotary_emb = GPTNeoXRotaryEmbedding(config)


_HF_CLASS = None


def hf_model_class():
    """transformers' GPTNeoXForCausalLM with the engine's interface (imported only when asked for)."""
    global _HF_CLASS
    if _HF_CLASS is not None:
        return _HF_CLASS
    from transformers import GPTNeoXForCausalLM

    from utils.model.layers import HFCausalLM

    class HFGPTNeoX(HFCausalLM, GPTNeoXForCausalLM):
        """transformers' class with the engine's interface (utils/model/layers.py HFCausalLM)."""

        def output_units(self):
            return [self.gpt_neox.final_layer_norm, self.lm_head]

    _HF_CLASS = HFGPTNeoX
    return HFGPTNeoX
