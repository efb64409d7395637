"""Whether a batch can fit at all, said before the kernel or the CUDA allocator says it worse.

The memory plan (configs/profiles.py) estimates a process's bytes: weights, gradients, optimizer state,
the saved activations of one micro-batch, the loss's buffers. A run whose estimate exceeds the whole memory
it has (a GPU's total; on the CPU the machine's RAM shared by the processes on it) cannot train: the kernel
would kill it without a line, or CUDA would fail deep in the first backward pass. Such a run stops before
the model is built, in one line naming the batch settings and what the plan counts. The estimate leaves
some things out (the attention matrix of the CPU's math attention, allocator slack), so it refuses only
what cannot fit; what fits on paper may still run out, and the profiles stay the way to choose by.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from configs.profiles import GB, RunShape, memory_plan
from utils.errors import UserError
from utils.model.activation_checkpointing import CheckpointingSettings


class BatchDoesNotFit(UserError):
    pass


def machine_bytes() -> int | None:
    """The machine's RAM (MemTotal: the same figure for every process on it), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


@dataclass(frozen=True)
class FitSettings(CheckpointingSettings):
    """What decides a process's memory besides the model: the strategy, the micro-batch, the policy, the moments."""

    strategy: str
    per_device_train_batch_size: int
    optimizer_state_dtype: str


def check_batch_fits(settings: FitSettings, spec, seq_len: int, device, world_size: int) -> None:
    """Raises BatchDoesNotFit when the memory plan of one process exceeds the memory it has at all."""
    import torch

    checkpointing, every = settings.policy
    plan = memory_plan(spec, RunShape(strategy=settings.strategy, world_size=world_size,
                                      micro_batch=settings.per_device_train_batch_size, seq_len=seq_len,
                                      checkpointing=checkpointing, checkpointing_every=every,
                                      moments=settings.optimizer_state_dtype))
    if device.type == "cuda":
        have, where = torch.cuda.get_device_properties(device).total_memory, "this GPU's"
        need = plan.total
    else:
        total = machine_bytes()
        if total is None:
            return
        per_machine = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        have, where = total / per_machine, ("this machine's RAM" if per_machine == 1 else
                                            f"a 1/{per_machine} share of this machine's RAM")
        need = plan.total - plan.overhead  # no CUDA context; activations counted at bf16's size (a lower bound)
    if need > have:
        raise BatchDoesNotFit(
            f"per_device_train_batch_size={settings.per_device_train_batch_size} at seq_len {seq_len} cannot fit: the "
            f"memory plan needs {need / GB:,.1f} GB per process (activations {plan.activations / GB:,.1f} GB, "
            f"weights, gradients and optimizer state {plan.state / GB:,.1f} GB) and {where} is {have / GB:,.1f} GB; "
            f"lower per_device_train_batch_size and raise gradient_accumulation_steps (the batch per step stays), "
            f"or set activation_checkpointing=full (python scripts/memory_plan.py shows the plan)")
