"""Validation loss: every source's held-out batches, averaged over ranks, logged as `val_loss` (the
weight-averaged mean) and `val_loss/<source>`."""
from __future__ import annotations

import math
import time

import torch


def evaluate(model, batches, accelerator) -> float | None:
    """Mean loss over this rank's eval batches, averaged over ranks; None without a validation split."""
    if not batches:
        return None
    model.eval()
    total = torch.zeros(2, device=accelerator.device, dtype=torch.float64)
    with torch.no_grad():
        for batch in batches:
            total[0] += model(batch.to(accelerator.device, non_blocking=True)).double()
            total[1] += 1
    model.train()
    total = accelerator.reduce(total, reduction="sum")
    return (total[0] / total[1]).item()


def run_eval(model, batches, accelerator, state, log, final: bool = False) -> float:
    """Evaluates each source's batches (an EvalBatches), logs the row and the line; returns the seconds it
    took (kept out of tokens/s). `final`: the run's last step, whose validation loss must be finite (a run whose
    weights are broken ends in one line, non-zero, and exports nothing; every rank sees the same mean)."""
    started = time.perf_counter()
    losses = {name: evaluate(model, source_batches, accelerator) for name, source_batches in batches.by_source.items()}
    seconds = time.perf_counter() - started
    if losses:
        fields = batches.row(losses)  # val_loss (weight-averaged over sources) and val_loss/<name>
        log.info(f"Step {state.step}: " + ", ".join(f"{k}={v:.4f}" for k, v in fields.items()))
        log.write_row({"step": state.step, "tokens": state.tokens, **fields, "eval_s": seconds})
        broken = {k: v for k, v in fields.items() if not math.isfinite(v)}
        if final and broken:
            from utils.observe.metrics import NonFiniteLoss

            name, value = next(iter(broken.items()))
            raise NonFiniteLoss(f"{name} at the last step ({state.step}) is {value} (not finite): the weights are "
                                f"broken, so nothing is exported; lower learning_rate and train again")
    return seconds
