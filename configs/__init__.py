from configs.model_config import MODELS, ConfigError, ModelSpec, get_model_spec
from configs.training_config import PRESETS, TrainingConfig, get_training_config, parse_overrides

__all__ = ["MODELS", "PRESETS", "ConfigError", "ModelSpec", "TrainingConfig", "get_model_spec",
           "get_training_config", "parse_overrides"]
