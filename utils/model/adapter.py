"""`HFAdapter`: a family's transformers side, in one typed object (its folder's hf.py defines one; the
family's bundle names it): what its config.json carries both ways, its state-dict keys both ways, transformers'
class for a spec, and that class with the engine's interface (`model_impl=hf`).

The engine's parameter names are transformers' in-memory names for every family, so the key adapters are
copies that drop the buffers older files carry; a family whose files differ says so in its own adapter.
After a meta-device build and `load_state_dict(assign=True)` the class's non-persistent buffers (its rotary
tables) are rebuilt by `finish_transformers`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from utils.model.architecture import ModelSpec

_ENGINE_CLASSES: dict[tuple[type, str], type] = {}


class HFAdapter(ABC):
    final_norm: str = "norm"  # the final norm's name in transformers' base model
    dropped_keys: tuple[str, ...] = ("rotary_emb.inv_freq",)  # buffers some older files carry: not weights

    @abstractmethod
    def causal_lm_class(self, spec: ModelSpec) -> type:
        """transformers' own *ForCausalLM for `spec` (what export writes and generate.py runs)."""

    @abstractmethod
    def hf_config(self, spec: ModelSpec, attn_implementation: str = "sdpa", special_ids: dict | None = None):
        """transformers' config of `spec`; `special_ids` ({"bos_token_id", "eos_token_id", "pad_token_id"}) come
        from the tokenizer the model was trained with, None where unknown."""

    @abstractmethod
    def spec_from_hf_config(self, config: dict, name: str, source: str = "config.json") -> ModelSpec:
        """A spec from a config.json (checked by utils/model/hf.py check_hf_config first); what the family
        cannot build is one ConfigError line naming `source`."""

    def export_refusal(self, spec: ModelSpec) -> str | None:
        """Why transformers' class cannot hold `spec` (so its final_model/ could not be written), or None."""
        return None

    def from_hf_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """An HF state dict -> the engine's names (the same, less buffers older files carry)."""
        return {k: v for k, v in state.items() if not k.endswith(self.dropped_keys)}

    def to_hf_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return dict(state)

    def finish_transformers(self, model, config) -> None:
        """After a meta-device build and `load_state_dict(assign=True)`: the rotary buffers (in no state dict)."""
        rotary = model.base_model.rotary_emb
        model.base_model.rotary_emb = type(rotary)(config)

    def engine_class(self, spec: ModelSpec) -> type:
        """transformers' class for `spec` with the engine's interface (utils/model/layers.py HFCausalLM)."""
        base = self.causal_lm_class(spec)
        key = (base, self.final_norm)
        if key not in _ENGINE_CLASSES:
            from utils.model.layers import HFCausalLM

            _ENGINE_CLASSES[key] = type(f"HF{base.__name__}", (HFCausalLM, base), {"final_norm_name": self.final_norm})
        return _ENGINE_CLASSES[key]


def config_sizes(config: dict, name: str) -> dict:
    """The ModelSpec fields every family reads alike from a config.json: its sizes (the embedding rows as the
    file has them, no padding) and initializer_range; the caller catches KeyError, TypeError and ValueError."""
    return dict(name=name, vocab_size=int(config["vocab_size"]), hidden_size=int(config["hidden_size"]),
                num_hidden_layers=int(config["num_hidden_layers"]),
                num_attention_heads=int(config["num_attention_heads"]),
                intermediate_size=int(config["intermediate_size"]),
                max_position_embeddings=int(config["max_position_embeddings"]),
                initializer_range=float(config.get("initializer_range", 0.02)), pad_vocab_multiple=1)


def decoder_config_fields(spec: ModelSpec, special_ids: dict | None) -> dict:
    """The transformers config fields every pre-norm decoder family writes alike (Llama, Qwen, Gemma): sizes,
    grouped heads, the norms' eps, tying, no cache and no dropout, the tokenizer's special ids."""
    return dict(vocab_size=spec.padded_vocab_size, hidden_size=spec.hidden_size,
                intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_hidden_layers,
                num_attention_heads=spec.num_attention_heads, num_key_value_heads=spec.kv_heads,
                max_position_embeddings=spec.max_position_embeddings, initializer_range=spec.initializer_range,
                rms_norm_eps=spec.layer_norm_eps, use_cache=False, tie_word_embeddings=spec.tie_word_embeddings,
                attention_dropout=0.0, **(special_ids or no_special_ids()))


def no_special_ids() -> dict:
    return {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}


def rope_type(rope: dict) -> str:
    """A config.json's rotary type (transformers 5's `rope_parameters` or 4's `rope_scaling`): "default" for
    plain rotary."""
    return rope.get("rope_type", rope.get("type", "default")) or "default"


def llama3_scaling(rope: dict) -> tuple:
    """ModelSpec.rope_scaling from a "llama3" rope dict."""
    return (float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"]),
            int(rope["original_max_position_embeddings"]))


def rope_parameters(spec: ModelSpec, base: float | None = None) -> dict:
    """transformers 5's rope_parameters of one attention kind: plain, or Llama 3's scaling where set."""
    theta = spec.rotary_emb_base if base is None else base
    if not spec.rope_scaling:
        return {"rope_type": "default", "rope_theta": theta}
    factor, low, high, old_context = spec.rope_scaling
    return {"rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": low,
            "high_freq_factor": high, "original_max_position_embeddings": int(old_context)}
