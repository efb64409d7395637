"""Self-attention shared by every family: projections -> optional QK-norm -> rotary -> the kernel -> the
output projection.

`SelfAttention` is the pipeline; a subclass says how q, k and v are projected and under which names (the
parameter names are the family's checkpoint keys). `GroupedQueryAttention` is transformers' common layout
(`q_proj`, `k_proj`, `v_proj`, `o_proj`, then `q_norm`, `k_norm` with QK-norm): `num_key_value_heads` k/v
heads shared by groups of query heads, an explicit `head_dim` (Qwen3: 128 at hidden 1024 with 16 heads;
Gemma 3: 256), biases on q/k/v and o (`attention_bias`) or on q/k/v only (Qwen2's `qkv_bias`).

QK-norm (`qk_norm`): a norm over each head's dims of q and of k, after the projection and before rotary
(OLMo 2's placement, per head as Qwen3 and Gemma 3 do), with the family's norm. The scale is
1/sqrt(head_dim) unless the spec's `query_pre_attn_scalar` sets 1/sqrt(that) (Gemma). Which keys a query
sees is the mask the model passes (utils/model/common/masks.py): None (causal), a boolean tensor (SDPA) or a
FlexAttention BlockMask.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from utils.model.common.rotary import apply_rotary

_FLEX = None


def _flex_attention():
    """FlexAttention, compiled once (eager FlexAttention materialises the scores: a reference, not a kernel)."""
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX = torch.compile(flex_attention) if torch.cuda.is_available() else flex_attention
    return _FLEX


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, scale: float | None = None) -> torch.Tensor:
    """Attention of [B, heads, T, head_dim] q over k/v (fewer heads: grouped-query); `mask`: None (causal),
    a boolean [B, 1, T, T] tensor (True: may attend) or a FlexAttention BlockMask; `scale`: None for
    1/sqrt(head_dim)."""
    gqa = k.shape[1] != q.shape[1]
    scaled = {} if scale is None else {"scale": scale}
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa, **scaled)
    if isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa, **scaled)
    return _flex_attention()(q, k, v, block_mask=mask, enable_gqa=gqa, **scaled)


def attention_scale(spec) -> float | None:
    """1/sqrt(query_pre_attn_scalar) where the spec sets it (Gemma), else None (1/sqrt(head_dim))."""
    return spec.query_pre_attn_scalar ** -0.5 if spec.query_pre_attn_scalar else None


class SelfAttention(nn.Module):
    """The pipeline; a subclass builds its projections (then `add_qk_norm`) and implements `project` and
    `output`."""

    def __init__(self, spec):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = spec.num_attention_heads, spec.kv_heads, spec.head_dim
        self.scale = attention_scale(spec)
        self.q_norm = self.k_norm = None

    def add_qk_norm(self, norm: Callable[[int], nn.Module]) -> None:
        """QK-norm: `norm(head_dim)` on q and on k, registered after the projections (transformers' order)."""
        self.q_norm, self.k_norm = norm(self.head_dim), norm(self.head_dim)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[B, T, hidden] -> q, k, v as [B, heads, T, head_dim] (k and v with their own head count)."""
        raise NotImplementedError

    def output(self, y: torch.Tensor) -> torch.Tensor:
        """[B, T, heads * head_dim] -> [B, T, hidden]."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask=None) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.project(x)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos.to(q.dtype), sin.to(q.dtype)), apply_rotary(k, cos.to(k.dtype), sin.to(k.dtype))
        y = attend(q, k, v, mask, self.scale)
        return self.output(y.transpose(1, 2).reshape(B, T, self.heads * self.head_dim))


class GroupedQueryAttention(SelfAttention):
    """q_proj, k_proj, v_proj, o_proj (transformers' names and order), q_norm and k_norm with `qk_norm`."""

    def __init__(self, spec, norm: Callable[[int], nn.Module] | None = None):
        super().__init__(spec)
        h, q_dim, kv_dim = spec.hidden_size, self.heads * self.head_dim, self.kv_heads * self.head_dim
        qkv_bias = spec.attention_bias or spec.qkv_bias
        self.q_proj = nn.Linear(h, q_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(h, kv_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(h, kv_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(q_dim, h, bias=spec.attention_bias)
        if spec.qk_norm:
            self.add_qk_norm(norm)

    def project(self, x: torch.Tensor):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        return q, k, v

    def output(self, y: torch.Tensor) -> torch.Tensor:
        return self.o_proj(y)
