"""`strategy=fsdp`: the native model (any family) sharded with FSDP2 (`torch.distributed.fsdp.fully_shard`).

Units, as torchtitan lays them out: one per transformer block, the input embedding, the final norm together
with the LM head (not resharded after forward: backward needs them at once), then the root (the rest: the
rotary tables are buffers, not sharded). The parallelism seam (utils/parallel/strategies.py) calls these after
activation checkpointing, fp8 and per-block compile, over the device mesh it built. In bf16 runs parameters are gathered
and computed in bf16 and gradients reduce-scattered in fp32 (`MixedPrecisionPolicy`); fp32 runs keep fp32 throughout.

Gradient accumulation reduce-scatters every micro-batch into the sharded fp32 gradients: each rank holds
1/N of the gradients between micro-batches. Keeping unsharded gradients until the sync step would save
the per-micro-batch collectives but hold a full fp32 copy (5.6 GB at 1.2B) on every rank, which is what
FSDP is chosen to avoid.

Why our own `fully_shard` calls and not accelerate's FSDP2 plugin: the plugin wraps by layer class name
and cannot make the norm + head group, it applies its own precision and state-dict handling through
`accelerator.prepare`/`save_state`, and its launch flags are GPU-only. These thirty lines give the exact
unit layout, a CPU device mesh (so `--cpu --strategy fsdp` runs over gloo and CI tests it), and leave
checkpoints to the engine's own sharded format (utils/checkpoint/sharded.py). accelerate still launches the
processes, owns the process group, accumulation bookkeeping and the trackers.

Every rank builds the model on the meta device; rank 0 alone makes the real weights (the seeded init, or
`init_from`'s), which reach the other ranks' shards by broadcast. So host memory holds one full copy per
node, not one per rank, and a fresh FSDP run starts from exactly the weights a DDP run with the same seed
starts from.
"""
from __future__ import annotations

import torch
from torch import nn


def mixed_precision_policy(precision: str):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision in ("bf16", "fp8"):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def ensure_process_group(device: torch.device) -> None:
    """FSDP2 needs a process group even for one process: a process started without a launcher
    (`python train.py`, `start_training.sh --gpus 1`) gets a group of its own, over an in-memory store
    (no port, no environment variables)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda" and device.index is None:  # NCCL wants the device's index ("cuda" -> "cuda:N")
        device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                            device_id=device if device.type == "cuda" else None)


def shard_model(model: nn.Module, mesh, precision: str) -> nn.Module:
    """Applies fully_shard over `mesh` to the native model's units and the root, in place; returns the model."""
    from torch.distributed.fsdp import fully_shard

    kwargs = {"mesh": mesh, "mp_policy": mixed_precision_policy(precision)}
    for block in model.blocks():  # the model's interface (utils/model/layers.py), whatever its family
        fully_shard(block, **kwargs)
    if not model.spec.tie_word_embeddings:  # a tied head shares its weight with the embedding: both stay in the root
        fully_shard(model.input_embedding(), **kwargs)
        fully_shard(model.output_units(), reshard_after_forward=False, **kwargs)
    fully_shard(model, **kwargs)
    return model


def materialize(model: nn.Module, device: torch.device, full_state: dict | None) -> None:
    """Gives a sharded meta-device model real storage and the weights in `full_state`, which rank 0 holds
    (every other rank passes None): each rank receives its own shards by broadcast."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model.to_empty(device=device)
    model.reset_buffers()
    set_model_state_dict(model, full_state or {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False))


def full_model_state(model: nn.Module, rank: int) -> dict | None:
    """The whole model's weights on the CPU, on rank 0 (None elsewhere). Collective: call on every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return state if rank == 0 else None


def clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clips sharded gradients by their true global norm (a DTensor norm's full value, not one shard's) and
    returns that norm."""
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if hasattr(total, "full_tensor"):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
