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

from utils.errors import ConfigError
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


def transformers_config(config: dict, source: str):
    """What transformers makes of a config.json (its values checked first: utils/model/hf.py check_hf_config):
    the config class AutoConfig takes for its `model_type`, built from the file as `from_pretrained` builds it
    (`from_dict`), so every precedence and default rule is theirs: `rope_scaling` read over `rope_parameters`,
    `rope_theta` where the rope object has none, Qwen3's `head_dim` of 128 and Qwen2's 32 k/v heads where the
    file names none, `layer_types` from `max_window_layers` or `sliding_window_pattern`, Gemma 3's tied head.
    A family reads its architecture from this object. What the class itself refuses is one ConfigError line
    naming the file."""
    import copy

    from transformers import CONFIG_MAPPING
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its advice on a file's values: the engine's own lines say what it does
    try:
        return CONFIG_MAPPING[config["model_type"]].from_dict(copy.deepcopy(config))
    except Exception as exc:  # noqa: BLE001 - transformers' validation raises ValueError, TypeError, its own kinds
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"{source}: transformers cannot read it as a {config['model_type']} config "
                          f"({first[:200]})") from None
    finally:
        hf_logging.set_verbosity(verbosity)


def config_sizes(hf, name: str) -> dict:
    """The ModelSpec fields every family reads alike from transformers' config of a config.json
    (`transformers_config`): its sizes (the embedding rows as the file has them, no padding), k/v heads and
    initializer_range; the caller catches KeyError, TypeError and ValueError."""
    return dict(name=name, vocab_size=int(hf.vocab_size), hidden_size=int(hf.hidden_size),
                num_hidden_layers=int(hf.num_hidden_layers), num_attention_heads=int(hf.num_attention_heads),
                intermediate_size=int(hf.intermediate_size), max_position_embeddings=int(hf.max_position_embeddings),
                initializer_range=float(hf.initializer_range), pad_vocab_multiple=1)


def kv_heads(hf) -> int:
    """The k/v heads transformers' attention takes (its config sets them: all the query heads where unset)."""
    return int(getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads)


def layer_kinds(hf) -> tuple[str, ...]:
    """Each layer's attention in transformers' config ("full" or "sliding"): its `layer_types`, all full
    where it has none."""
    return tuple("sliding" if kind == "sliding_attention" else "full"
                 for kind in (getattr(hf, "layer_types", None) or ["full_attention"] * hf.num_hidden_layers))


def rope_refusal(config: dict, kind: str, supported: str) -> str:
    """The line for a rope type the engine does not implement, naming which of the file's objects it came from
    where it has both (transformers applies `rope_scaling` over `rope_parameters`)."""
    both = (" (from rope_scaling, which transformers applies over rope_parameters)"
            if config.get("rope_scaling") and config.get("rope_parameters") else "")
    return f"rope scaling {kind!r} is not supported{both}; {supported}"


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
