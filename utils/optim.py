"""AdamW with decay on matrices only, and the learning-rate schedules: warmup, then cosine (the default),
warmup-stable-decay (`wsd`), linear or constant.

The schedule is a plain function of the optimizer step (`lr_at`), and the scheduler is never passed to
`accelerator.prepare`: a prepared scheduler steps once per process per call, which would make the LR at
step k depend on the number of processes. Here the loop steps it once per optimizer step, on every rank.
WSD holds the peak until the last `decay_steps` before `max_steps`: a resume with a larger `max_steps`
moves the decay later and so extends the stable phase (StepSchedule re-applies this run's schedule).
"""
from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

DECAY_SHAPES = {
    "linear": lambda progress: 1.0 - progress,
    "cosine": lambda progress: 0.5 * (1.0 + math.cos(math.pi * progress)),
    "sqrt": lambda progress: 1.0 - math.sqrt(progress),
}


def lr_at(step: int, *, peak_lr: float, warmup_steps: int, max_steps: int, min_lr_ratio: float,
          schedule: str = "cosine", decay_steps: int = 0, decay_shape: str = "linear") -> float:
    """Learning rate used by optimizer step `step` (1-based: step 1 is the first update).

    Linear warmup from peak/warmup to peak over `warmup_steps`, then to `peak * min_lr_ratio` at
    `max_steps` (flat after it): `cosine` decays along a half cosine, `linear` along a line, `constant`
    stays at the peak; `wsd` stays at the peak until `max_steps - decay_steps` (never before the warmup
    ends) and decays over the rest with `decay_shape` (linear | cosine | sqrt).
    """
    if step <= warmup_steps:
        return peak_lr * step / max(1, warmup_steps)
    if schedule == "constant":
        return peak_lr
    min_lr = peak_lr * min_lr_ratio
    if schedule == "wsd":
        decay_start = max(warmup_steps, max_steps - decay_steps)
        if step <= decay_start:
            return peak_lr
        progress = min(1.0, (step - decay_start) / max(1, max_steps - decay_start))
        return min_lr + (peak_lr - min_lr) * DECAY_SHAPES[decay_shape](progress)
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    if schedule == "linear":
        return min_lr + (peak_lr - min_lr) * (1.0 - progress)
    return min_lr + (peak_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def wsd_decay_steps(cfg) -> int:
    """The WSD decay's length: `decay_steps`, or `decay_fraction` of `max_steps` when that is 0."""
    return cfg.decay_steps or round(cfg.decay_fraction * cfg.max_steps)


def schedule_from_config(cfg):
    """`step -> lr` for a TrainingConfig."""
    decay_steps = wsd_decay_steps(cfg)
    return lambda step: lr_at(step, peak_lr=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
                              max_steps=cfg.max_steps, min_lr_ratio=cfg.min_lr_ratio, schedule=cfg.lr_schedule,
                              decay_steps=decay_steps, decay_shape=cfg.decay_shape)


class BF16MomentAdamW(torch.optim.Optimizer):
    """AdamW (decoupled decay, bias correction as torch.optim.AdamW) whose two moment estimates are stored
    in bfloat16: half of AdamW's state memory. The update itself is computed in fp32."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16)
                state["step"] += 1
                step = state["step"].item()
                grad = p.grad.float()
                exp_avg = state["exp_avg"].float().lerp_(grad, 1 - beta1)
                exp_avg_sq = state["exp_avg_sq"].float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                state["exp_avg"].copy_(exp_avg)
                state["exp_avg_sq"].copy_(exp_avg_sq)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                denom = (exp_avg_sq.sqrt_() / math.sqrt(1 - beta2 ** step)).add_(group["eps"])
                p.addcdiv_(exp_avg, denom, value=-group["lr"] / (1 - beta1 ** step))


def build_optimizer(model: torch.nn.Module, cfg, fused: bool) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices (dim >= 2) only, never on biases and norm gains."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    kwargs = dict(lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
    if getattr(cfg, "optimizer_state_dtype", "fp32") == "bf16":
        return BF16MomentAdamW(groups, **kwargs)
    return torch.optim.AdamW(groups, fused=fused or None, **kwargs)


class StepSchedule(LambdaLR):
    """LambdaLR whose restore re-applies *this* run's schedule at the restored step. The optimizer's saved
    param groups hold the LR the checkpointed run computed for its next step; a resume that changes
    max_steps (or the warmup, or the peak) must not take one step at that stale rate."""

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        for group, base_lr, factor in zip(self.optimizer.param_groups, self.base_lrs, self.lr_lambdas):
            group["lr"] = base_lr * factor(self.last_epoch)
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]


def build_scheduler(optimizer: torch.optim.Optimizer, cfg) -> LambdaLR:
    """After construction the optimizer holds lr_at(1); each `scheduler.step()` moves to the next step."""
    schedule = schedule_from_config(cfg)
    return StepSchedule(optimizer, lambda index: schedule(index + 1) / cfg.learning_rate)
