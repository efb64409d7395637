"""GPT-NeoX in plain PyTorch: the model the engine trains by default (`model_impl=native`), composed of the
shared blocks (utils/model/common/).

The same math as transformers' `GPTNeoXForCausalLM` (checked at toy size against it, both ways, in
tests/unit/model/test_families.py) for every GPT-NeoX / Pythia configuration: partial rotary embeddings with any
base, parallel or sequential residual, LayerNorm eps, biases on or off, untied (or tied) head, padded
vocabulary. Parameter names, their order and the fused per-head QKV layout are transformers' own, so a
checkpoint of either implementation (optimizer state included) loads into the other unchanged, and HF
weights come in and go out with a key copy (utils/model/gpt_neox/hf.py). `qk_norm` adds a LayerNorm on each
head of q and k (the native model only: transformers' class has none, so such a model is not exported).

Faster than transformers' class because it does less around the same matmuls: rotary from cos/sin tables
computed once, `scaled_dot_product_attention(is_causal=True)` without a mask tensor, no output objects or
cache plumbing, and a loss that never materialises the [tokens, vocab] fp32 logits (`ChunkedLMHeadLoss`).
"""
from __future__ import annotations

import torch
from torch import nn

from utils.errors import ConfigError
from utils.model.architecture import ModelSpec
from utils.model.common.attention import SelfAttention
from utils.model.common.mlp import ACTIVATIONS, PlainMLP
from utils.model.common.norms import LayerNorm
from utils.model.layers import CausalLM, LMHead


class FusedQKVAttention(SelfAttention):
    """HF's fused layout: one `query_key_value` Linear holding, per head, [q | k | v] of head_dim each; `dense`."""

    def __init__(self, spec: ModelSpec):
        super().__init__(spec)
        self.query_key_value = nn.Linear(spec.hidden_size, 3 * spec.hidden_size, bias=spec.attention_bias)
        self.dense = nn.Linear(spec.hidden_size, spec.hidden_size, bias=spec.attention_bias)
        if spec.qk_norm:
            self.add_qk_norm(lambda dim: LayerNorm(dim, eps=spec.layer_norm_eps))

    def project(self, x: torch.Tensor):
        B, T, _ = x.shape
        q, k, v = self.query_key_value(x).view(B, T, self.heads, 3, self.head_dim).permute(3, 0, 2, 1, 4)
        return q, k, v

    def output(self, y: torch.Tensor) -> torch.Tensor:
        return self.dense(y)


class Block(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.parallel = spec.use_parallel_residual
        # registration order = HF's parameter order
        self.input_layernorm = LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)
        self.post_attention_layernorm = LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)
        self.attention = FusedQKVAttention(spec)
        self.mlp = PlainMLP(spec.hidden_size, spec.intermediate_size, spec.hidden_act,
                            names=("dense_h_to_4h", "dense_4h_to_h"))

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
        self.final_layer_norm = LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)


class GPTNeoX(CausalLM):
    """`forward(input_ids) -> loss`: mean next-token cross-entropy over every position but the last."""

    def __init__(self, spec: ModelSpec):
        super().__init__(spec)
        if spec.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"hidden_act '{spec.hidden_act}' is not supported by the native model; use one of "
                              f"{', '.join(ACTIVATIONS)}, or model_impl=hf")
        self.gpt_neox = _Trunk(spec)
        self.lm_head = LMHead(spec.hidden_size, spec.padded_vocab_size, bias=False)
        self.register_load_state_dict_pre_hook(_accept_embed_out)
        self.finish_init()

    def blocks(self) -> nn.ModuleList:
        return self.gpt_neox.layers

    def input_embedding(self) -> nn.Embedding:
        return self.gpt_neox.embed_in

    def final_norm(self) -> nn.Module:
        return self.gpt_neox.final_layer_norm


def _accept_embed_out(module, state_dict, prefix, *args):
    """GPT-NeoX files name the head `embed_out`; transformers 5 calls it `lm_head` in memory. Both load."""
    old = prefix + "embed_out.weight"
    if old in state_dict and prefix + "lm_head.weight" not in state_dict:
        state_dict[prefix + "lm_head.weight"] = state_dict.pop(old)
