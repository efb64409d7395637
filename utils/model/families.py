"""The model families, one line each: every family is a folder under utils/model/ whose `FAMILY` (a Family,
utils/model/family.py) says everything the engine asks of it. The config's choices come from here: the family
names, the presets by name (`configs.model_config.get_model_spec`), and which family reads an HF config.json
(its `model_type`). Nothing else in the engine names a family.

Layer: configs (a torch-free description the config layer reads: presets, counts, the registry).
"""
from __future__ import annotations

from configs.model_config import ConfigError, ModelSpec
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
