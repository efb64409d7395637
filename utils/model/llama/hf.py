"""The Llama family <-> transformers: configs both ways (`llama` and `qwen2` config.json), the state-dict
adapter both ways, and transformers' LlamaForCausalLM / Qwen2ForCausalLM with the engine's interface
(`model_impl=hf`, the reference).

Names: the engine's parameters are transformers' own (`model.embed_tokens.weight`, `model.layers.N.self_attn.
q_proj.weight`, ..., `model.norm.weight`, `lm_head.weight`), so weights come in and go out as they are; a
tied model's files carry no `lm_head.weight` (the embedding is the head). A spec with `qkv_bias` is a Qwen2
model (biases on q/k/v, none on o), any other a Llama one.
"""
from __future__ import annotations

import torch

from configs.model_config import ConfigError, ModelSpec

HF_MODEL_TYPES = ("llama", "qwen2")
# the Linears of a block that write into the residual stream (init=neox draws them with wang_init)
RESIDUAL_OUTPUTS = ("self_attn.o_proj", "mlp.down_proj")
_DROPPED = ("rotary_emb.inv_freq",)  # a buffer some older files carry: not a weight


def _rope_parameters(spec: ModelSpec) -> dict:
    if not spec.rope_scaling:
        return {"rope_type": "default", "rope_theta": spec.rotary_emb_base}
    factor, low, high, old_context = spec.rope_scaling
    return {"rope_type": "llama3", "rope_theta": spec.rotary_emb_base, "factor": factor, "low_freq_factor": low,
            "high_freq_factor": high, "original_max_position_embeddings": int(old_context)}


def hf_config(spec: ModelSpec, attn_implementation: str = "sdpa", special_ids: dict | None = None):
    """transformers' LlamaConfig (Qwen2Config for a spec with `qkv_bias`)."""
    from transformers import LlamaConfig, Qwen2Config

    special_ids = special_ids or {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    common = dict(vocab_size=spec.padded_vocab_size, hidden_size=spec.hidden_size,
                  intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_hidden_layers,
                  num_attention_heads=spec.num_attention_heads, num_key_value_heads=spec.kv_heads,
                  hidden_act=spec.hidden_act, max_position_embeddings=spec.max_position_embeddings,
                  initializer_range=spec.initializer_range, rms_norm_eps=spec.layer_norm_eps, use_cache=False,
                  tie_word_embeddings=spec.tie_word_embeddings, rope_parameters=_rope_parameters(spec),
                  attention_dropout=0.0, **special_ids)
    if spec.qkv_bias:
        cfg = Qwen2Config(**common, use_sliding_window=False)
    else:
        cfg = LlamaConfig(**common, attention_bias=spec.attention_bias, mlp_bias=False, head_dim=spec.head_dim)
    cfg._attn_implementation = attn_implementation
    return cfg


def spec_from_hf_config(config: dict, name: str, source: str = "config.json") -> ModelSpec:
    """A spec from an HF `llama` or `qwen2` config.json (transformers 4's `rope_theta` + `rope_scaling` or
    5's `rope_parameters`). The embedding rows are the config's `vocab_size`, kept as they are."""
    qwen = config.get("model_type") == "qwen2"
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
    refuse = None
    if rope_type not in ("default", "llama3"):
        refuse = f"rope scaling {rope_type!r} is not supported (plain rotary or Llama 3's 'llama3')"
    elif config.get("mlp_bias"):
        refuse = "mlp_bias is not supported"
    elif config.get("hidden_act", "silu") != "silu":
        refuse = f"hidden_act {config.get('hidden_act')!r} is not supported (SwiGLU: 'silu')"
    elif qwen and config.get("use_sliding_window"):
        refuse = "use_sliding_window is not supported (full attention only)"
    elif (config.get("head_dim")
          and int(config["head_dim"]) * int(config["num_attention_heads"]) != int(config["hidden_size"])):
        refuse = "a head_dim other than hidden_size / num_attention_heads is not supported"
    if refuse:
        raise ConfigError(f"{source}: {refuse}")
    try:
        scaling = ()
        if rope_type == "llama3":
            scaling = (float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"]),
                       int(rope["original_max_position_embeddings"]))
        return ModelSpec(
            name=name, vocab_size=int(config["vocab_size"]), hidden_size=int(config["hidden_size"]),
            num_hidden_layers=int(config["num_hidden_layers"]),
            num_attention_heads=int(config["num_attention_heads"]),
            intermediate_size=int(config["intermediate_size"]),
            max_position_embeddings=int(config["max_position_embeddings"]),
            rotary_pct=1.0, rotary_emb_base=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
            use_parallel_residual=False, layer_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            attention_bias=bool(config.get("attention_bias", False)) and not qwen, hidden_act="silu",
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            initializer_range=float(config.get("initializer_range", 0.02)), pad_vocab_multiple=1, family="llama",
            num_key_value_heads=int(config.get("num_key_value_heads") or config["num_attention_heads"]),
            rope_scaling=scaling, qkv_bias=qwen)
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{source}: not a usable {config.get('model_type')} config "
                          f"({type(exc).__name__}: {exc})") from None


def from_hf_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An HF Llama/Qwen2 state dict -> the engine's names (the same, less buffers older files carry)."""
    return {k: v for k, v in state.items() if not k.endswith(_DROPPED)}


def to_hf_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return dict(state)


def native_model(spec: ModelSpec):
    from utils.model.llama.model import Llama

    return Llama(spec)


def causal_lm_class(spec: ModelSpec | None = None):
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    return Qwen2ForCausalLM if spec is not None and spec.qkv_bias else LlamaForCausalLM


def finish_transformers(model, config) -> None:
    """After a meta-device build and `load_state_dict(assign=True)`: the rotary buffers (in no state dict)."""
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)


_HF_CLASSES: dict[str, type] = {}


def hf_model_class():
    """A constructor: config -> transformers' LlamaForCausalLM or Qwen2ForCausalLM (by the config's
    model_type) with the engine's interface."""
    return _build_hf


def _build_hf(config):
    return _hf_class(config.model_type)(config)


def _hf_class(model_type: str):
    if model_type in _HF_CLASSES:
        return _HF_CLASSES[model_type]
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    from utils.model.layers import HFCausalLM

    base = Qwen2ForCausalLM if model_type == "qwen2" else LlamaForCausalLM

    class HFLlama(HFCausalLM, base):
        """transformers' class with the engine's interface (utils/model/layers.py HFCausalLM)."""

        def output_units(self):
            return [self.model.norm, self.lm_head]

    HFLlama.__name__ = HFLlama.__qualname__ = f"HF{base.__name__}"
    _HF_CLASSES[model_type] = HFLlama
    return HFLlama
