"""The Llama family <-> transformers: configs both ways (`llama` and `qwen2` config.json), and the classes
LlamaForCausalLM / Qwen2ForCausalLM (Qwen3ForCausalLM for a spec with QK-norm).

Names: the engine's parameters are transformers' own (`model.embed_tokens.weight`, `model.layers.N.self_attn.
q_proj.weight`, ..., `model.norm.weight`, `lm_head.weight`), so weights come in and go out as they are; a
tied model's files carry no `lm_head.weight` (the embedding is the head). A spec with `qkv_bias` is a Qwen2
model (biases on q/k/v, none on o), any other a Llama one.
"""
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


class LlamaAdapter(HFAdapter):
    def causal_lm_class(self, spec: ModelSpec | None = None) -> type:
        from transformers import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

        if spec is not None and spec.qk_norm:
            return Qwen3ForCausalLM
        return Qwen2ForCausalLM if spec is not None and spec.qkv_bias else LlamaForCausalLM

    def hf_config(self, spec: ModelSpec, attn_implementation: str = "sdpa", special_ids: dict | None = None):
        """transformers' LlamaConfig (Qwen2Config for a spec with `qkv_bias`, Qwen3Config with `qk_norm`)."""
        from transformers import LlamaConfig, Qwen2Config, Qwen3Config

        common = decoder_config_fields(spec, special_ids) | dict(hidden_act=spec.hidden_act,
                                                                  rope_parameters=rope_parameters(spec))
        if spec.qk_norm:
            cfg = Qwen3Config(**common, attention_bias=spec.attention_bias, head_dim=spec.head_dim,
                              use_sliding_window=False)
        elif spec.qkv_bias:
            cfg = Qwen2Config(**common, use_sliding_window=False)
        else:
            cfg = LlamaConfig(**common, attention_bias=spec.attention_bias, mlp_bias=False, head_dim=spec.head_dim)
        cfg._attn_implementation = attn_implementation
        return cfg

    def spec_from_hf_config(self, config: dict, name: str, source: str = "config.json") -> ModelSpec:
        """As transformers' LlamaConfig or Qwen2Config reads it: transformers 4's `rope_theta` + `rope_scaling`
        or 5's `rope_parameters` (`rope_scaling` over it). The embedding rows are the config's `vocab_size`,
        kept as they are."""
        hf = transformers_config(config, source)
        qwen = hf.model_type == "qwen2"
        rope = dict(hf.rope_parameters or {})
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        refuse = None
        if rope_type(rope) not in ("default", "llama3"):
            refuse = rope_refusal(config, rope_type(rope), "plain rotary or Llama 3's 'llama3'")
        elif getattr(hf, "mlp_bias", False):
            refuse = "mlp_bias is not supported"
        elif hf.hidden_act != "silu":
            refuse = f"hidden_act {hf.hidden_act!r} is not supported (SwiGLU: 'silu')"
        elif "sliding" in layer_kinds(hf):
            refuse = "sliding-window layers are not supported (use_sliding_window: full attention only)"
        elif head_dim * hf.num_attention_heads != hf.hidden_size:
            refuse = "a head_dim other than hidden_size / num_attention_heads is not supported"
        if refuse:
            raise ConfigError(f"{source}: {refuse}")
        try:
            return ModelSpec(
                **config_sizes(hf, name), rotary_pct=1.0, rotary_emb_base=float(rope.get("rope_theta", 10000.0)),
                use_parallel_residual=False, layer_norm_eps=float(hf.rms_norm_eps),
                attention_bias=bool(getattr(hf, "attention_bias", False)) and not qwen, hidden_act="silu",
                tie_word_embeddings=bool(hf.tie_word_embeddings), family="llama", num_key_value_heads=kv_heads(hf),
                rope_scaling=llama3_scaling(rope) if rope_type(rope) == "llama3" else (), qkv_bias=qwen)
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{source}: not a usable {config.get('model_type')} config "
                              f"({type(exc).__name__}: {exc})") from None


ADAPTER = LlamaAdapter()
