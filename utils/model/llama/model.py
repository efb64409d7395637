"""Llama-style decoders in plain PyTorch (Llama 3.x, SmolLM2, Qwen2/2.5): the native model of the `llama`
family.

RMSNorm (weight * x / rms(x), computed in fp32), SwiGLU MLP (down(silu(gate(x)) * up(x))), grouped-query
attention (`num_key_value_heads` k/v heads shared by groups of query heads), rotary embeddings on every
head dim with Llama 3's frequency scaling where the spec has it, pre-norm residual blocks, tied or untied
LM head, optional biases on q/k/v (Qwen2) or on q/k/v/o (Llama's `attention_bias`). The same math as
transformers' `LlamaForCausalLM` / `Qwen2ForCausalLM` (tests/test_llama.py checks logits, loss and
gradients at toy size) under transformers' own parameter names and order, so HF weights come in and go
out as they are (utils/model/llama/hf.py). The engine sees it through `CausalLM` (utils/model/layers.py):
the same chunked loss, document masking, regional compile and FSDP units as every family.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from configs.model_config import ConfigError, ModelSpec
from utils.model.layers import CausalLM, LMHead, apply_rotary, attend, rotary_inv_freq, rotary_tables_from


def llama_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """Rotary inverse frequencies over the whole head; with `rope_scaling` (factor, low_freq_factor,
    high_freq_factor, original_max_positions) Llama 3's: long wavelengths divided by `factor`, short ones
    kept, those between interpolated (transformers' `_compute_llama3_parameters`)."""
    inv_freq = rotary_inv_freq(spec.head_dim, spec.rotary_emb_base)
    if not spec.rope_scaling:
        return inv_freq
    factor, low, high, old_context = spec.rope_scaling
    low_wavelen, high_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = spec.num_attention_heads, spec.kv_heads, spec.head_dim
        h, q_dim, kv_dim = spec.hidden_size, self.heads * self.head_dim, self.kv_heads * self.head_dim
        qkv_bias = spec.attention_bias or spec.qkv_bias
        # registration order = transformers' parameter order
        self.q_proj = nn.Linear(h, q_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(h, kv_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(h, kv_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(q_dim, h, bias=spec.attention_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask=None) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos.to(q.dtype), sin.to(q.dtype)), apply_rotary(k, cos.to(k.dtype), sin.to(k.dtype))
        y = attend(q, k, v, mask)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.self_attn = Attention(spec)
        self.mlp = MLP(spec)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.layer_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.layer_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask=None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Trunk(nn.Module):
    """transformers' `model` submodule: embeddings, blocks, final norm (the names its weights live under)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.padded_vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(Block(spec) for _ in range(spec.num_hidden_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.layer_norm_eps)


class Llama(CausalLM):
    """`forward(input_ids) -> loss`: mean next-token cross-entropy over every position but the last."""

    def __init__(self, spec: ModelSpec):
        super().__init__(spec)
        if spec.hidden_act != "silu":
            raise ConfigError(f"model '{spec.name}': the llama family's MLP is SwiGLU (hidden_act 'silu'), not "
                              f"'{spec.hidden_act}'")
        if spec.rotary_pct != 1.0:
            raise ConfigError(f"model '{spec.name}': the llama family rotates every head dim (rotary_pct 1.0)")
        self.model = _Trunk(spec)
        self.lm_head = LMHead(spec.hidden_size, spec.padded_vocab_size, bias=False)
        self.tie_weights()
        self.register_buffer("rotary_cos", torch.empty(0), persistent=False)
        self.register_buffer("rotary_sin", torch.empty(0), persistent=False)
        self.reset_parameters()

    def blocks(self) -> nn.ModuleList:
        return self.model.layers

    def input_embedding(self) -> nn.Embedding:
        return self.model.embed_tokens

    def final_norm(self) -> nn.Module:
        return self.model.norm

    def rotary_tables(self, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary_tables_from(llama_inv_freq(self.spec), positions)

    def init_weights(self) -> None:
        """transformers' initialisation: normal(0, initializer_range) for every Linear and Embedding, zero
        biases, RMSNorm weight 1."""
        std = self.spec.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, std)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
