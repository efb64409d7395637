"""Which keys each query attends to: causal, causal within a sliding window, within documents of a packed
sequence (`attention=document`), or both; as SDPA's boolean mask or a FlexAttention BlockMask.

A window of W lets query i see keys i - W + 1 ... i (transformers' `sliding_window_overlay`: kv > q - W).
`attention_mask` returns None where plain causal attention is the answer (no documents, no window shorter
than the sequence): SDPA's `is_causal` path then runs without a mask tensor.
"""
from __future__ import annotations

import torch


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


def document_mask(docs: torch.Tensor, flex: bool, window: int = 0):
    """Block-causal attention within documents (and within `window` tokens where > 0): a boolean
    [B, 1, T, T] mask for SDPA, or (flex) a FlexAttention BlockMask built once per batch, whose kernels skip
    the blocks no query attends to."""
    B, T = docs.shape
    if not flex:
        allowed = _causal(T, window, docs.device)
        return (docs[:, None, :, None] == docs[:, None, None, :]) & allowed
    from torch.nn.attention.flex_attention import create_block_mask

    def same_document_causal(b, h, q, kv):
        inside = (docs[b, q] == docs[b, kv]) & (q >= kv)
        return inside & (q - kv < window) if window else inside

    return create_block_mask(same_document_causal, B, None, T, T, device=docs.device)


def attention_mask(T: int, docs: torch.Tensor | None, window: int, flex: bool, device):
    """The mask of one attention kind for a batch: None (plain causal), a boolean tensor or a BlockMask."""
    window = window if 0 < window < T else 0
    if docs is not None:
        return document_mask(docs, flex, window)
    if not window:
        return None
    if not flex:
        return _causal(T, window, device)[None, None]
    from torch.nn.attention.flex_attention import create_block_mask

    def sliding_causal(b, h, q, kv):
        return (q >= kv) & (q - kv < window)

    return create_block_mask(sliding_causal, None, None, T, T, device=device)


def _causal(T: int, window: int, device) -> torch.Tensor:
    """[T, T] boolean: key j visible to query i (j <= i, and i - j < window where window > 0)."""
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    if window:
        causal &= torch.ones(T, T, dtype=torch.bool, device=device).triu(-(window - 1))
    return causal
