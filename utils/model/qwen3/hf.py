"""Qwen3 <-> transformers (`Qwen3ForCausalLM`, model_type `qwen3`): its config both ways. The parameter names
are transformers' own (`model.layers.N.self_attn.q_norm.weight`, ...), so the keys go both ways unchanged."""
from __future__ import annotations

from utils.errors import ConfigError
from utils.model.adapter import (
    HFAdapter,
    config_sizes,
    decoder_config_fields,
    kv_heads,
    layer_kinds,
    llama3_scaling,
    rope_parameters,
    rope_refusal,
    rope_type,
    transformers_config,
)
from utils.model.architecture import ModelSpec
from utils.model.common.mlp import ACTIVATIONS

_KINDS = {"full": "full_attention", "sliding": "sliding_attention"}


class Qwen3Adapter(HFAdapter):
    def causal_lm_class(self, spec: ModelSpec | None = None) -> type:
        from transformers import Qwen3ForCausalLM

        return Qwen3ForCausalLM

    def hf_config(self, spec: ModelSpec, attn_implementation: str = "sdpa", special_ids: dict | None = None):
        from transformers import Qwen3Config

        sliding = "sliding" in spec.layer_kinds
        cfg = Qwen3Config(
            **decoder_config_fields(spec, special_ids), head_dim=spec.head_dim, hidden_act=spec.hidden_act,
            rope_parameters=rope_parameters(spec), attention_bias=spec.attention_bias, use_sliding_window=sliding,
            sliding_window=spec.sliding_window if sliding else None,
            layer_types=[_KINDS[kind] for kind in spec.layer_kinds])
        cfg._attn_implementation = attn_implementation
        return cfg

    def spec_from_hf_config(self, config: dict, name: str, source: str = "config.json") -> ModelSpec:
        """As transformers' Qwen3Config reads it: `rope_scaling` over `rope_parameters`, a `head_dim` of 128
        where the file names none, sliding layers where `use_sliding_window` (its `layer_types`, else the
        layers from `max_window_layers` on)."""
        hf = transformers_config(config, source)
        rope = dict(hf.rope_parameters or {})
        kinds = layer_kinds(hf)
        refuse = None
        if rope_type(rope) not in ("default", "llama3"):
            refuse = rope_refusal(config, rope_type(rope), "plain rotary or Llama 3's 'llama3'")
        elif hf.hidden_act not in ACTIVATIONS:
            refuse = f"hidden_act {hf.hidden_act!r} is not supported; use one of {', '.join(ACTIVATIONS)}"
        elif "sliding" in kinds and not hf.sliding_window:
            refuse = ("layer_types names sliding layers but there is no sliding_window (use_sliding_window is "
                      "false), which transformers cannot run; set use_sliding_window or make every layer full")
        if refuse:
            raise ConfigError(f"{source}: {refuse}")
        sliding = "sliding" in kinds
        try:
            return ModelSpec(
                **config_sizes(hf, name), rotary_pct=1.0, rotary_emb_base=float(rope.get("rope_theta", 10000.0)),
                use_parallel_residual=False, layer_norm_eps=float(hf.rms_norm_eps),
                attention_bias=bool(hf.attention_bias), hidden_act=hf.hidden_act,
                tie_word_embeddings=bool(hf.tie_word_embeddings), family="qwen3", num_key_value_heads=kv_heads(hf),
                attention_head_dim=int(hf.head_dim), qk_norm=True,
                rope_scaling=llama3_scaling(rope) if rope_type(rope) == "llama3" else (),
                sliding_window=int(hf.sliding_window) if sliding else 0, layer_types=kinds if sliding else ())
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{source}: not a usable qwen3 config ({type(exc).__name__}: {exc})") from None


ADAPTER = Qwen3Adapter()
