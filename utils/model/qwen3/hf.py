"""Qwen3 <-> transformers (`Qwen3ForCausalLM`, model_type `qwen3`): its config both ways. The parameter names
are transformers' own (`model.layers.N.self_attn.q_norm.weight`, ...), so the keys go both ways unchanged."""
from __future__ import annotations

from utils.errors import ConfigError
from utils.model.adapter import (
    HFAdapter,
    config_sizes,
    decoder_config_fields,
    llama3_scaling,
    rope_parameters,
    rope_type,
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
        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        act = config.get("hidden_act", "silu")
        if rope_type(rope) not in ("default", "llama3"):
            raise ConfigError(f"{source}: rope scaling {rope_type(rope)!r} is not supported (plain rotary or "
                              f"Llama 3's 'llama3')")
        if act not in ACTIVATIONS:
            raise ConfigError(f"{source}: hidden_act {act!r} is not supported; use one of {', '.join(ACTIVATIONS)}")
        try:
            layers = int(config["num_hidden_layers"])
            window, kinds = _sliding(config, layers)
            return ModelSpec(
                **config_sizes(config, name), rotary_pct=1.0,
                rotary_emb_base=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
                use_parallel_residual=False, layer_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                attention_bias=bool(config.get("attention_bias", False)), hidden_act=act,
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                family="qwen3",
                num_key_value_heads=int(config.get("num_key_value_heads") or config["num_attention_heads"]),
                attention_head_dim=int(config.get("head_dim") or 0), qk_norm=True,
                rope_scaling=llama3_scaling(rope) if rope_type(rope) == "llama3" else (),
                sliding_window=window, layer_types=kinds)
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{source}: not a usable qwen3 config ({type(exc).__name__}: {exc})") from None


def _sliding(config: dict, layers: int) -> tuple[int, tuple]:
    """(sliding_window, layer_types) of a Qwen3 config.json: none unless use_sliding_window; its layer_types
    where given, else the layers from max_window_layers on (transformers' rule)."""
    if not config.get("use_sliding_window") or not config.get("sliding_window"):
        return 0, ()
    named = config.get("layer_types")
    if named:
        kinds = tuple("sliding" if kind == "sliding_attention" else "full" for kind in named)
    else:
        first = int(config.get("max_window_layers", 28))
        kinds = tuple("sliding" if i >= first else "full" for i in range(layers))
    return (int(config["sliding_window"]), kinds) if "sliding" in kinds else (0, ())


ADAPTER = Qwen3Adapter()
