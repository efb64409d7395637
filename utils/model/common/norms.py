"""Normalisation layers, each the exact math of the transformers class its families use (fp32 inside).

    LayerNorm       torch's (GPT-NeoX): weight and bias, `layer_norm_eps`
    RMSNorm         Llama, Qwen: weight * (x / rms(x)), normalised in fp32, cast back before the weight
    OffsetRMSNorm   Gemma: (x / rms(x)) * (1 + weight), all in fp32, then cast; the weight starts at 0

Every norm here is built at its identity (LayerNorm 1 and 0, RMSNorm 1, OffsetRMSNorm 0), which is what
`reset_parameters` restores; `NORMS` is what utils/model/init.py recognises as a norm.
"""
from __future__ import annotations

import torch
from torch import nn

LayerNorm = nn.LayerNorm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.weight.fill_(1.0)


class OffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm: the scale is 1 + weight (the weight starts at 0), applied in fp32 before the cast."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.weight.zero_()


NORMS = (LayerNorm, RMSNorm, OffsetRMSNorm)
