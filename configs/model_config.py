"""Model architectures by name: the presets the families register (utils/model/families.py; each family's
folder lists its own), for the config's `model` field. `gpt-neox-1.2b` is the seed's model; the small ones
exist for CPU runs. The architecture itself, `ModelSpec`, is the model layer's (utils/model/architecture.py);
it and `ConfigError` are named here too for the tools and tests that import them from here."""
from __future__ import annotations

from utils.errors import ConfigError
from utils.model.architecture import ModelSpec
from utils.model.families import check_model_record, presets

__all__ = ["LOSS_CHUNK_ROWS", "ConfigError", "ModelSpec", "check_model_record", "get_model_spec"]

# Rows of the flattened [tokens, hidden] activations per chunk of the native model's LM-head loss
# (utils/model/lm_loss.py): bounds the logits alive at once to LOSS_CHUNK_ROWS x vocab (8192 x 50304 fp32 =
# 1.6 GB, instead of 3.3 GB for a 8 x 2048 batch). Here because the memory plan (configs/profiles.py) counts it.
LOSS_CHUNK_ROWS = 8192


def __getattr__(name: str):
    """`MODELS`: every registered family's presets by name (read from the registry when asked for)."""
    if name == "MODELS":
        return presets()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get_model_spec(name: str) -> ModelSpec:
    models = presets()
    try:
        return models[name]
    except KeyError:
        raise ConfigError(
            f"unknown model '{name}'; valid models: {', '.join(sorted(models))}"
        ) from None
