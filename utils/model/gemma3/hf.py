"""Gemma 3 text <-> transformers (`Gemma3ForCausalLM`, model_type `gemma3_text`): its config both ways, read
as transformers' Gemma3TextConfig reads it (transformers 5's per-kind `rope_parameters` or the published files'
`rope_theta` + `rope_local_base_freq`, `layer_types` or the older `sliding_window_pattern`). The parameter
names are transformers' own.

Refused in one line: attention logit softcapping (SDPA and FlexAttention's fused kernels have none), rotary
scaling other than plain (the published 270M and 1B have none), bidirectional attention. The multimodal
`gemma3` directories (4B and up) hold a vision tower: not this family.
"""
from __future__ import annotations

import torch

from utils.errors import ConfigError
from utils.model.adapter import (
    HFAdapter,
    config_sizes,
    decoder_config_fields,
    kv_heads,
    layer_kinds,
    rope_refusal,
    rope_type,
    transformers_config,
)
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
        """As transformers' Gemma3TextConfig reads it: its per-kind rotary bases (from `rope_parameters`, or
        `rope_theta` and `rope_local_base_freq`, `rope_scaling` merged into the full layers'), `layer_types` or
        every `sliding_window_pattern`-th layer full, a head_dim, scalar and window of its defaults where unset,
        a tied head unless the file says otherwise."""
        hf = transformers_config(config, source)
        kinds = layer_kinds(hf)
        _refuse_what_it_cannot_build(hf, kinds, config, source)
        ropes, sliding = hf.rope_parameters, "sliding" in kinds
        try:
            return ModelSpec(
                **config_sizes(hf, name), rotary_pct=1.0,
                rotary_emb_base=float(ropes["full_attention"]["rope_theta"]),
                rope_local_base=float(ropes["sliding_attention"]["rope_theta"]), use_parallel_residual=False,
                layer_norm_eps=float(hf.rms_norm_eps), attention_bias=bool(hf.attention_bias),
                hidden_act=hf.hidden_activation, tie_word_embeddings=bool(hf.tie_word_embeddings), family="gemma3",
                num_key_value_heads=kv_heads(hf), attention_head_dim=int(hf.head_dim), qk_norm=True,
                sliding_window=int(hf.sliding_window) if sliding else 0, layer_types=kinds if sliding else (),
                query_pre_attn_scalar=int(hf.query_pre_attn_scalar),
                final_logit_softcapping=float(hf.final_logit_softcapping or 0.0))
        except (KeyError, TypeError, ValueError, ConfigError) as exc:
            raise ConfigError(f"{source}: not a usable gemma3_text config ({type(exc).__name__}: {exc})") from None

    def finish_transformers(self, model, config) -> None:
        """The rotary tables and the embedding's scale: non-persistent buffers, in no state dict."""
        super().finish_transformers(model, config)
        embedding = model.base_model.embed_tokens
        embedding.embed_scale = torch.tensor(embedding.scalar_embed_scale)


def _refuse_what_it_cannot_build(hf, kinds: tuple, config: dict, source: str) -> None:
    ropes = hf.rope_parameters or {}
    other = [rope_type(r or {}) for r in ropes.values() if rope_type(r or {}) != "default"]
    refuse = None
    if hf.attn_logit_softcapping:
        refuse = "attn_logit_softcapping is not supported (the fused attention kernels have none)"
    elif hf.use_bidirectional_attention:
        refuse = "use_bidirectional_attention is not supported (causal language models only)"
    elif other:
        refuse = rope_refusal(config, other[0], "plain rotary, as gemma-3-270m and gemma-3-1b have")
    elif hf.hidden_activation not in ACTIVATIONS:
        refuse = f"hidden_activation {hf.hidden_activation!r} is not supported; use one of {', '.join(ACTIVATIONS)}"
    elif "sliding" in kinds and not hf.sliding_window:
        refuse = "its layers slide but sliding_window is unset, which transformers cannot run; give sliding_window"
    if refuse:
        raise ConfigError(f"{source}: {refuse}")


ADAPTER = Gemma3Adapter()
