"""`optimizer=adamw`: torch's AdamW with weight decay on matrices only (never on biases and norm gains), fused on
CUDA; with `optimizer_state_dtype=bf16`, BF16MomentAdamW, whose two moments take half the memory."""
from __future__ import annotations

import math

import torch

from utils.training.optim import OptimizerSettings


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


def build(model: torch.nn.Module, settings: OptimizerSettings, fused: bool,
          skip: frozenset[int] = frozenset()) -> torch.optim.Optimizer:
    """AdamW over the model's trainable parameters but those whose id is in `skip` (another optimizer's):
    decay on the matrices (dim >= 2) only."""
    params = [p for p in model.parameters() if p.requires_grad and id(p) not in skip]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": settings.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    kwargs = dict(lr=settings.learning_rate, betas=(settings.adam_beta1, settings.adam_beta2), eps=settings.adam_eps)
    if state_dtype(settings) == torch.bfloat16:
        return BF16MomentAdamW(groups, **kwargs)
    return torch.optim.AdamW(groups, fused=fused or None, **kwargs)


def state_dtype(settings: OptimizerSettings) -> torch.dtype:
    """The dtype optimizer state is kept in (`optimizer_state_dtype`)."""
    return torch.bfloat16 if settings.optimizer_state_dtype == "bf16" else torch.float32
