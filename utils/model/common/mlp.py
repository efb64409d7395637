"""The MLPs families compose, by activation name (transformers' `hidden_act` / `hidden_activation`).

    GatedMLP   down(act(gate(x)) * up(x)), no biases: SwiGLU with silu (Llama, Qwen), GeGLU with
               gelu_pytorch_tanh (Gemma); `gate_proj`, `up_proj`, `down_proj`
    PlainMLP   down(act(up(x))) with biases (GPT-NeoX); its two Linears named by the family
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, inner: int, act: str):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class PlainMLP(nn.Module):
    """`names`: the (in, out) Linears' attribute names, which are the family's checkpoint keys."""

    def __init__(self, hidden: int, inner: int, act: str, names: tuple[str, str], bias: bool = True):
        super().__init__()
        self.names = names
        setattr(self, names[0], nn.Linear(hidden, inner, bias=bias))
        setattr(self, names[1], nn.Linear(inner, hidden, bias=bias))
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner, outer = self.names
        return getattr(self, outer)(self.act(getattr(self, inner)(x)))
