"""The optimizer registry: `optimizer=NAME` -> the module of this package that builds it.

Each module has `build(model, settings: OptimizerSettings, fused: bool) -> torch.optim.Optimizer`; the
config's `optimizer` choices are OPTIMIZERS' keys (configs imports them, so this file imports no torch and
none of its modules: they load when a run builds its optimizer). Adding an optimizer is one module here and
one line in OPTIMIZERS (and its fields, if it has new ones, in the config and in OptimizerSettings).

- `adamw`: torch's AdamW, decay on matrices only; BF16MomentAdamW (`optimizer_state_dtype=bf16`);
- `muon`: torch's Muon for the blocks' weight matrices, AdamW for the rest, in one optimizer object; across
  ranks each rank orthogonalises its share of the matrices (`spread_over_replicas` tells it of DDP's);
  `muon_ranks` (torch-free, the memory plan reads it): how the matrices are shared, what a rank holds.

May import: utils, utils.io, utils.runtime (as utils.training).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

from utils.settings import Settings

OPTIMIZERS: dict[str, str] = {"adamw": "adamw", "muon": "muon"}  # name -> module of this package
# `muon_scale` -> torch.optim.Muon's adjust_lr_fn: moonlight scales each matrix's update to AdamW's RMS
# (0.2 * sqrt(max(rows, cols))), so that AdamW's learning rate and weight decay serve Muon too; original is
# Keller Jordan's sqrt(max(1, rows / cols)), which wants its own, larger learning rate
MUON_SCALES: dict[str, str] = {"moonlight": "match_rms_adamw", "original": "original"}


@dataclass(frozen=True)
class OptimizerSettings(Settings):
    optimizer: str
    learning_rate: float
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    muon_momentum: float
    muon_ns_dtype: str
    muon_scale: str
    cautious_weight_decay: bool
    optimizer_state_dtype: str
    mixed_precision: str  # muon_ns_dtype=auto follows it


def state_problem(named_states) -> str | None:
    """What makes a loaded optimizer state one no run can continue from, in words naming the parameter, or None.
    `named_states`: (parameter name, its state: this rank's part of each tensor). A `step` must be a whole number
    of steps, at least 0 (AdamW's bias correction raises its betas to it: NaN, inf or a negative turns every update
    into NaN, which the run would only show as a non-finite loss, blaming the learning rate); every floating
    tensor finite; a second moment (`exp_avg_sq`, a mean of squares under a square root) not negative."""
    import math

    import torch

    from utils.runtime.distributed import local_tensor

    for name, state in named_states:
        for key, value in state.items():
            if key == "step":
                number = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
                if isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number) \
                        or number < 0 or not float(number).is_integer():
                    shown = number if isinstance(number, (int, float)) else type(value).__name__
                    return f"{name}'s step is {shown}, not a whole number of steps (at least 0)"
            elif isinstance(value, torch.Tensor) and value.is_floating_point():
                local = local_tensor(value)
                if not bool(torch.isfinite(local).all()):
                    return f"{name}'s {key} holds a non-finite value (NaN or inf)"
                if key == "exp_avg_sq" and bool((local < 0).any()):
                    return f"{name}'s {key} holds a negative value (a second moment is a mean of squares)"
    return None


def build_optimizer(model, settings: OptimizerSettings, fused: bool):
    """The optimizer `settings.optimizer` names, over `model`'s parameters (`fused`: torch's fused kernels)."""
    module = importlib.import_module(f"{__name__}.{OPTIMIZERS[settings.optimizer]}")
    return module.build(model, settings, fused)


def spread_over_replicas(optimizer, group=None) -> None:
    """Tells `optimizer` that every rank of `group` (None: all ranks) holds the same parameters and gradients
    (DDP). One with work per matrix that a rank can do for the others (Muon's Newton-Schulz: its
    `spread_over_replicas`) then splits it; the others are unchanged. Sharded parameters (FSDP2's DTensors)
    say it themselves."""
    spread = getattr(optimizer, "spread_over_replicas", None)
    if spread is not None:
        spread(group)
