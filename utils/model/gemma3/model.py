"""Gemma 3 text in plain PyTorch: the shared decoder (utils/model/common/decoder.py) with Gemma's block (a norm
before and after attention and before and after the MLP), its 1 + weight RMSNorm everywhere (QK-norm
included), the embedding scaled by sqrt(hidden_size); the sliding/global layer pattern, the per-kind rotary
bases, query_pre_attn_scalar and final logit softcapping are the shared blocks' spec fields. The same math as
transformers' Gemma3ForCausalLM, under its parameter names and order."""
from __future__ import annotations

import torch
from torch import nn

from utils.model.common.decoder import Decoder, PreNormBlock
from utils.model.common.embedding import ScaledEmbedding
from utils.model.common.norms import OffsetRMSNorm


class SandwichBlock(PreNormBlock):
    """x + post_norm(attn(norm(x))), then + post_norm(mlp(norm(x))): the pre-norm block's modules (its
    post_attention_layernorm now after attention) and two more norms around the MLP, in transformers' order."""

    def __init__(self, spec, norm):
        super().__init__(spec, norm)
        self.pre_feedforward_layernorm = norm(spec.hidden_size)
        self.post_feedforward_layernorm = norm(spec.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask=None) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, mask))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3(Decoder):
    block_class = SandwichBlock
    norm_class = OffsetRMSNorm

    def embedding(self, spec) -> nn.Embedding:
        return ScaledEmbedding(spec.padded_vocab_size, spec.hidden_size, spec.hidden_size ** 0.5)
