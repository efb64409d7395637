"""GPT-NeoX in plain PyTorch: the model the engine trains by default (`model_impl=native`).

The same math as transformers' `GPTNeoXForCausalLM` (checked at toy size against it, both ways, in
tests/test_native_model.py) for every GPT-NeoX / Pythia configuration: partial rotary embeddings with any
base, parallel or sequential residual, LayerNorm eps, biases on or off, untied (or tied) head, padded
vocabulary. Parameter names, their order and the fused per-head QKV layout are transformers' own, so a
checkpoint of either implementation (optimizer state included) loads into the other unchanged, and HF
weights come in and go out with a key copy (utils/model/hf.py).

Faster than transformers' class because it does less around the same matmuls: rotary from cos/sin tables
computed once, `scaled_dot_product_attention(is_causal=True)` without a mask tensor, no output objects or
cache plumbing, and a loss that never materialises the [tokens, vocab] fp32 logits (`ChunkedLMHeadLoss`).
`compile_blocks()` compiles the transformer block once for all layers (regional compile). Activation
checkpointing is not the model's concern: a policy wraps its blocks from outside
(utils/model/activation_checkpointing.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from configs.model_config import ConfigError, ModelSpec
from utils.model.lm_loss import ChunkedLMHeadLoss, LMHead, chunked_loss_only  # noqa: F401 (the head, shared)

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


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates the first `cos.shape[-1]` dims of each head (x: [B, heads, T, head_dim]); the rest pass."""
    dims = cos.shape[-1]
    rot, rest = x[..., :dims], x[..., dims:]
    half1, half2 = rot[..., : dims // 2], rot[..., dims // 2:]
    rotated = rot * cos + torch.cat((-half2, half1), dim=-1) * sin
    return torch.cat((rotated, rest), dim=-1) if rest.shape[-1] else rotated


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


def document_ids(input_ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """[B, T] -> the document each token belongs to (0, 1, ... within its row): an EOS ends its document,
    so the token after it starts the next one."""
    is_eos = (input_ids == eos_id).to(torch.int32)
    return torch.cumsum(is_eos, dim=1) - is_eos


def positions_in_documents(docs: torch.Tensor) -> torch.Tensor:
    """[B, T] document ids -> each token's position within its document (0 at every document's start)."""
    idx = torch.arange(docs.shape[1], device=docs.device).expand_as(docs)
    starts = torch.ones_like(docs, dtype=torch.bool)
    starts[:, 1:] = docs[:, 1:] != docs[:, :-1]
    return idx - torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), dim=1).values


def document_mask(docs: torch.Tensor, flex: bool):
    """Block-causal attention within documents: a boolean [B, 1, T, T] mask for SDPA, or (flex) a
    FlexAttention BlockMask built once per batch, whose kernels skip the blocks no query attends to."""
    B, T = docs.shape
    if not flex:
        causal = torch.ones(T, T, dtype=torch.bool, device=docs.device).tril()
        return (docs[:, None, :, None] == docs[:, None, None, :]) & causal
    from torch.nn.attention.flex_attention import create_block_mask

    def same_document_causal(b, h, q, kv):
        return (docs[b, q] == docs[b, kv]) & (q >= kv)

    return create_block_mask(same_document_causal, B, None, T, T, device=docs.device)


_FLEX = None


def _flex_attention():
    """FlexAttention, compiled once (eager FlexAttention materialises the scores: a reference, not a kernel)."""
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX = torch.compile(flex_attention) if torch.cuda.is_available() else flex_attention
    return _FLEX


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


class FlopsMixin:
    """FLOPs and parameter counts of a GPT-NeoX with `spec` and a `gpt_neox.embed_in` (both implementations)."""

    def parameter_counts(self) -> tuple[int, int]:
        """(all parameters, those doing matmul work: all but the input embedding lookup table)."""
        total = sum(p.numel() for p in self.parameters())
        return total, total - self.gpt_neox.embed_in.weight.numel() * (not self.spec.tie_word_embeddings)

    def flops_per_token(self, seq_len: int) -> float:
        """PaLM's training FLOPs per token: 6N + 12·L·H·Q·T (N matmul parameters, L layers, H heads,
        Q head dim, T sequence length); the second term is attention's score and value matmuls."""
        s = self.spec
        return 6.0 * self.parameter_counts()[1] + 12.0 * s.num_hidden_layers * s.num_attention_heads * s.head_dim * seq_len


class GPTNeoX(FlopsMixin, nn.Module):
    """`forward(input_ids) -> loss`: mean next-token cross-entropy over every position but the last."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        if spec.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"hidden_act '{spec.hidden_act}' is not supported by the native model; use one of "
                              f"{', '.join(ACTIVATIONS)}, or model_impl=hf")
        self.spec = spec
        self.document_eos: int | None = None  # use_document_masking
        self.position_reset = False
        self.flex_attention = False
        self.gpt_neox = _Trunk(spec)
        self.lm_head = LMHead(spec.hidden_size, spec.padded_vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.gpt_neox.embed_in.weight
        self.register_buffer("rotary_cos", torch.empty(0), persistent=False)
        self.register_buffer("rotary_sin", torch.empty(0), persistent=False)
        self.register_load_state_dict_pre_hook(_accept_embed_out)
        self.reset_parameters()

    def reset_buffers(self) -> None:
        """The rotary tables (not in any state dict): built here, and again after a meta-device model is
        materialised with `to_empty`, which leaves buffers uninitialised."""
        device = self.lm_head.weight.device
        cos, sin = rotary_tables(self.spec, self.spec.max_position_embeddings)
        self.rotary_cos, self.rotary_sin = cos.to(device), sin.to(device)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """HF's initialisation: normal(0, initializer_range) for every Linear and Embedding, zero biases,
        LayerNorm weight 1 and bias 0."""
        self.reset_buffers()
        if self.lm_head.weight.is_meta:
            return
        std = self.spec.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, std)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
                module.bias.zero_()

    def use_document_masking(self, eos_id: int, position_reset: bool = False, flex: bool | None = None) -> None:
        """`attention=document`: each token attends only within its own document of a packed sequence
        (documents end at `eos_id`); `position_reset`: rotary positions restart at every document. `flex`:
        FlexAttention with a block mask (default on CUDA) rather than SDPA with a dense boolean mask (CPU).
        A training-time choice: the weights and the exported model are the standard GPT-NeoX."""
        self.document_eos, self.position_reset = int(eos_id), position_reset
        self.flex_attention = torch.cuda.is_available() if flex is None else flex

    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        T = input_ids.shape[1]
        cos, sin, mask = self.rotary_cos[:T], self.rotary_sin[:T], None
        if self.document_eos is not None:
            docs = document_ids(input_ids, self.document_eos)
            mask = document_mask(docs, self.flex_attention)
            if self.position_reset:
                positions = positions_in_documents(docs)
                cos, sin = self.rotary_cos[positions][:, None], self.rotary_sin[positions][:, None]
        x = self.gpt_neox.embed_in(input_ids)
        for block in self.gpt_neox.layers:  # activation checkpointing wraps blocks from outside (utils/parallel.py)
            x = block(x, cos, sin, mask)
        return self.gpt_neox.final_layer_norm(x)

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.hidden_states(input_ids))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.hidden_states(input_ids)[:, :-1].reshape(-1, self.spec.hidden_size)
        return self.lm_head(hidden, input_ids[:, 1:].reshape(-1))

    def compile_blocks(self) -> None:
        """Regional compile: each block's forward is compiled, and the identical blocks share the compiled
        code, so the model compiles once per block shape instead of as one large graph."""
        for block in self.gpt_neox.layers:
            block.compile()

def _accept_embed_out(module, state_dict, prefix, *args):
    """GPT-NeoX files name the head `embed_out`; transformers 5 calls it `lm_head` in memory. Both load."""
    old = prefix + "embed_out.weight"
    if old in state_dict and prefix + "lm_head.weight" not in state_dict:
        state_dict[prefix + "lm_head.weight"] = state_dict.pop(old)
