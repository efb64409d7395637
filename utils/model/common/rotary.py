"""Rotary position embeddings: the inverse frequencies (plain, over a share of each head's dims, with Llama
3's frequency scaling where a spec has it), the cos/sin tables, and their application to q and k, computed
as transformers computes them (fp32 tables, `rotate_half`).

A model keeps one table pair per attention kind its layers use (`ModelSpec.layer_kinds`): full layers
rotate with `rotary_emb_base`, sliding-window layers with `rope_local_base` where the spec sets it (Gemma 3:
10,000 local, 1,000,000 global).
"""
from __future__ import annotations

import math

import torch


def rotary_inv_freq(dims: int, base: float) -> torch.Tensor:
    """The plain rotary inverse frequencies of `dims` rotated dims (fp32), as transformers computes them."""
    return 1.0 / (base ** (torch.arange(0, dims, 2, dtype=torch.int64).float() / dims))


def llama3_scaled(inv_freq: torch.Tensor, scaling: tuple) -> torch.Tensor:
    """Llama 3's scaling, `scaling` = (factor, low_freq_factor, high_freq_factor, original_max_positions): long
    wavelengths divided by `factor`, short ones kept, those between interpolated (transformers'
    `_compute_llama3_parameters`)."""
    factor, low, high, old_context = scaling
    low_wavelen, high_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def spec_inv_freq(spec, kind: str = "full") -> torch.Tensor:
    """The inverse frequencies of `spec`'s layers of `kind` ("full" | "sliding"): `rotary_dims` of each head,
    its base (`rope_local_base` for sliding layers where set), Llama 3's scaling where the spec has it."""
    base = spec.rope_local_base if kind == "sliding" and spec.rope_local_base else spec.rotary_emb_base
    inv_freq = rotary_inv_freq(spec.rotary_dims, base)
    return llama3_scaled(inv_freq, spec.rope_scaling) if spec.rope_scaling else inv_freq


def rotary_tables(inv_freq: torch.Tensor, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every position x rotary frequency, [positions, 2 * len(inv_freq)] (fp32)."""
    freqs = torch.arange(positions, dtype=torch.float)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates the first `cos.shape[-1]` dims of each head (x: [B, heads, T, head_dim]); the rest pass."""
    dims = cos.shape[-1]
    rot, rest = x[..., :dims], x[..., dims:]
    half1, half2 = rot[..., : dims // 2], rot[..., dims // 2:]
    rotated = rot * cos + torch.cat((-half2, half1), dim=-1) * sin
    return torch.cat((rotated, rest), dim=-1) if rest.shape[-1] else rotated
