"""The pre-norm decoder: the native model of Llama-style families (Llama 3.x, SmolLM2, Qwen2/2.5, Qwen3), and
the frame other decoders subclass (Gemma 3: its own block, norm and embedding).

    block    x + attn(norm(x)), then + mlp(norm(x)): grouped-query attention (explicit head_dim, optional
             QK-norm, sliding or full by the layer's kind), gated MLP, RMSNorm
    trunk    transformers' `model` submodule: `embed_tokens`, `layers`, `norm`
    head     `lm_head` (tied to the embedding or not; final logit softcapping where the spec has it)

Parameter names and order are transformers' own (`model.layers.N.self_attn.q_proj.weight`, ...), so HF
weights come in and go out as they are. A subclass changes `block_class`, `norm_class` or `embedding`.
"""
from __future__ import annotations

import torch
from torch import nn

from utils.model.common.attention import GroupedQueryAttention
from utils.model.common.mlp import GatedMLP
from utils.model.common.norms import RMSNorm
from utils.model.layers import CausalLM, LMHead


class PreNormBlock(nn.Module):
    def __init__(self, spec, norm):
        super().__init__()
        self.self_attn = GroupedQueryAttention(spec, norm)
        self.mlp = GatedMLP(spec.hidden_size, spec.intermediate_size, spec.hidden_act)
        self.input_layernorm = norm(spec.hidden_size)
        self.post_attention_layernorm = norm(spec.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask=None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderTrunk(nn.Module):
    """transformers' `model` submodule: embeddings, blocks, final norm (the names its weights live under)."""

    def __init__(self, spec, block_class, norm, embedding: nn.Embedding):
        super().__init__()
        self.embed_tokens = embedding
        self.layers = nn.ModuleList(block_class(spec, norm) for _ in range(spec.num_hidden_layers))
        self.norm = norm(spec.hidden_size)


class Decoder(CausalLM):
    """`forward(input_ids) -> loss`: mean next-token cross-entropy over every position but the last."""

    block_class = PreNormBlock
    norm_class = RMSNorm

    def __init__(self, spec):
        super().__init__(spec)
        self.model = DecoderTrunk(spec, self.block_class, self.make_norm, self.embedding(spec))
        self.lm_head = LMHead(spec.hidden_size, spec.padded_vocab_size, bias=False)
        self.finish_init()

    def make_norm(self, dim: int) -> nn.Module:
        return self.norm_class(dim, self.spec.layer_norm_eps)

    def embedding(self, spec) -> nn.Embedding:
        return nn.Embedding(spec.padded_vocab_size, spec.hidden_size)

    def blocks(self) -> nn.ModuleList:
        return self.model.layers

    def input_embedding(self) -> nn.Embedding:
        return self.model.embed_tokens

    def final_norm(self) -> nn.Module:
        return self.model.norm
