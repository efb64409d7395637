"""The precision preflight: `preflight_steps` forward/backward passes in the run's precision before step 1,
so a precision that cannot train (a non-finite loss or gradient) stops the run before it starts, saying
which precision to try instead."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from configs.training_config import precision_name
from utils.errors import UserError
from utils.runtime.distributed import local_tensor
from utils.settings import Settings


@dataclass(frozen=True)
class PreflightSettings(Settings):
    preflight_steps: int
    mixed_precision: str
    init_from: str


def preflight(model, batches, settings: PreflightSettings, accelerator, log, stop) -> None:
    """Runs the passes on the first eval batches (every rank) and raises a UserError when one was not
    finite anywhere. A stop signal ends it between passes (in one process; ranks may hold different numbers
    of eval batches, so several check after it)."""
    if not (settings.preflight_steps and batches):
        return
    checks = [b.to(accelerator.device) for b in batches[:settings.preflight_steps]]
    between = (lambda: stop.end_setup_if_asked("preflight")) if accelerator.num_processes == 1 else None
    problem = preflight_problem(model, checks, between)
    failed = accelerator.reduce(torch.tensor(float(problem is not None), device=accelerator.device), reduction="sum")
    precision = precision_name(settings.mixed_precision)
    if failed.item():
        what = f"preflight: {problem or 'another rank saw a non-finite loss or gradient'} in {precision} precision"
        # no optimizer step has run: no setting of the schedule or AdamW is involved
        if settings.mixed_precision == "no":
            start = f"init_from {settings.init_from}'s weights" if settings.init_from else "the starting weights"
            raise UserError(f"{what} before any optimizer step: {start} or the data give it; check them")
        others = [m for m in ("bf16", "no") if m != settings.mixed_precision]
        raise UserError(f"{what} before training; try --mixed-precision {' or '.join(others)}")
    log.info(f"Preflight: {len(checks)} forward/backward pass(es) in {precision} precision gave a finite loss and "
             f"gradients")


def preflight_problem(model: nn.Module, batches: list[torch.Tensor], before_each=None) -> str | None:
    """Forward + backward on each batch in the run's precision. None when the loss and every gradient are
    finite, else what was not. Gradients are cleared afterwards; no weight changes. `before_each()` runs
    before every pass (e.g. to end the run on a stop signal: a pass of a big model on a CPU takes minutes)."""
    problem = None
    for i, batch in enumerate(batches, 1):
        if before_each is not None:
            before_each()
        loss = model(batch)
        loss.backward()
        grads = [local_tensor(p.grad) for p in model.parameters() if p.grad is not None]
        if not bool(torch.isfinite(loss.detach())):
            problem = f"the loss is {loss.item()} on preflight batch {i}"
        elif grads and not bool(torch.stack([torch.isfinite(g).all() for g in grads]).all()):
            problem = f"gradients are not finite on preflight batch {i}"
        for p in model.parameters():
            p.grad = None
        if problem:
            break
    return problem
