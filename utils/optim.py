"""AdamW with decay on matrices only, and the scheduler that applies the learning-rate schedules
(utils/schedules.py: warmup, then cosine, the default, warmup-stable-decay `wsd`, linear or constant).

The schedule is a plain function of the optimizer step (`lr_at`), and the scheduler is never passed to
`accelerator.prepare`: a prepared scheduler steps once per process per call, which would make the LR at
step k depend on the number of processes. Here the loop steps it once per optimizer step, on every rank.
A resume applies *this* run's schedule at the restored step (StepSchedule keeps only the step): changed
schedule settings apply from there. WSD holds the peak until the last `decay_steps` before `max_steps`, so a
resume with a larger `max_steps` moves the decay later and extends the stable phase.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
from torch.optim.lr_scheduler import LRScheduler

from utils.schedules import lr_at

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

    def load_state_dict(self, state_dict: dict) -> None:
        """torch casts restored moments to the parameters' dtype (fp32): they go back to bfloat16 here, so a
        resume keeps half the memory, also from a checkpoint of torch's AdamW (fp32 moments)."""
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    state[key] = state[key].to(torch.bfloat16)

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
    """AdamW (`optimizer=adamw`); weight decay on matrices (dim >= 2) only, never on biases and norm gains.
    `optimizer=muon`: MuonWithAdamW (utils/muon.py), Muon for the blocks' weight matrices and this AdamW
    for the rest."""
    if getattr(cfg, "optimizer", "adamw") == "muon":
        from utils.muon import MuonWithAdamW, muon_parameters, ns_dtype_for

        muon = muon_parameters(model)
        adamw = _adamw(model, cfg, fused, skip={id(p) for p in muon})
        return MuonWithAdamW(muon, adamw, lr=cfg.learning_rate, weight_decay=cfg.weight_decay,
                             momentum=cfg.muon_momentum, state_dtype=_state_dtype(cfg),
                             ns_dtype=ns_dtype_for(getattr(cfg, "muon_ns_dtype", "auto"),
                                                   getattr(cfg, "mixed_precision", "bf16")),
                             cautious=getattr(cfg, "cautious_weight_decay", False))
    return _adamw(model, cfg, fused)


def _state_dtype(cfg) -> torch.dtype:
    return torch.bfloat16 if getattr(cfg, "optimizer_state_dtype", "fp32") == "bf16" else torch.float32


def _adamw(model: torch.nn.Module, cfg, fused: bool, skip: set[int] = frozenset()) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad and id(p) not in skip]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    kwargs = dict(lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
    if _state_dtype(cfg) == torch.bfloat16:
        return BF16MomentAdamW(groups, **kwargs)
    return torch.optim.AdamW(groups, fused=fused or None, **kwargs)


class StepSchedule(LRScheduler):
    """Sets every param group's LR to `schedule(step)` for the optimizer step about to run (step =
    last_epoch + 1): the function the log reads, so the logged LR is the LR applied. Its state is the step
    alone: a restore applies *this* run's schedule at the restored step, so a resume that changes
    learning_rate, the warmup, min_lr_ratio, the decay or max_steps follows the new schedule from there (the
    base LRs and the optimizer's LR saved in the checkpoint are not used)."""

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: Callable[[int], float]):
        self.schedule = schedule
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:
        return [self.schedule(self.last_epoch + 1)] * len(self.optimizer.param_groups)

    def state_dict(self) -> dict:
        return {key: value for key, value in super().state_dict().items() if key != "schedule"}

    def load_state_dict(self, state_dict: dict) -> None:
        self.last_epoch = int(state_dict["last_epoch"])
        self._step_count = int(state_dict.get("_step_count", self.last_epoch + 1))
        self._last_lr = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, self._last_lr):
            group["lr"] = lr


def build_scheduler(optimizer: torch.optim.Optimizer, cfg) -> StepSchedule:
    """After construction the optimizer holds lr_at(1); each `scheduler.step()` moves to the next step."""
    return StepSchedule(optimizer, schedule_from_config(cfg))
