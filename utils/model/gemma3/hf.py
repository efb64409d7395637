"""Gemma 3 text <-> transformers (`Gemma3ForCausalLM`, model_type `gemma3_text`): its config both ways
(transformers 5's per-kind `rope_parameters` or the published files' `rope_theta` + `rope_local_base_freq`,
`layer_types` or the older `sliding_window_pattern`). The parameter names are transformers' own.

Refused in one line: attention logit softcapping (SDPA and FlexAttention's fused kernels have none), rotary
scaling other than plain (the published 270M and 1B have none), bidirectional attention. The multimodal
`gemma3` directories (4B and up) hold a vision tower: not this family.
"""
from __future__ import annotations

import torch

from utils.errors import ConfigError
from utils.model.adapter import HFAdapter, config_sizes, decoder_config_fields, rope_type
from utils.model.architecture import ModelSpec
from utils.model.common.mlp import ACTIVATIONS

_KINDS = {"full": "full_attention", "sliding": "sliding_attention"}


class Gemma3Adapter(HFAdapter):
    def causal_lm_class(self, spec: ModelSpec | None = None) -> type:
        from transformers import Gemma3ForCausalLM

        return Gemma3ForCausalLM

    def hf_config(self, spec: ModelSpec, attn_implementation: str = "sdpa", special_ids: dict | None = None):
        from transformers import Gemma3TextConfig

        local = spec.rope_local_base or spec.rotary_emb_base
        cfg = Gemma3TextConfig(
            **decoder_config_fields(spec, special_ids), head_dim=spec.head_dim, hidden_activation=spec.hidden_act,
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": spec.rotary_emb_base},
                             "sliding_attention": {"rope_type": "default", "rope_theta": local}},
            attention_bias=spec.attention_bias, query_pre_attn_scalar=spec.query_pre_attn_scalar or spec.head_dim,
            # (transformers builds the sliding mask whether or not a layer uses it: it needs a window)
            sliding_window=spec.sliding_window or spec.max_position_embeddings,
            layer_types=[_KINDS[kind] for kind in spec.layer_kinds],
            final_logit_softcapping=spec.final_logit_softcapping or None, attn_logit_softcapping=None)
        cfg._attn_implementation = attn_implementation
        return cfg

    def spec_from_hf_config(self, config: dict, name: str, source: str = "config.json") -> ModelSpec:
        _refuse_what_it_cannot_build(config, source)
        ropes = _ropes(config)
        try:
            layers = int(config["num_hidden_layers"])
            named = config.get("layer_types")
            if named:
                kinds = tuple("sliding" if kind == "sliding_attention" else "full" for kind in named)
            else:  # older files: every sliding_window_pattern-th layer global
                every = int(config.get("sliding_window_pattern", 6))
                kinds = tuple("full" if (i + 1) % every == 0 else "sliding" for i in range(layers))
            return ModelSpec(
                **config_sizes(config, name), rotary_pct=1.0,
                rotary_emb_base=float(ropes["full_attention"]), rope_local_base=float(ropes["sliding_attention"]),
                use_parallel_residual=False, layer_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                attention_bias=bool(config.get("attention_bias", False)),
                hidden_act=str(config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
                family="gemma3",
                num_key_value_heads=int(config.get("num_key_value_heads") or config["num_attention_heads"]),
                attention_head_dim=int(config.get("head_dim") or 256), qk_norm=True,
                sliding_window=int(config.get("sliding_window") or 0) if "sliding" in kinds else 0,
                layer_types=kinds if "sliding" in kinds else (),
                query_pre_attn_scalar=int(config.get("query_pre_attn_scalar") or 256),
                final_logit_softcapping=float(config.get("final_logit_softcapping") or 0.0))
        except (KeyError, TypeError, ValueError, ConfigError) as exc:
            raise ConfigError(f"{source}: not a usable gemma3_text config ({type(exc).__name__}: {exc})") from None

    def finish_transformers(self, model, config) -> None:
        """The rotary tables and the embedding's scale: non-persistent buffers, in no state dict."""
        super().finish_transformers(model, config)
        embedding = model.base_model.embed_tokens
        embedding.embed_scale = torch.tensor(embedding.scalar_embed_scale)


def _ropes(config: dict) -> dict[str, float]:
    """The rotary base of each layer kind: transformers 5's per-kind rope_parameters, or the published files'
    rope_theta (global) and rope_local_base_freq (local)."""
    rope = config.get("rope_parameters") or {}
    if "full_attention" in rope or "sliding_attention" in rope:
        return {kind: (rope.get(kind) or {}).get("rope_theta", default)
                for kind, default in (("full_attention", 1000000.0), ("sliding_attention", 10000.0))}
    return {"full_attention": rope.get("rope_theta", config.get("rope_theta", 1000000.0)),
            "sliding_attention": config.get("rope_local_base_freq", 10000.0)}


def _refuse_what_it_cannot_build(config: dict, source: str) -> None:
    rope = config.get("rope_parameters") or {}
    kinds = [rope.get(k) or {} for k in _KINDS.values()] if any(k in rope for k in _KINDS.values()) else [rope]
    kinds.append(config.get("rope_scaling") or {})
    act = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    refuse = None
    if config.get("attn_logit_softcapping"):
        refuse = "attn_logit_softcapping is not supported (the fused attention kernels have none)"
    elif config.get("use_bidirectional_attention"):
        refuse = "use_bidirectional_attention is not supported (causal language models only)"
    elif any(rope_type(r) != "default" for r in kinds):
        refuse = (f"rope scaling {next(rope_type(r) for r in kinds if rope_type(r) != 'default')!r} is not "
                  f"supported (plain rotary, as gemma-3-270m and gemma-3-1b have)")
    elif act not in ACTIVATIONS:
        refuse = f"hidden_activation {act!r} is not supported; use one of {', '.join(ACTIVATIONS)}"
    if refuse:
        raise ConfigError(f"{source}: {refuse}")


ADAPTER = Gemma3Adapter()
