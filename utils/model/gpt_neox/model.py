"""GPT-NeoX in plain PyTorch: the model the engine trains by default (`model_impl=native`).

The same math as transformers' `GPTNeoXForCausalLM` (checked at toy size against it, both ways, in
tests/test_native_model.py) for every GPT-NeoX / Pythia configuration: partial rotary embeddings with any
base, parallel or sequential residual, LayerNorm eps, biases on or off, untied (or tied) head, padded
vocabulary. Parameter names, their order and the fused per-head QKV layout are transformers' own, so a
checkpoint of either implementation (optimizer state included) loads into the other unchanged, and HF
weights come in and go out with a key copy (utils/model/gpt_neox/hf.py).

Faster than transformers' class because it does less around the same matmuls: rotary from cos/sin tables
computed once, `scaled_dot_product_attention(is_causal=True)` without a mask tensor, no output objects or
cache plumbing, and a loss that never materialises the [tokens, vocab] fp32 logits (`ChunkedLMHeadLoss`).
`compile_blocks()` compiles the transformer block once for all layers (regional compile). Activation
checkpointing is not the model's concern: a policy wraps its blocks from outside
(utils/model/activation_checkpointing.py). The engine sees it through `CausalLM` (utils/model/layers.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from configs.model_config import ConfigError, ModelSpec
from utils.model.layers import (  # noqa: F401  (re-exported: the names this module always had)
    CausalLM, ChunkedLMHeadLoss, FlopsMixin, LMHead, _flex_attention, apply_rotary, chunked_loss_only, document_ids,
    document_mask, positions_in_documents)

ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


def rotary_tables(spec: ModelSpec, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every position x rotary frequency, [positions, rotary_dims] (fp32), as HF computes them."""
    dims = spec.rotary_dims
    inv_freq = 1.0 / (spec.rotary_emb_base ** (torch.arange(0, dims, 2, dtype=torch.float) / dims))
    freqs = torch.outer(torch.arange(positions, dtype=torch.float), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.heads, self.head_dim = spec.num_attention_heads, spec.head_dim
        self.query_key_value = nn.Linear(spec.hidden_size, 3 * spec.hidden_size, bias=spec.attention_bias)
        self.dense = nn.Linear(spec.hidden_size, spec.hidden_size, bias=spec.attention_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask=None) -> torch.Tensor:
        """`mask`: None (causal), a boolean [B, 1, T, T] tensor (True: may attend) or a FlexAttention BlockMask."""
        B, T, C = x.shape
        # HF's fused layout: per head, [q | k | v] of head_dim each
        q, k, v = self.query_key_value(x).view(B, T, self.heads, 3, self.head_dim).permute(3, 0, 2, 1, 4)
        q, k = apply_rotary(q, cos.to(q.dtype), sin.to(q.dtype)), apply_rotary(k, cos.to(k.dtype), sin.to(k.dtype))
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif isinstance(mask, torch.Tensor):
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            y = _flex_attention()(q, k, v, block_mask=mask)
        return self.dense(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(spec.hidden_size, spec.intermediate_size)
        self.dense_4h_to_h = nn.Linear(spec.intermediate_size, spec.hidden_size)
        self.act = ACTIVATIONS[spec.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))


class Block(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.parallel = spec.use_parallel_residual
        # registration order = HF's parameter order
        self.input_layernorm = nn.LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)
        self.attention = Attention(spec)
        self.mlp = MLP(spec)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask=None) -> torch.Tensor:
        attn = self.attention(self.input_layernorm(x), cos, sin, mask)
        if self.parallel:
            return x + attn + self.mlp(self.post_attention_layernorm(x))
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x))


class _Trunk(nn.Module):
    """HF's `gpt_neox` submodule: embeddings, blocks, final norm (the names its weights live under)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.embed_in = nn.Embedding(spec.padded_vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(Block(spec) for _ in range(spec.num_hidden_layers))
        self.final_layer_norm = nn.LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)


class GPTNeoX(CausalLM):
    """`forward(input_ids) -> loss`: mean next-token cross-entropy over every position but the last."""

    def __init__(self, spec: ModelSpec):
        super().__init__(spec)
        if spec.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"hidden_act '{spec.hidden_act}' is not supported by the native model; use one of "
                              f"{', '.join(ACTIVATIONS)}, or model_impl=hf")
        self.gpt_neox = _Trunk(spec)
        self.lm_head = LMHead(spec.hidden_size, spec.padded_vocab_size, bias=False)
        self.tie_weights()
        self.register_buffer("rotary_cos", torch.empty(0), persistent=False)
        self.register_buffer("rotary_sin", torch.empty(0), persistent=False)
        self.register_load_state_dict_pre_hook(_accept_embed_out)
        self.reset_parameters()

    def blocks(self) -> nn.ModuleList:
        return self.gpt_neox.layers

    def input_embedding(self) -> nn.Embedding:
        return self.gpt_neox.embed_in

    def final_norm(self) -> nn.Module:
        return self.gpt_neox.final_layer_norm

    def rotary_tables(self, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary_tables(self.spec, positions)

    def init_weights(self) -> None:
        """HF's initialisation: normal(0, initializer_range) for every Linear and Embedding, zero biases,
        LayerNorm weight 1 and bias 0."""
        std = self.spec.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, std)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
                module.bias.zero_()


def _accept_embed_out(module, state_dict, prefix, *args):
    """GPT-NeoX files name the head `embed_out`; transformers 5 calls it `lm_head` in memory. Both load."""
    old = prefix + "embed_out.weight"
    if old in state_dict and prefix + "lm_head.weight" not in state_dict:
        state_dict[prefix + "lm_head.weight"] = state_dict.pop(old)
