"""What every model family shares: rotary helpers, document masking (`attention=document`), the chunked
LM-head loss, and `CausalLM`, the small interface through which the rest of the engine sees a model.

The engine (activation checkpointing, regional compile, FSDP, fp8, the loop, evaluation, export) reaches a
model only through `CausalLM`'s methods: `blocks()` (the ModuleList of transformer blocks that checkpointing,
compile and FSDP wrap), `input_embedding()`, `output_units()` (final norm and LM head, one FSDP unit),
`tie_weights()`, `forward(input_ids) -> loss` (the chunked loss), `logits(input_ids)`, `flops_per_token`,
`parameter_counts`, `compile_blocks`, `reset_buffers`, `use_document_masking`. Each family's folder
(utils/model/<family>/) implements it; nothing outside that folder names a family's module attributes
(tests/test_architecture.py checks).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from utils.model.lm_loss import ChunkedLMHeadLoss, LMHead, chunked_loss_only  # noqa: F401 (the head, shared)


def rotary_inv_freq(dims: int, base: float) -> torch.Tensor:
    """The plain rotary inverse frequencies of `dims` rotated dims (fp32), as transformers computes them."""
    return 1.0 / (base ** (torch.arange(0, dims, 2, dtype=torch.int64).float() / dims))


def rotary_tables_from(inv_freq: torch.Tensor, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
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




class FlopsMixin:
    """FLOPs and parameter counts of any family's model (it has `spec` and `input_embedding()`)."""

    def parameter_counts(self) -> tuple[int, int]:
        """(all parameters, those doing matmul work: all but the input embedding lookup table)."""
        total = sum(p.numel() for p in self.parameters())
        return total, total - self.input_embedding().weight.numel() * (not self.spec.tie_word_embeddings)

    def flops_per_token(self, seq_len: int) -> float:
        """PaLM's training FLOPs per token: 6N + 12·L·H·Q·T (N matmul parameters, L layers, H heads,
        Q head dim, T sequence length); the second term is attention's score and value matmuls."""
        s = self.spec
        return 6.0 * self.parameter_counts()[1] + 12.0 * s.num_hidden_layers * s.num_attention_heads * s.head_dim * seq_len


class HFCausalLM(FlopsMixin):
    """The engine's interface on transformers' *ForCausalLM (`model_impl=hf`), mixed in before it: `forward(input_ids)
    -> loss` (the LM head on every position but the last, cross-entropy in fp32 for a stable log-softmax under
    autocast), through transformers' own accessors (`base_model`, `get_input_embeddings`); a family's subclass
    adds `output_units()` (its final norm and the head)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.base_model(input_ids=input_ids).last_hidden_state[:, :-1])
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), input_ids[:, 1:].reshape(-1))

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.base_model(input_ids=input_ids).last_hidden_state)

    def blocks(self):
        return self.base_model.layers

    def input_embedding(self):
        return self.get_input_embeddings()

    def compile_blocks(self) -> None:
        for layer in self.blocks():
            layer.compile()


class CausalLM(FlopsMixin, nn.Module):
    """The engine's view of a native model. A family sets `trunk_name` and implements `_embed`, `_norm`,
    `_layers` and `init_weights`; rotary tables are `rotary_cos`/`rotary_sin` buffers (never saved), built by
    `rotary_tables()` (the family's)."""

    def __init__(self, spec):
        super().__init__()
        self.spec = spec
        self.document_eos: int | None = None  # use_document_masking
        self.position_reset = False
        self.flex_attention = False

    # --- the family fills these in
    def blocks(self) -> nn.ModuleList:
        raise NotImplementedError

    def input_embedding(self) -> nn.Embedding:
        raise NotImplementedError

    def final_norm(self) -> nn.Module:
        raise NotImplementedError

    def rotary_tables(self, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def init_weights(self) -> None:
        raise NotImplementedError

    # --- shared
    def output_units(self) -> list[nn.Module]:
        """What FSDP shards together after the blocks: the final norm and the LM head."""
        return [self.final_norm(), self.lm_head]

    def tie_weights(self) -> None:
        """Tied embeddings: the head is the input embedding's weight (after loading with `assign=True`, too)."""
        if self.spec.tie_word_embeddings:
            self.lm_head.weight = self.input_embedding().weight

    def reset_buffers(self) -> None:
        """The rotary tables (not in any state dict): built here, and again after a meta-device model is
        materialised with `to_empty`, which leaves buffers uninitialised."""
        device = self.lm_head.weight.device
        cos, sin = self.rotary_tables(self.spec.max_position_embeddings)
        self.rotary_cos, self.rotary_sin = cos.to(device), sin.to(device)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.reset_buffers()
        if self.lm_head.weight.is_meta:
            return
        self.init_weights()

    def use_document_masking(self, eos_id: int, position_reset: bool = False, flex: bool | None = None) -> None:
        """`attention=document`: each token attends only within its own document of a packed sequence
        (documents end at `eos_id`); `position_reset`: rotary positions restart at every document. `flex`:
        FlexAttention with a block mask (default on CUDA) rather than SDPA with a dense boolean mask (CPU).
        A training-time choice: the weights and the exported model are the family's standard ones."""
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
        x = self.input_embedding()(input_ids)
        for block in self.blocks():  # activation checkpointing wraps blocks from outside (utils/parallel/strategies.py)
            x = block(x, cos, sin, mask)
        return self.final_norm()(x)

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.hidden_states(input_ids))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy over every position but the last (ChunkedLMHeadLoss)."""
        hidden = self.hidden_states(input_ids)[:, :-1].reshape(-1, self.spec.hidden_size)
        return self.lm_head(hidden, input_ids[:, 1:].reshape(-1))

    def compile_blocks(self) -> None:
        """Regional compile: each block's forward is compiled, and the identical blocks share the compiled
        code, so the model compiles once per block shape instead of as one large graph."""
        for block in self.blocks():
            block.compile()


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
    """Attention of [B, heads, T, head_dim] q over k/v (fewer heads: grouped-query); `mask`: None (causal),
    a boolean [B, 1, T, T] tensor (True: may attend) or a FlexAttention BlockMask."""
    gqa = k.shape[1] != q.shape[1]
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    return _flex_attention()(q, k, v, block_mask=mask, enable_gqa=gqa)
