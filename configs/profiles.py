"""Memory profiles: micro-batch, activation checkpointing and optimizer-state precision by device memory,
and the memory plan they are chosen by.

A profile never changes what is learned per optimizer step: it trades micro-batch for accumulation so the
per-process batch (micro x accumulation) stays the preset's. `auto` picks, on CUDA, the largest profile
whose memory plan fits the GPU (90% of it), counting the training state each rank holds: all of it under
DDP, 1/world of it under FSDP. On the CPU `auto` does nothing; `off` trains the config exactly as given.

Budget for GPT-NeoX 1.2B (1.41B parameters, 50304-row embeddings untied): fp32 weights 5.6 GB + fp32
gradients 5.6 GB + AdamW moments 11.3 GB = 22.6 GB before any activation. So a 24 GB card cannot hold
plain AdamW under DDP; `conservative` keeps the moments in bf16 (5.6 GB) and checkpoints activations.
Sharded over 2 GPUs (FSDP) the state is 11.3 GB a GPU and `balanced` fits instead.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from configs.model_config import LOSS_CHUNK_ROWS, ConfigError, ModelSpec
from configs.training_config import default_seq_len

GB = 1e9
USABLE_FRACTION = 0.9  # of the GPU's memory: the allocator's fragmentation and the CUDA context take the rest


@dataclass(frozen=True)
class MemoryProfile:
    name: str
    min_device_gib: float  # auto picks the largest profile whose minimum the device meets
    micro_batch: int
    activation_checkpointing: str  # a policy of utils/model/activation_checkpointing.py
    optimizer_state_dtype: str  # "fp32" | "bf16"


PROFILES = {
    p.name: p
    for p in (
        MemoryProfile("aggressive", 70, micro_batch=8, activation_checkpointing="none", optimizer_state_dtype="fp32"),
        MemoryProfile("balanced", 36, micro_batch=4, activation_checkpointing="full", optimizer_state_dtype="fp32"),
        MemoryProfile("conservative", 0, micro_batch=2, activation_checkpointing="full",
                      optimizer_state_dtype="bf16"),
    )
}


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per GPU for one training process: the estimate profiles are chosen by."""
    weights: float  # fp32 master weights (this rank's shards under FSDP)
    gradients: float  # fp32
    optimizer: float  # AdamW's two moments (Muon: one momentum per block matrix, AdamW's for the rest), fp32 or bf16
    gathered: float  # FSDP: the bf16 units gathered at once (two blocks, the embedding, the head)
    activations: float  # saved for backward, by the activation checkpointing policy (the family's counts)
    loss: float  # the chunked LM-head loss: two fp32 [chunk rows, vocab] buffers
    muon_step: float = 0.0  # Muon: what its step holds for a while (utils/training/optim/muon_ranks.py step_bytes)
    overhead: float = 2 * GB  # CUDA context, cuBLAS workspaces, allocator slack

    @property
    def state(self) -> float:
        return self.weights + self.gradients + self.optimizer

    @property
    def total(self) -> float:
        return self.state + self.gathered + self.activations + self.loss + self.muon_step + self.overhead

    def fits(self, device_gib: float) -> bool:
        return self.total <= USABLE_FRACTION * device_gib * 2**30

    def lines(self) -> list[str]:
        rows = [("weights (fp32)", self.weights), ("gradients (fp32)", self.gradients),
                ("optimizer state", self.optimizer), ("gathered FSDP units", self.gathered),
                ("activations", self.activations), ("LM-head loss", self.loss),
                *([("Muon's step", self.muon_step)] if self.muon_step else []), ("overhead", self.overhead),
                ("total", self.total)]
        return [f"  {label:<22}{value / GB:8.2f} GB" for label, value in rows]


def activation_bytes(policy: str, layers: int, tokens: int, kept: dict[str, float], every: int = 2) -> float:
    """What the blocks keep for backward under `policy`, plus the one block recomputed at a time; `kept`: the
    bytes per token one block keeps under none, selective and full (its family's counts in bf16: for GPT-NeoX
    34, 22 and 2 per hidden unit, Korthikanti et al. 2022 without the attention matrix)."""
    per_layer = {"none": [kept["none"]] * layers, "selective": [kept["selective"]] * layers,
                 "full": [kept["full"]] * layers,
                 "every_k": [kept["full"] if i % every == 0 else kept["none"] for i in range(layers)]}[policy]
    recomputed = kept["none"] if policy != "none" else 0
    return (sum(per_layer) + recomputed) * tokens


@dataclass(frozen=True)
class RunShape:
    """What besides the model decides a process's memory: the strategy over `world_size` ranks, the micro-batch
    and its length (None: the training default), the activation-checkpointing policy, AdamW's moments' dtype
    and the optimizer."""

    strategy: str = "ddp"
    world_size: int = 1
    micro_batch: int = 1
    seq_len: int | None = None
    checkpointing: str = "none"
    checkpointing_every: int = 2
    moments: str = "fp32"
    optimizer: str = "adamw"


def memory_plan(spec: ModelSpec, shape: RunShape = RunShape()) -> MemoryPlan:
    from utils.model.families import family_of

    strategy, world_size, micro_batch, seq_len = shape.strategy, shape.world_size, shape.micro_batch, shape.seq_len
    s, h, layers = seq_len or default_seq_len(spec)[0], spec.hidden_size, spec.num_hidden_layers
    family = family_of(spec)  # its counts: utils/model/<family>/__init__.py
    embed = spec.padded_vocab_size * h
    block = family.block_parameters(spec)
    params = family.parameters(spec)
    shards = world_size if strategy == "fsdp" else 1
    # optimizer state: AdamW two moments per parameter; Muon (utils/training/optim/muon.py) one momentum buffer
    # per matrix the family gives it, AdamW's two for the rest; and while it steps, its share of the matrices'
    # updates and Newton-Schulz's workspace (in bf16, a GPU run's muon_ns_dtype)
    matrices = family.muon_values(spec) if shape.optimizer == "muon" else 0
    state_values = 2 * params - matrices
    muon_step = 0
    if shape.optimizer == "muon":
        from utils.training.optim.muon_ranks import step_bytes

        muon_step = step_bytes(muon_shapes(spec), strategy, world_size)
    kept = {p: 2 * family.activations(spec, p) for p in ("none", "selective", "full")}  # bf16
    activations = activation_bytes(shape.checkpointing, layers, s * micro_batch, kept, shape.checkpointing_every)
    rows = min(LOSS_CHUNK_ROWS, micro_batch * (s - 1))
    return MemoryPlan(weights=4 * params / shards, gradients=4 * params / shards,
                      optimizer=(2 if shape.moments == "bf16" else 4) * state_values / shards,
                      gathered=2 * (2 * block + 2 * embed) if strategy == "fsdp" else 0,
                      activations=activations, loss=2 * 4 * rows * spec.padded_vocab_size, muon_step=muon_step)


def muon_shapes(spec: ModelSpec) -> list[tuple[int, int]]:
    """Every matrix Muon orthogonalises: each block's, as the family names them."""
    from utils.model.families import family_of

    return list(family_of(spec).muon_matrices(spec).values()) * spec.num_hidden_layers


def plan_for(profile: "MemoryProfile", spec: ModelSpec, strategy: str, world_size: int,
             seq_len: int | None = None, optimizer: str = "adamw") -> MemoryPlan:
    return memory_plan(spec, RunShape(strategy=strategy, world_size=world_size, micro_batch=profile.micro_batch,
                                      seq_len=seq_len, checkpointing=profile.activation_checkpointing,
                                      moments=profile.optimizer_state_dtype, optimizer=optimizer))


def choose_profile(device_gib: float, spec: ModelSpec | None = None, strategy: str = "ddp", world_size: int = 1,
                   seq_len: int | None = None, optimizer: str = "adamw") -> MemoryProfile:
    """The largest profile (by micro-batch) whose plan fits the device; `conservative` when none does."""
    from configs.model_config import get_model_spec

    spec = spec or get_model_spec("gpt-neox-1.2b")
    for profile in sorted(PROFILES.values(), key=lambda p: -p.min_device_gib):
        if plan_for(profile, spec, strategy, world_size, seq_len, optimizer).fits(device_gib):
            return profile
    return PROFILES["conservative"]


def apply_profile(cfg, profile: MemoryProfile):
    """The config with the profile's settings; accumulation absorbs the micro-batch change."""
    per_process = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps
    micro = min(profile.micro_batch, per_process)
    if per_process % micro:
        raise ConfigError(
            f"profile '{profile.name}' uses micro-batch {micro}, which does not divide the per-process batch "
            f"{per_process} (per_device_train_batch_size x gradient_accumulation_steps); choose another "
            f"--set profile=... or set the batch sizes so it divides")
    return replace(cfg, per_device_train_batch_size=micro, gradient_accumulation_steps=per_process // micro,
                   activation_checkpointing=profile.activation_checkpointing, gradient_checkpointing=False,
                   optimizer_state_dtype=profile.optimizer_state_dtype)


def resolve_profile(cfg, device_type: str, device_gib: float | None, world_size: int = 1):
    """(config to train with, profile or None). `auto` applies only on CUDA; a named profile anywhere."""
    if cfg.profile == "off":
        return cfg, None
    if cfg.profile == "auto":
        if device_type != "cuda" or device_gib is None:
            return cfg, None
        from configs.model_config import get_model_spec

        spec = None if cfg.init_from else get_model_spec(cfg.model)  # init_from: sized as the 1.2B
        profile = choose_profile(device_gib, spec, cfg.strategy, world_size, cfg.seq_len or None, cfg.optimizer)
    else:
        profile = PROFILES[cfg.profile]
    return apply_profile(cfg, profile), profile
