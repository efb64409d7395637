"""Activation checkpointing as a policy applied to a model's transformer blocks from outside the model.

`activation_checkpointing` (a training-config field) names the policy; the parallelism seam
(utils/parallel/strategies.py) applies it first, before fp8, compile and sharding, as torchtitan does:

    none       every activation is kept for the backward pass (fastest, most memory)
    full       each block keeps only its input and recomputes its whole forward in the backward pass
    every_k    `full` on every k-th block (`activation_checkpointing_every`), the others keep everything:
               memory and recompute in between
    selective  per-op: inside each block the outputs of the matmuls and of attention are kept, and the
               cheap element-wise work between them (layer norms, GELU, rotary, residual adds) is
               recomputed; torch's selective activation checkpointing (`create_selective_checkpoint_contexts`)
               with torchtitan's choice of what to save

Blocks are wrapped with torch's `checkpoint_wrapper` (non-reentrant `torch.utils.checkpoint`). The wrapper
adds `_checkpoint_wrapped_module.` to parameter names; state dicts (its own hooks) and DCP (its FQN
resolution) drop it, and `parameter_fqn` does the same for code that names parameters itself. Recomputation
is exact (no dropout in training, any family), so every policy gives the gradients of `none`.
`saved_activation_bytes` measures what a policy keeps alive between forward and backward, on any device.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from utils.settings import Settings

POLICIES = ("none", "full", "every_k", "selective")
WRAPPED_PREFIX = "_checkpoint_wrapped_module."


@dataclass(frozen=True)
class CheckpointingSettings(Settings):
    activation_checkpointing: str
    activation_checkpointing_every: int
    gradient_checkpointing: bool  # the older switch: true means full

    @property
    def policy(self) -> tuple[str, int]:
        """(policy, k): `gradient_checkpointing: true` keeps meaning `full`."""
        policy = self.activation_checkpointing
        if policy == "none" and self.gradient_checkpointing:
            policy = "full"
        return policy, self.activation_checkpointing_every


def _saved_ops() -> set:
    """The ops whose outputs `selective` keeps: matmuls and attention (expensive to recompute)."""
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "baddbmm", "linear", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_attention_math",
             "_scaled_mm")
    return {getattr(aten, n).default for n in names if hasattr(aten, n)}


def _selective_context():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    saved = _saved_ops()

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def apply_activation_checkpointing(model: nn.Module, policy: str, every: int = 2) -> int:
    """Wraps the model's blocks (`model.blocks()`) in place by `policy`; returns how many are checkpointed."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    if policy not in POLICIES:
        raise ValueError(f"activation checkpointing policy '{policy}': use one of {', '.join(POLICIES)}")
    if policy == "none":
        return 0
    layers = model.blocks()
    wrapped = 0
    for i, block in enumerate(layers):
        if policy == "every_k" and i % every:
            continue
        context = {"context_fn": _selective_context} if policy == "selective" else {}
        layers[i] = checkpoint_wrapper(block, preserve_rng_state=False, **context)
        wrapped += 1
    return wrapped


def parameter_fqn(name: str) -> str:
    """A parameter's name as state dicts and checkpoints know it (without the checkpoint wrapper's part)."""
    return name.replace(WRAPPED_PREFIX, "")


def saved_activation_bytes(model: nn.Module, input_ids: torch.Tensor) -> int:
    """Bytes of tensors a forward pass leaves alive for the backward pass (the activation memory a policy
    is about), measured on any device: every tensor an op creates during the forward is noted (by its
    storage, weakly), and after the forward those still alive, other than parameters and the input, are
    summed. Then the backward runs, so the model is left as a training step would leave it."""
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    created: list[tuple[StorageWeakRef, int, int]] = []  # freed storages' addresses are reused: keep all

    class NoteOutputs(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and not t.is_meta:
                    storage = t.untyped_storage()
                    created.append((StorageWeakRef(storage), storage.data_ptr(), storage.nbytes()))
            return out

    owned = {p.untyped_storage().data_ptr() for p in model.parameters()} | {input_ids.untyped_storage().data_ptr()}
    with NoteOutputs():
        loss = model(input_ids)
    alive = {ptr: nbytes for ref, ptr, nbytes in created if ptr not in owned and not ref.expired()}
    loss.backward()
    return sum(alive.values())

