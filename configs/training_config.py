"""Training presets (`demo`, `test`, `production`) as typed dataclasses, overridable field by field."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields, replace

from configs.model_config import ConfigError, get_model_spec

MIXED_PRECISION_MODES = ("bf16", "fp16", "no")
MEMORY_PROFILES = ("auto", "off", "conservative", "balanced", "aggressive")
OPTIMIZER_STATE_DTYPES = ("fp32", "bf16")


@dataclass
class TrainingConfig:
    preset: str = "custom"
    model: str = "gpt-neox-1.2b"
    seq_len: int = 0  # 0: the model's max_position_embeddings
    # data
    data_dir: str = "data/training"
    max_files: int = -1  # -1: every shard found
    val_files: int = 1  # shards held out (by file) for validation
    demo_data: bool = False  # build the demo corpus into data_dir when it has no shards
    dataloader_num_workers: int = 4
    prefetch_factor: int = 4
    # optimisation
    max_steps: int = 10000  # the LR schedule's horizon and where training ends
    stop_at_step: int = 0  # >0: save and exit 0 after this step, schedule unchanged (time-limited jobs)
    per_device_train_batch_size: int = 4
    gradient_accumulation_steps: int = 4
    learning_rate: float = 3e-4
    min_lr_ratio: float = 0.1  # cosine decays to learning_rate * min_lr_ratio at max_steps
    warmup_steps: int = 500
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    max_grad_norm: float = 1.0
    seed: int = 42
    # speed and memory
    mixed_precision: str = "bf16"
    compile_model: bool = True
    gradient_checkpointing: bool = False
    profile: str = "auto"  # memory profile (utils/profiles.py): auto picks by GPU memory; off keeps the config
    optimizer_state_dtype: str = "fp32"  # bf16 halves AdamW's moment memory (the conservative profile)
    preflight_steps: int = 2  # forward/backward passes checked for finite loss and gradients before step 1
    # logging, eval, checkpoints
    logging_steps: int = 100
    eval_interval: int = 500
    eval_batches: int = 20
    save_steps: int = 500
    save_total_limit: int = 3
    run_name: str = ""  # default: the preset name
    gcs_bucket: str = ""  # empty: checkpoints stay local
    gcs_prefix: str = ""  # checkpoints go to gs://BUCKET/PREFIX/checkpoints/RUN/NAME/
    background_upload: bool = True
    process_group_timeout_s: int = 3600  # long enough for rank 0's checkpoint I/O

    @property
    def effective_run_name(self) -> str:
        return self.run_name or self.preset

    def effective_seq_len(self) -> int:
        return self.seq_len or get_model_spec(self.model).max_position_embeddings

    def validate(self) -> "TrainingConfig":
        spec = get_model_spec(self.model)  # raises ConfigError for an unknown model
        if self.mixed_precision not in MIXED_PRECISION_MODES:
            raise ConfigError(
                f"mixed_precision='{self.mixed_precision}' is not valid; use one of "
                f"{', '.join(MIXED_PRECISION_MODES)}"
            )
        if self.profile not in MEMORY_PROFILES:
            raise ConfigError(f"profile='{self.profile}' is not valid; use one of {', '.join(MEMORY_PROFILES)}")
        if self.optimizer_state_dtype not in OPTIMIZER_STATE_DTYPES:
            raise ConfigError(f"optimizer_state_dtype='{self.optimizer_state_dtype}' is not valid; use one of "
                              f"{', '.join(OPTIMIZER_STATE_DTYPES)}")
        positive = ("max_steps", "per_device_train_batch_size", "gradient_accumulation_steps",
                    "logging_steps", "eval_interval", "save_steps", "save_total_limit", "eval_batches",
                    "process_group_timeout_s")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be at least 1")
        for name in ("warmup_steps", "dataloader_num_workers", "val_files", "seq_len", "stop_at_step",
                     "preflight_steps"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)} must not be negative")
        if self.prefetch_factor < 1:
            raise ConfigError(f"prefetch_factor={self.prefetch_factor} must be at least 1")
        if self.max_files == 0 or self.max_files < -1:
            raise ConfigError(f"max_files={self.max_files} must be -1 (all files) or a positive count")
        if self.learning_rate <= 0 or not (0 <= self.min_lr_ratio <= 1):
            raise ConfigError("learning_rate must be > 0 and min_lr_ratio within [0, 1]")
        if self.effective_seq_len() > spec.max_position_embeddings:
            raise ConfigError(
                f"seq_len={self.seq_len} exceeds model '{self.model}' max_position_embeddings="
                f"{spec.max_position_embeddings}"
            )
        if self.gcs_bucket.startswith("gs://") or "/" in self.gcs_bucket:
            raise ConfigError(
                f"gcs_bucket='{self.gcs_bucket}' must be a bare bucket name; put folders in gcs_prefix"
            )
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


PRESETS: dict[str, TrainingConfig] = {
    # CPU, minutes, no network: builds its own corpus from the Python standard library.
    "demo": TrainingConfig(
        preset="demo", model="demo", data_dir="data/demo", demo_data=True, val_files=2,
        max_steps=400, per_device_train_batch_size=16, gradient_accumulation_steps=1,
        learning_rate=2e-3, warmup_steps=30, weight_decay=0.1, mixed_precision="no",
        compile_model=False, dataloader_num_workers=1, prefetch_factor=2,
        logging_steps=20, eval_interval=100, eval_batches=10, save_steps=100, save_total_limit=2,
    ),
    # The seed's quick validation of the 1.2B model on a GPU.
    "test": TrainingConfig(
        preset="test", model="gpt-neox-1.2b", max_files=5, max_steps=1000,
        per_device_train_batch_size=2, gradient_accumulation_steps=2, learning_rate=3e-4,
        warmup_steps=100, save_steps=200, logging_steps=25, eval_interval=200, eval_batches=10,
        compile_model=True, mixed_precision="bf16", dataloader_num_workers=2, prefetch_factor=2,
    ),
    # The seed's production run.
    "production": TrainingConfig(
        preset="production", model="gpt-neox-1.2b", max_files=-1, max_steps=10000,
        per_device_train_batch_size=4, gradient_accumulation_steps=4, learning_rate=3e-4,
        warmup_steps=500, save_steps=500, save_total_limit=3, logging_steps=100, eval_interval=500,
        compile_model=True, mixed_precision="bf16", dataloader_num_workers=4, prefetch_factor=4,
    ),
}

_SETTABLE = {f.name: f for f in fields(TrainingConfig) if f.name != "preset"}


def _coerce(name: str, raw: str):
    kind = _SETTABLE[name].type
    try:
        if kind == "bool":
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
        return raw
    except ValueError:
        raise ConfigError(f"--set {name}={raw}: expected a value of type {kind}") from None


def parse_overrides(pairs: list[str]) -> dict:
    """`["key=value", ...]` -> typed dict; an unknown key or bad value is a ConfigError."""
    out = {}
    for pair in pairs:
        if "=" not in pair:
            raise ConfigError(f"--set {pair}: expected KEY=VALUE")
        key, raw = pair.split("=", 1)
        key = key.strip()
        if key not in _SETTABLE:
            raise ConfigError(
                f"--set {key}: unknown training-config field; valid fields: {', '.join(sorted(_SETTABLE))}"
            )
        out[key] = _coerce(key, raw)
    return out


def get_training_config(preset: str, overrides: dict | None = None) -> TrainingConfig:
    if preset not in PRESETS:
        raise ConfigError(f"unknown config '{preset}'; valid configs: {', '.join(PRESETS)}")
    return replace(PRESETS[preset], **(overrides or {})).validate()
