"""GPT-NeoX <-> transformers (`GPTNeoXForCausalLM`): its config both ways and its state-dict keys both ways.

Names: the engine's parameters are transformers' in-memory names (`gpt_neox.*`, `lm_head.weight`). GPT-NeoX
files on disk have called the head `embed_out` (transformers writes that name) and `lm_head`: both are read.
Buffers older files carry (`attention.bias`, `attention.masked_bias`, `rotary_emb.inv_freq`) are not weights
and are dropped.
"""
from __future__ import annotations

import re

import torch

from utils.errors import ConfigError
from utils.model.adapter import (
    HFAdapter,
    config_sizes,
    no_special_ids,
    rope_refusal,
    rope_type,
    transformers_config,
)
from utils.model.architecture import ModelSpec

_NOT_WEIGHTS = re.compile(r"(attention\.(bias|masked_bias)|rotary_emb\.inv_freq)$")


class GPTNeoXAdapter(HFAdapter):
    final_norm = "final_layer_norm"

    def causal_lm_class(self, spec: ModelSpec | None = None) -> type:
        from transformers import GPTNeoXForCausalLM

        return GPTNeoXForCausalLM

    def hf_config(self, spec: ModelSpec, attn_implementation: str = "sdpa", special_ids: dict | None = None):
        from transformers import GPTNeoXConfig

        if self.export_refusal(spec):
            raise ConfigError(self.export_refusal(spec))
        cfg = GPTNeoXConfig(
            vocab_size=spec.padded_vocab_size, hidden_size=spec.hidden_size,
            num_hidden_layers=spec.num_hidden_layers, num_attention_heads=spec.num_attention_heads,
            intermediate_size=spec.intermediate_size, max_position_embeddings=spec.max_position_embeddings,
            rotary_pct=spec.rotary_pct, rotary_emb_base=spec.rotary_emb_base,
            use_parallel_residual=spec.use_parallel_residual, layer_norm_eps=spec.layer_norm_eps,
            attention_bias=spec.attention_bias, hidden_act=spec.hidden_act,
            tie_word_embeddings=spec.tie_word_embeddings, initializer_range=spec.initializer_range,
            hidden_dropout=0.0, attention_dropout=0.0, use_cache=False, **(special_ids or no_special_ids()),
        )
        cfg._attn_implementation = attn_implementation
        return cfg

    def export_refusal(self, spec: ModelSpec) -> str | None:
        if spec.qk_norm:
            return (f"model '{spec.name}': qk_norm has no place in transformers' GPTNeoXForCausalLM, so its "
                    f"final_model/ could not be written; use a llama-family model for QK-norm")
        return None

    def spec_from_hf_config(self, config: dict, name: str, source: str = "config.json") -> ModelSpec:
        """As transformers' GPTNeoXConfig reads it: old `rotary_pct`/`rotary_emb_base` keys or transformers 5's
        `rope_parameters` (`rope_scaling` over it). The embedding rows are the config's `vocab_size`, kept as
        they are."""
        hf = transformers_config(config, source)
        rope = dict(hf.rope_parameters or {})
        if rope_type(rope) != "default":
            raise ConfigError(f"{source}: {rope_refusal(config, rope_type(rope), 'only plain rotary embeddings')}")
        try:
            return ModelSpec(
                **config_sizes(hf, name), rotary_pct=float(rope.get("partial_rotary_factor", 0.25)),
                rotary_emb_base=float(rope.get("rope_theta", 10000.0)),
                use_parallel_residual=bool(hf.use_parallel_residual), layer_norm_eps=float(hf.layer_norm_eps),
                attention_bias=bool(hf.attention_bias), hidden_act=str(hf.hidden_act),
                tie_word_embeddings=bool(hf.tie_word_embeddings))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{source}: not a usable GPT-NeoX config ({type(exc).__name__}: {exc})") from None

    def from_hf_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Either head name, buffers or not -> the engine's parameter names."""
        out = {k: v for k, v in state.items() if not _NOT_WEIGHTS.search(k)}
        if "embed_out.weight" in out:
            out["lm_head.weight"] = out.pop("embed_out.weight")
        return out


ADAPTER = GPTNeoXAdapter()
