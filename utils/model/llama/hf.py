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
    llama3_scaling,
    rope_parameters,
    rope_type,
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
        """transformers 4's `rope_theta` + `rope_scaling` or 5's `rope_parameters`. The embedding rows are the
        config's `vocab_size`, kept as they are."""
        qwen = config.get("model_type") == "qwen2"
        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        refuse = None
        if rope_type(rope) not in ("default", "llama3"):
            refuse = f"rope scaling {rope_type(rope)!r} is not supported (plain rotary or Llama 3's 'llama3')"
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
            return ModelSpec(
                **config_sizes(config, name),
                rotary_pct=1.0, rotary_emb_base=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
                use_parallel_residual=False, layer_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                attention_bias=bool(config.get("attention_bias", False)) and not qwen, hidden_act="silu",
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                family="llama",
                num_key_value_heads=int(config.get("num_key_value_heads") or config["num_attention_heads"]),
                rope_scaling=llama3_scaling(rope) if rope_type(rope) == "llama3" else (), qkv_bias=qwen)
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{source}: not a usable {config.get('model_type')} config "
                              f"({type(exc).__name__}: {exc})") from None


ADAPTER = LlamaAdapter()
