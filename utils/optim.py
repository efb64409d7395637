"""AdamW with decay on matrices only, and the warmup + cosine learning-rate schedule.

The schedule is a plain function of the optimizer step (`lr_at`), and the scheduler is never passed to
`accelerator.prepare`: a prepared scheduler steps once per process per call, which would make the LR at
step k depend on the number of processes. Here the loop steps it once per optimizer step, on every rank.
"""
from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR


def lr_at(step: int, *, peak_lr: float, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """Learning rate used by optimizer step `step` (1-based: step 1 is the first update).

    Linear warmup from peak/warmup to peak over `warmup_steps`, then cosine decay to
    `peak * min_lr_ratio` at `max_steps`, flat after that.
    """
    if step <= warmup_steps:
        return peak_lr * step / max(1, warmup_steps)
    min_lr = peak_lr * min_lr_ratio
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_lr + (peak_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def schedule_from_config(cfg):
    """`step -> lr` for a TrainingConfig."""
    return lambda step: lr_at(step, peak_lr=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
                              max_steps=cfg.max_steps, min_lr_ratio=cfg.min_lr_ratio)


def build_optimizer(model: torch.nn.Module, cfg, fused: bool) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices (dim >= 2) only, never on biases and norm gains."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
                             eps=cfg.adam_eps, fused=fused or None)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg) -> LambdaLR:
    """After construction the optimizer holds lr_at(1); each `scheduler.step()` moves to the next step."""
    schedule = schedule_from_config(cfg)
    return LambdaLR(optimizer, lambda index: schedule(index + 1) / cfg.learning_rate)
