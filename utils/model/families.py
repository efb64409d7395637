"""Model families by name: each is one folder under utils/model/ (its native model, its HF adapter both
ways, its transformers reference class), and this registry is the only place that knows them all.

A `ModelSpec` names its family (`spec.family`); an HF directory's config.json names its `model_type`, which
one family claims. Everything else in the engine reaches a model through the family (building, HF config and
weights both ways) or through the model's own interface (utils/model/layers.py: CausalLM).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

from configs.model_config import FAMILY_NAMES, ConfigError, ModelSpec

# family name -> the module (in its folder) holding its HF adapter and builders
_MODULES = {"gpt_neox": "utils.model.gpt_neox.hf", "llama": "utils.model.llama.hf"}
assert tuple(_MODULES) == FAMILY_NAMES, "configs/model_config.py FAMILY_NAMES and utils/model/families.py disagree"


@dataclass(frozen=True)
class Family:
    """One family's entry points (functions of its folder's hf.py)."""

    name: str
    module: ModuleType

    @property
    def hf_model_types(self) -> tuple[str, ...]:
        return self.module.HF_MODEL_TYPES

    @property
    def residual_outputs(self) -> tuple[str, ...]:
        """A block's Linears that write into the residual stream, by name within the block."""
        return self.module.RESIDUAL_OUTPUTS

    def native_model(self, spec: ModelSpec):
        return self.module.native_model(spec)

    def hf_model_class(self):
        """transformers' class for this family with the engine's interface (`model_impl=hf`)."""
        return self.module.hf_model_class()

    def hf_config(self, spec: ModelSpec, attn_implementation: str = "sdpa", special_ids: dict | None = None):
        return self.module.hf_config(spec, attn_implementation, special_ids)

    def spec_from_hf_config(self, config: dict, name: str, source: str) -> ModelSpec:
        return self.module.spec_from_hf_config(config, name, source)

    def from_hf_state(self, state: dict) -> dict:
        return self.module.from_hf_state(state)

    def to_hf_state(self, state: dict) -> dict:
        return self.module.to_hf_state(state)

    def causal_lm_class(self, spec: ModelSpec):
        """transformers' own *ForCausalLM for `spec` (what export writes and generate.py runs)."""
        return self.module.causal_lm_class(spec)

    def finish_transformers(self, model, config) -> None:
        self.module.finish_transformers(model, config)


def family(name: str) -> Family:
    if name not in _MODULES:
        raise ConfigError(f"unknown model family '{name}'; valid: {', '.join(_MODULES)}")
    return Family(name, importlib.import_module(_MODULES[name]))


def family_of(spec: ModelSpec) -> Family:
    return family(spec.family)


def family_for_hf_config(config: dict, source: str) -> Family:
    """The family that reads an HF config.json of this `model_type`; one line naming the file otherwise."""
    model_type = config.get("model_type")
    for name in _MODULES:
        fam = family(name)
        if model_type in fam.hf_model_types:
            return fam
    known = sorted(t for name in _MODULES for t in family(name).hf_model_types)
    raise ConfigError(f"{source}: model_type is {model_type!r}; the engine loads {', '.join(repr(t) for t in known)} "
                      f"model directories")
