"""The model families, one line each: every family is a folder under utils/model/ whose `FAMILY` (a Family,
utils/model/family.py) says everything the engine asks of it. The config's choices come from here: the family
names, the presets by name (`configs.model_config.get_model_spec`), which family reads an HF config.json (its
`model_type`), and the check of a spec's record (a checkpoint's, which names its family). Nothing else in the
engine names a family.

Layer: configs (a torch-free description the config layer reads: presets, counts, the registry).
"""
from __future__ import annotations

from utils.errors import ConfigError
from utils.model.architecture import LAYER_KINDS, MAX_SIZE, ModelSpec
from utils.model.family import Family
from utils.model.gemma3 import FAMILY as GEMMA3
from utils.model.gpt_neox import FAMILY as GPT_NEOX
from utils.model.llama import FAMILY as LLAMA
from utils.model.qwen3 import FAMILY as QWEN3

FAMILIES: dict[str, Family] = {f.name: f for f in (
    GPT_NEOX,
    LLAMA,
    QWEN3,
    GEMMA3,
)}


def family_names() -> tuple[str, ...]:
    return tuple(FAMILIES)


def family(name: str) -> Family:
    if name not in FAMILIES:
        raise ConfigError(f"unknown model family '{name}'; valid: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def family_of(spec: ModelSpec) -> Family:
    return family(spec.family)


def presets() -> dict[str, ModelSpec]:
    """Every family's presets by name."""
    out: dict[str, ModelSpec] = {}
    for fam in FAMILIES.values():
        for spec in fam.presets:
            assert spec.name not in out, f"preset {spec.name} is registered twice"
            out[spec.name] = spec
    return out


def family_for_hf_config(config: dict, source: str) -> Family:
    """The family that reads an HF config.json of this `model_type`; one line naming the file otherwise."""
    model_type = config.get("model_type")
    for fam in FAMILIES.values():
        if model_type in fam.hf_model_types:
            return fam
    known = sorted(t for fam in FAMILIES.values() for t in fam.hf_model_types)
    raise ConfigError(f"{source}: model_type is {model_type!r}; the engine loads {', '.join(repr(t) for t in known)} "
                      f"model directories")


_POSITIVE_NUMBERS = ("rotary_emb_base", "layer_norm_eps", "initializer_range")
_NON_NEGATIVE_NUMBERS = ("rope_local_base", "final_logit_softcapping")
_ZERO_MEANS_UNSET = ("num_key_value_heads", "attention_head_dim", "sliding_window", "query_pre_attn_scalar")


def check_model_record(record) -> None:
    """A ModelSpec's record (`to_dict()`, as a checkpoint's trainer_state.json keeps it, which may come from a
    bucket or be crafted) before a spec is made of it: each field it holds of its type and in its range (sizes
    positive integers below 2**31, at least 2 positions, the rotary share in (0, 1], eps, rotary base and
    initializer_range positive finite numbers, flags true or false, a known family), hidden_size a multiple of
    the heads and they of the k/v heads. ValueError naming the field (`model.FIELD`)."""
    import math

    def bad(field: str, value, want: str):
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        raise ValueError(f"model.{field} is {shown}, not {want}")

    def number(value) -> bool:
        return type(value) in (int, float) and math.isfinite(value)

    def rope_scaling(value) -> bool:  # none, or Llama 3's four: three factors and the original positions
        return isinstance(value, (list, tuple)) and (not value or len(value) == 4 and type(value[3]) is int
                                                     and all(number(v) and v > 0 for v in value))

    if not isinstance(record, dict):
        bad("", type(record).__name__, "an object")
    declared = ModelSpec.__dataclass_fields__
    for field, value in record.items():
        kind = declared[field].type if field in declared else "int" if field == "padded_vocab_size" else None
        least = 0 if field in _ZERO_MEANS_UNSET else 2 if field == "max_position_embeddings" else 1
        if kind is None:
            bad(field, value, "a field of a model record")
        elif kind == "int" and (type(value) is not int or not least <= value < MAX_SIZE):
            bad(field, value, f"an integer of at least {least}, below {MAX_SIZE:,}")
        elif field == "rotary_pct" and not (number(value) and 0 < value <= 1):
            bad(field, value, "a number in (0, 1]")
        elif field in _POSITIVE_NUMBERS and not (number(value) and value > 0):
            bad(field, value, "a positive finite number")
        elif field in _NON_NEGATIVE_NUMBERS and not (number(value) and value >= 0):
            bad(field, value, "a finite number of at least 0")
        elif kind == "bool" and not isinstance(value, bool):
            bad(field, value, "true or false")
        elif kind == "str" and not (isinstance(value, str) and (value or field == "name")):
            bad(field, value, "a non-empty string")
        elif field == "family" and value not in family_names():
            bad(field, value, f"one of {', '.join(family_names())}")
        elif field == "rope_scaling" and not rope_scaling(value):
            bad(field, value, "[] or [factor, low_freq_factor, high_freq_factor, original positions], each above 0")
        elif field == "layer_types" and not (isinstance(value, (list, tuple)) and all(v in LAYER_KINDS for v in value)):
            bad(field, value, f"a list of {' or '.join(LAYER_KINDS)}")
    heads, kv_heads = record.get("num_attention_heads"), record.get("num_key_value_heads") or None
    if heads and not record.get("attention_head_dim") and record.get("hidden_size", 0) % heads:
        bad("hidden_size", record["hidden_size"], f"a multiple of num_attention_heads ({heads})")
    if heads and kv_heads and heads % kv_heads:
        bad("num_attention_heads", heads, f"a multiple of num_key_value_heads ({kv_heads})")
