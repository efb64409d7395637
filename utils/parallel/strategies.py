"""The parallelism seam: how the model is spread over the processes, decided once per run.

`make_parallelism(cfg, accelerator)` returns the strategy object for `cfg.strategy`; nothing else in the
engine tests the strategy. It owns, in this order, what turns a model spec into the model the loop trains:

    build on the device (DDP) or the meta device (FSDP)
    -> activation checkpointing (the policy, utils/model/activation_checkpointing.py)
    -> fp8 (torchao float8 Linear layers)
    -> compile (regional: each block)
    -> shard (FSDP2's fully_shard per unit, over the mesh)
    -> materialize (FSDP: rank 0's full weights reach every rank's shards)

and, once training runs: wrapping model and optimizer (`prepare`), gradient clipping (a sharded gradient's
norm is a DTensor's), what follows an optimizer step (fp8 scales under FSDP), the whole model's weights
for export and samples (`full_state_dict`, collective under FSDP), whether the ranks' weights agree, and
`sharded`: what the Checkpointer (every rank writes its shards) and the Sampler (every rank runs the
forward) need to know.

The device mesh is built here, with named dimensions (`ParallelDims`): today one data-parallel dimension
(`dp_replicate` for DDP, `dp_shard` for FSDP); a second one (tensor parallel, or replicate x shard) is a
new field, a new mesh dimension and a new strategy class, registered in STRATEGIES.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from configs.training_config import STRATEGIES as STRATEGY_NAMES
from utils.errors import UserError
from utils.model.activation_checkpointing import CheckpointingSettings, apply_activation_checkpointing
from utils.runtime.distributed import local_tensor


@dataclass(frozen=True)
class ParallelDims:
    """The degree of each kind of parallelism; their product is the world size."""
    dp_replicate: int = 1  # ranks holding a whole replica each (DDP)
    dp_shard: int = 1  # ranks the parameters, gradients and optimizer state are sharded over (FSDP)

    def mesh(self, device_type: str):
        """The device mesh over the dimensions larger than one (FSDP2 takes it; DDP needs none)."""
        from torch.distributed.device_mesh import init_device_mesh

        dims = [(name, size) for name, size in (("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard))
                if size > 1] or [("dp_shard", 1)]
        return init_device_mesh(device_type, tuple(s for _, s in dims), mesh_dim_names=tuple(n for n, _ in dims))


@dataclass(frozen=True)
class ParallelSettings(CheckpointingSettings):
    """What the parallelism seam reads: the strategy, and how it builds, wraps and compiles the model."""

    strategy: str
    mixed_precision: str
    compile_model: bool
    attention: str
    position_reset: bool
    seed: int
    model_impl: str
    init: str


class DataParallel:
    """`strategy=ddp`: every rank holds the whole model; accelerate's DDP all-reduces the gradients."""

    name = "ddp"
    sharded = False  # parameters, gradients and optimizer state are whole on every rank

    def __init__(self, settings: ParallelSettings, accelerator):
        self.settings, self.accelerator = settings, accelerator
        self.device = accelerator.device
        self.dims = self._dims(accelerator.num_processes)
        self.activation_checkpointing, self.every_k = settings.policy

    def _dims(self, world: int) -> ParallelDims:
        return ParallelDims(dp_replicate=world)

    # ------------------------------------------------------------------------------------------- build

    def build_model(self, spec, init_weights: dict | None, log, document_eos: int | None = None) -> nn.Module:
        """The model, wrapped in the order of the module docstring, with `init_weights` (or the seeded init);
        with attention=document, masked at `document_eos`."""
        model = self._new_model(spec, init_weights)
        if self.settings.attention == "document":
            model.use_document_masking(document_eos, self.settings.position_reset)
            log.info(f"attention: document (tokens attend within their own document; EOS id {document_eos}"
                     f"{', rotary positions restart at each document' if self.settings.position_reset else ''}; "
                     f"{'FlexAttention block mask' if model.flex_attention else 'SDPA with a dense mask'})")
        policy = self.activation_checkpointing
        if policy != "none":
            count = apply_activation_checkpointing(model, policy, self.every_k)
            log.info(f"activation checkpointing: {policy} on {count} of {spec.num_hidden_layers} blocks")
        if self.settings.mixed_precision == "fp8":
            from utils.model.fp8 import enable_fp8, fp8_supported

            supported, why = fp8_supported(self.device)
            if not supported:
                raise UserError(why)
            log.info(f"fp8: {enable_fp8(model, fsdp=self.sharded)} Linear layers run float8 matmuls (torchao, "
                     f"tensorwise scaling{', float8 all-gather' if self.sharded else ''})")
        if self.settings.compile_model:
            model.compile_blocks()  # regional: each block compiled once, in place (under DDP's wrapper too)
        return self._distribute(model, spec, init_weights)

    def _build(self, spec) -> nn.Module:
        from utils.model import build_model

        return build_model(spec, seed=self.settings.seed, impl=self.settings.model_impl, init=self.settings.init)

    def _new_model(self, spec, init_weights: dict | None) -> nn.Module:
        model = self._build(spec)
        if init_weights is not None:
            model.load_state_dict(init_weights, strict=not spec.tie_word_embeddings)
        return model

    def _distribute(self, model: nn.Module, spec, init_weights: dict | None) -> nn.Module:
        return model  # accelerate moves and wraps it in `prepare`

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        """(model, optimizer) as the loop drives them: here DDP-wrapped by accelerate, and an optimizer that
        can split its per-matrix work between the replicas told of them (Muon's Newton-Schulz)."""
        if self.accelerator.num_processes > 1:
            from utils.training.optim import spread_over_replicas

            spread_over_replicas(optimizer)
        model, optimizer = self.accelerator.prepare(model, optimizer)
        if self.accelerator.scaler is None:
            # AcceleratedOptimizer adds only the fp16 loss-scaler path to step/zero_grad, yet looks up an
            # optional package (importlib find_spec, twice) and a signature on every call: without a scaler
            # the loop drives torch's optimizer itself.
            optimizer = optimizer.optimizer
        return model, optimizer

    # ------------------------------------------------------------------------------------------- train

    def clip_grad_norm(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Clips to `max_norm` and returns the gradients' norm (before clipping)."""
        return self.accelerator.clip_grad_norm_(params, max_norm)

    def after_optimizer_step(self, model: nn.Module) -> None:
        pass

    # ------------------------------------------------------------------------------------- whole model

    def full_state_dict(self, model: nn.Module) -> dict | None:
        """The whole model's weights on rank 0 (None elsewhere). Collective: every rank calls it."""
        core = self.accelerator.unwrap_model(model)
        return core.state_dict() if self.accelerator.is_main_process else None

    def weights_in_sync(self, model: nn.Module) -> tuple[bool, list[float]]:
        """(whether every rank holds the same weights, each rank's sum of them). Collective."""
        core = self.accelerator.unwrap_model(model)
        sums = torch.stack([p.detach().double().sum() for p in core.parameters()]).sum()
        all_sums = self.accelerator.gather(sums.reshape(1)).tolist()
        return all(s == all_sums[0] for s in all_sums), all_sums

    def state_bytes(self, model: nn.Module) -> int:
        """Bytes of parameters this rank holds (its shards under FSDP)."""
        return sum(local_tensor(p).numel() * local_tensor(p).element_size() for p in model.parameters())


class FullyShardedDataParallel(DataParallel):
    """`strategy=fsdp`: FSDP2 over the ranks (utils/model/fsdp.py has the unit layout and why)."""

    name = "fsdp"
    sharded = True

    def __init__(self, settings: ParallelSettings, accelerator):
        super().__init__(settings, accelerator)
        from utils.model.fsdp import ensure_process_group

        ensure_process_group(self.device)  # one process without a launcher gets a group of its own
        self.mesh = None

    def _dims(self, world: int) -> ParallelDims:
        return ParallelDims(dp_shard=world)

    def _new_model(self, spec, init_weights: dict | None) -> nn.Module:
        with torch.device("meta"):
            return self._build(spec)

    def _distribute(self, model: nn.Module, spec, init_weights: dict | None) -> nn.Module:
        from utils.model.fsdp import materialize, shard_model

        self.mesh = self.dims.mesh(self.device.type)
        shard_model(model, self.mesh, self.settings.mixed_precision)
        full = None
        if self.accelerator.is_main_process:  # rank 0 alone holds the whole model: the seeded init or init_from's
            full = init_weights if init_weights is not None else self._build(spec).state_dict()
        materialize(model, self.device, full)
        return model

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        return model, optimizer  # sharded in place; accelerate's wrappers are not used

    def clip_grad_norm(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        from utils.model.fsdp import clip_grad_norm

        return clip_grad_norm(params, max_norm)

    def after_optimizer_step(self, model: nn.Module) -> None:
        if self.settings.mixed_precision == "fp8":  # float8 all-gather: every weight's scale once a step
            from utils.model.fp8 import after_optimizer_step

            after_optimizer_step(model)

    def full_state_dict(self, model: nn.Module) -> dict | None:
        from utils.model.fsdp import full_model_state

        return full_model_state(model, self.accelerator.process_index)

    def weights_in_sync(self, model: nn.Module) -> tuple[bool, list[float]]:
        """One sharded copy cannot disagree with itself; the sum is over every rank's shards."""
        total = torch.stack([local_tensor(p).detach().double().sum() for p in model.parameters()]).sum()
        return True, [self.accelerator.reduce(total, reduction="sum").item()]


STRATEGIES: dict[str, type[DataParallel]] = {"ddp": DataParallel, "fsdp": FullyShardedDataParallel}
assert set(STRATEGIES) == set(STRATEGY_NAMES), "configs/training_config.py's STRATEGIES and this registry differ"


def make_parallelism(settings: ParallelSettings, accelerator) -> DataParallel:
    """The strategy object for `settings.strategy` (validated by the config)."""
    return STRATEGIES[settings.strategy](settings, accelerator)
