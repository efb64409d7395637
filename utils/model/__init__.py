"""The model the loop trains: a transformers GPTNeoXForCausalLM behind a module whose forward returns the loss.

Wrapping matters under DDP: gradient sync hooks fire only for the wrapped module's own forward, so the
loss (LM head + cross-entropy) must be computed inside it rather than by calling submodules from the loop.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from configs.model_config import ModelSpec


class CausalLMWithLoss(nn.Module):
    """`forward(input_ids) -> mean next-token cross-entropy over every position but the last`."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.lm.gpt_neox(input_ids=input_ids).last_hidden_state
        logits = self.lm.get_output_embeddings()(hidden[:, :-1])
        targets = input_ids[:, 1:]
        # Cross-entropy in fp32 for a stable log-softmax under bf16/fp16 autocast.
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


def build_model(spec: ModelSpec, seed: int, gradient_checkpointing: bool = False) -> CausalLMWithLoss:
    """A freshly initialised model; the same seed gives the same weights on every rank."""
    from transformers import GPTNeoXForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        lm = GPTNeoXForCausalLM(spec.to_hf_config(attn_implementation="sdpa"))
    if gradient_checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return CausalLMWithLoss(lm)


def count_parameters(model: CausalLMWithLoss) -> tuple[int, int]:
    """(all parameters, parameters that do matmul work: all but the input embedding lookup table)."""
    total = sum(p.numel() for p in model.parameters())
    lookup = model.lm.get_input_embeddings().weight.numel()
    return total, total - lookup


def flops_per_token(spec: ModelSpec, seq_len: int, matmul_params: int) -> float:
    """PaLM's training FLOPs per token: 6N + 12·L·H·Q·T (N matmul parameters, L layers, H heads,
    Q head dim, T sequence length). The second term is attention's score and value matmuls."""
    return 6.0 * matmul_params + 12.0 * spec.num_hidden_layers * spec.num_attention_heads * spec.head_dim * seq_len


def preflight_problem(model: nn.Module, batches: list[torch.Tensor]) -> str | None:
    """Forward + backward on each batch in the run's precision. None when the loss and every gradient are
    finite, else what was not. Gradients are cleared afterwards; no weight changes."""
    problem = None
    for i, batch in enumerate(batches, 1):
        loss = model(batch)
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if not bool(torch.isfinite(loss.detach())):
            problem = f"the loss is {loss.item()} on preflight batch {i}"
        elif grads and not bool(torch.stack([torch.isfinite(g).all() for g in grads]).all()):
            problem = f"gradients are not finite on preflight batch {i}"
        for p in model.parameters():
            p.grad = None
        if problem:
            break
    return problem
