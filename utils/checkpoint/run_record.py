"""The run record: what a checkpoint says about the run that wrote it (in trainer_state.json, beside the
step counters), and what a resume checks against this run's own record before loading anything."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class RunRecord:
    world_size: int  # processes that wrote it
    strategy: str = "ddp"  # ddp | fsdp (absent in checkpoints from before FSDP: ddp)
    global_batch_sequences: int | None = None  # sequences per optimizer step, all ranks together
    seq_len: int | None = None
    config: dict = field(default_factory=dict)  # the whole training config
    model: dict = field(default_factory=dict)  # the architecture (ModelSpec.to_dict())
    data: Any = None  # the loader's fingerprint of the data it reads
    max_steps: int | None = None  # this run's horizon; not written (the config holds it)

    def to_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "max_steps"}

    @classmethod
    def from_json(cls, saved: dict) -> "RunRecord":
        """From a trainer_state.json of any version (checked: utils/checkpoint/format.py check_trainer_state).
        Fields it lacks keep their defaults; its config's fields a resume reads back are typed, and those an
        earlier engine did not record are what it trained with (configs/training_config.py recorded_settings)."""
        from configs.training_config import recorded_settings

        known = {k: saved[k] for k in cls.__dataclass_fields__ if k in saved and k != "max_steps"}
        config = dict(known.get("config") or {})
        known["config"] = config | recorded_settings(config, "config")
        return cls(**{"world_size": 1} | known)
