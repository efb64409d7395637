"""Sharded model and optimizer state (`strategy=fsdp`) through `torch.distributed.checkpoint` (DCP).

Under FSDP every rank writes its own shards of the model and the optimizer into `dcp/` inside the
checkpoint directory (`__R_0.distcp` per rank, DCP's `.metadata` from rank 0), with `dcp.async_save`: the
loop waits only while the shards are staged to host memory; the files are written by DCP's thread, which
coordinates the ranks over a gloo group of its own, so it never competes with the training collectives.
The rest of the checkpoint (scheduler, data cursor, RNG, trainer_state.json, manifest.json) is rank 0's,
as in the unsharded format (utils/checkpoint/format.py), and the manifest lists every rank's files.

Resume reshards: a DCP checkpoint loads into any world size and either strategy (DCP plans the reads
from each rank's current shapes), and an unsharded checkpoint (model.safetensors + optimizer.pt, written
by DDP runs, also before sharding existed) loads into an FSDP model as full state that each rank cuts to
its shards. State is keyed by parameter name throughout, so the optimizer state follows its parameter
whatever the layout.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn

SHARDED_DIR = "dcp"  # inside a checkpoint directory
METADATA = ".metadata"


def is_sharded(directory) -> bool:
    return (Path(directory) / SHARDED_DIR / METADATA).is_file()


def _dist() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


class ShardedSaver:
    """One rank's side of sharded saves: `start(model, optimizer, dest)` stages and returns a future for
    the write; at most one is in flight (the next start waits for the previous one)."""

    def __init__(self):
        import torch.distributed as dist
        from torch.distributed.checkpoint import FileSystemWriter

        self.group = dist.new_group(backend="gloo") if _dist() else None
        # kept across saves so DCP reuses its pinned staging buffers on CUDA (cache_staged_state_dict pins
        # host memory, which needs a GPU)
        self.writer = FileSystemWriter(".", cache_staged_state_dict=torch.cuda.is_available())
        self.pending = None

    def start(self, model: nn.Module, optimizer: torch.optim.Optimizer, dest: Path):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self.wait()
        model_state, optim_state = get_state_dict(model, optimizer)
        self.pending = dcp.async_save({"model": model_state, "optim": optim_state}, checkpoint_id=str(dest),
                                      storage_writer=self.writer, process_group=self.group,
                                      no_dist=self.group is None)
        return self.pending

    def wait(self) -> None:
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result()


def load_sharded(model: nn.Module, optimizer: torch.optim.Optimizer | None, directory: Path) -> None:
    """Loads a DCP checkpoint's model (and optimizer) state into this rank's model, sharded or not.
    Collective when a process group is up: every rank calls it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if optimizer is None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

        state = {"model": get_model_state_dict(model)}
        _dcp_load(dcp, state, directory)
        set_model_state_dict(model, state["model"])
        return
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    _dcp_load(dcp, state, directory)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _dcp_load(dcp, state: dict, directory: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process": it is
        dcp.load(state, checkpoint_id=str(Path(directory) / SHARDED_DIR), no_dist=not _dist())


def load_full(model: nn.Module, optimizer: torch.optim.Optimizer | None, model_state: dict,
              optim_state: dict | None) -> None:
    """Loads full (unsharded) state, the optimizer's as torch saves it (parameters numbered in the order of
    its param groups), into a model that may be sharded: each rank keeps its own shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    options = StateDictOptions(full_state_dict=True, strict=not model.spec.tie_word_embeddings)
    if optimizer is None or optim_state is None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(model, model_state, options=options)
        return
    set_state_dict(model, optimizer, model_state_dict=model_state,
                   optim_state_dict=optimizer_state_by_name(model, optimizer, optim_state), options=options)


def optimizer_state_by_name(model: nn.Module, optimizer: torch.optim.Optimizer, saved: dict) -> dict:
    """torch's optimizer state dict (parameters numbered 0..N-1 across its groups) -> the same keyed by
    parameter name, using this optimizer's groups, which hold the same parameters in the same order."""
    names = {id(p): n for n, p in model.named_parameters()}
    state, groups = {}, []
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(f"the saved optimizer has {len(saved['param_groups'])} parameter groups, this one "
                         f"{len(optimizer.param_groups)}")
    for saved_group, group in zip(saved["param_groups"], optimizer.param_groups):
        if len(saved_group["params"]) != len(group["params"]):
            raise ValueError("the saved optimizer's parameter groups hold other parameters than this model's")
        fqns = [names[id(p)] for p in group["params"]]
        for number, fqn in zip(saved_group["params"], fqns):
            if number in saved["state"]:
                state[fqn] = saved["state"][number]
        groups.append({**saved_group, "params": fqns})
    return {"state": state, "param_groups": groups}


def read_full_model_state(directory) -> dict[str, torch.Tensor]:
    """The whole model's weights from a sharded checkpoint, in one process (for export): DCP reassembles
    every rank's shards; the optimizer state is not read."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict = {}  # filled from the metadata (what torch's own dcp_to_torch_save does)
    _load_state_dict(state, storage_reader=FileSystemReader(str(Path(directory) / SHARDED_DIR)),
                     planner=_EmptyStateDictLoadPlanner(keys={"model"}), no_dist=True)
    model = state["model"]
    return {k: v for k, v in model.items() if isinstance(v, torch.Tensor)}
