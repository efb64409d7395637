"""The user-facing configuration: one flat set of fields (YAML files, `--set`, `--help`), its presets, the
model architectures by name, and the memory plan.

- `training_config`: the fields with their types, ranges and help, presets and config files, `--set`;
- `model_config`: model architectures by name (the families' presets; ModelSpec is the model layer's:
  utils/model/architecture.py);
- `profiles`: memory profiles and the memory plan;
- `settle`: the one place a run's config is settled; `query`: what the launcher asks; `reference`: the
  generated configuration page.

May import: utils, utils.observe, utils.training (their registries: the config's choices are their keys).
"""
from configs import model_config
from configs.model_config import ConfigError, ModelSpec, get_model_spec
from configs.training_config import PRESETS, TrainingConfig, get_training_config, parse_overrides

__all__ = ["MODELS", "PRESETS", "ConfigError", "ModelSpec", "TrainingConfig", "get_model_spec",
           "get_training_config", "parse_overrides"]


def __getattr__(name: str):
    """`MODELS`: the presets by name, read from the family registry when asked for (configs.model_config)."""
    if name == "MODELS":
        return model_config.MODELS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
