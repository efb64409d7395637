"""Memory profiles: micro-batch, activation checkpointing and optimizer-state precision by device memory.

A profile never changes what is learned per optimizer step: it trades micro-batch for accumulation so the
per-process batch (micro x accumulation) stays the preset's. `auto` picks by the GPU's memory and does
nothing on the CPU; `off` trains the config exactly as given.

Budget for GPT-NeoX 1.2B (1.41B parameters, 50304-row embeddings untied): fp32 weights 5.6 GB + fp32
gradients 5.6 GB + AdamW moments 11.3 GB = 22.6 GB before any activation. So a 24 GB card cannot hold
plain AdamW at all; `conservative` keeps the moments in bf16 (5.6 GB) and checkpoints activations.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from configs.model_config import ConfigError


@dataclass(frozen=True)
class MemoryProfile:
    name: str
    min_device_gib: float  # auto picks the largest profile whose minimum the device meets
    micro_batch: int
    gradient_checkpointing: bool
    optimizer_state_dtype: str  # "fp32" | "bf16"


PROFILES = {
    p.name: p
    for p in (
        MemoryProfile("aggressive", 70, micro_batch=8, gradient_checkpointing=False, optimizer_state_dtype="fp32"),
        MemoryProfile("balanced", 36, micro_batch=4, gradient_checkpointing=True, optimizer_state_dtype="fp32"),
        MemoryProfile("conservative", 0, micro_batch=2, gradient_checkpointing=True, optimizer_state_dtype="bf16"),
    )
}


def choose_profile(device_gib: float) -> MemoryProfile:
    return max((p for p in PROFILES.values() if device_gib >= p.min_device_gib), key=lambda p: p.min_device_gib)


def apply_profile(cfg, profile: MemoryProfile):
    """The config with the profile's settings; accumulation absorbs the micro-batch change."""
    per_process = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps
    micro = min(profile.micro_batch, per_process)
    if per_process % micro:
        raise ConfigError(
            f"profile '{profile.name}' uses micro-batch {micro}, which does not divide the per-process batch "
            f"{per_process} (per_device_train_batch_size x gradient_accumulation_steps); choose another "
            f"--set profile=... or set the batch sizes so it divides")
    return replace(cfg, per_device_train_batch_size=micro, gradient_accumulation_steps=per_process // micro,
                   gradient_checkpointing=profile.gradient_checkpointing,
                   optimizer_state_dtype=profile.optimizer_state_dtype)


def resolve_profile(cfg, device_type: str, device_gib: float | None):
    """(config to train with, profile or None). `auto` applies only on CUDA; a named profile anywhere."""
    if cfg.profile == "off":
        return cfg, None
    if cfg.profile == "auto":
        if device_type != "cuda" or device_gib is None:
            return cfg, None
        profile = choose_profile(device_gib)
    else:
        profile = PROFILES[cfg.profile]
    return apply_profile(cfg, profile), profile
