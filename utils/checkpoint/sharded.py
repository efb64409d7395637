"""Sharded model and optimizer state (`strategy=fsdp`) through `torch.distributed.checkpoint` (DCP).

Under FSDP every rank writes its own shards of the model and the optimizer into `dcp/` inside the
checkpoint directory (`__R_0.distcp` per rank, DCP's `.metadata` from rank 0), with `dcp.async_save`: the
loop waits only while the shards are staged to host memory; the files are written by DCP's thread, which
coordinates the ranks over a gloo group of its own, so it never competes with the training collectives.
The rest of the checkpoint (scheduler, data cursor, RNG, trainer_state.json, manifest.json) is rank 0's,
as in the unsharded format (utils/checkpoint/format.py), and the manifest lists every rank's files.

Several nodes without a shared filesystem (a bucket is then required, train.py checks): each node writes
its own ranks' shards into the temporary directory on its own disk. Once DCP's write has finished on every
rank, the first process of each node other than rank 0's uploads that node's files to the checkpoint's
place in GCS and deletes them locally (`NodeUploads`); the ranks then gather, on the saver's group, what
each node uploaded (name, size, crc32c) or why it failed. Rank 0's manifest lists those files as `remote`:
rank 0's own copy holds only its node's files, and its background upload sends the manifest last, so the
checkpoint becomes complete in GCS only after every node's files are there. A node whose upload fails
leaves this checkpoint incomplete (rank 0 says so; the next checkpoint tries again, the previous one is
intact). `--resume` downloads the whole checkpoint on every node.

Resume reshards: a DCP checkpoint loads into any world size and either strategy (DCP plans the reads
from each rank's current shapes), and an unsharded checkpoint (model.safetensors + optimizer.pt, written
by DDP runs, also before sharding existed) loads into an FSDP model as full state that each rank cuts to
its shards. State is keyed by parameter name throughout, so the optimizer state follows its parameter
whatever the layout.
"""
from __future__ import annotations

import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from utils.checkpoint.format import CheckpointError

SHARDED_DIR = "dcp"  # inside a checkpoint directory
METADATA = ".metadata"
# The saver's gloo group also waits for the nodes' uploads (NodeUploads): far longer than a collective.
SAVER_GROUP_TIMEOUT = timedelta(hours=3)


class NodeUploadFailed(CheckpointError):
    """A node's shards of a checkpoint did not reach GCS: that checkpoint is complete nowhere."""


@dataclass
class NodeUploads:
    """Multi-node sharded saves without a shared output dir (see the module docstring). `uploader`: this
    process uploads its node's files (the first process of a node other than rank 0's); `remote_root`:
    the run's checkpoint folder in GCS; `log`: where this node says what failed."""
    uploader: bool
    remote_root: str
    client_factory: Callable
    log: Callable[[str], None] = print

    def upload(self, directory: Path, name: str) -> dict:
        """This node's files of checkpoint `name` (in `directory`, its temporary dir) -> GCS, then deleted
        here. Returns {"files": {rel: {size, crc32c, remote}}} or {"error": why}; never raises."""
        from utils import files
        from utils.storage import parse_gs_url, upload_verified

        url = f"{self.remote_root}/{name}"
        try:
            client, (bucket, prefix) = self.client_factory(), parse_gs_url(url)
            listed = {}
            for path in sorted(p for p in directory.rglob("*") if p.is_file()):  # no manifest here to put last
                rel = path.relative_to(directory).as_posix()
                crc = upload_verified(client, bucket, path, f"{prefix}/{rel}")  # each file is read once
                listed[rel] = {"size": path.stat().st_size, "crc32c": crc, "remote": True}
            return {"files": listed}
        except Exception as exc:  # noqa: BLE001 - reported by rank 0 for the whole checkpoint
            why = f"{type(exc).__name__}: {exc}".splitlines()[0]
            self.log(f"warning: this node's shards of {name} did not reach {url} ({why}); that checkpoint is "
                     f"incomplete, the next one tries again")
            return {"error": why}
        finally:
            files.remove_tree(directory)


def is_sharded(directory) -> bool:
    return (Path(directory) / SHARDED_DIR / METADATA).is_file()


def _dist() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


class ShardedSaver:
    """One rank's side of sharded saves: `start(model, optimizer, dest, name)` stages and returns a future
    for the write (with `nodes`, for the nodes' uploads too; on rank 0 its result is the files the other
    nodes uploaded); at most one is in flight (the next start waits for the previous one)."""

    def __init__(self, nodes: NodeUploads | None = None):
        import torch.distributed as dist
        from torch.distributed.checkpoint import FileSystemWriter

        self.group = dist.new_group(backend="gloo", timeout=SAVER_GROUP_TIMEOUT) if _dist() else None
        # kept across saves so DCP reuses its pinned staging buffers on CUDA (cache_staged_state_dict pins
        # host memory, which needs a GPU)
        self.writer = FileSystemWriter(".", cache_staged_state_dict=torch.cuda.is_available())
        self.nodes = nodes
        self.after = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-nodes") if nodes else None
        self.pending = None

    def start(self, model: nn.Module, optimizer: torch.optim.Optimizer, dest: Path, name: str = ""):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self.wait()
        model_state, optim_state = get_state_dict(model, optimizer)
        written = dcp.async_save({"model": model_state, "optim": optim_state}, checkpoint_id=str(dest),
                                 storage_writer=self.writer, process_group=self.group, no_dist=self.group is None)
        self.pending = written if self.after is None else self.after.submit(self._gather_nodes, written,
                                                                            Path(dest).parent, name)
        return self.pending

    def _gather_nodes(self, written: Future, directory: Path, name: str) -> dict:
        """After every rank's write: this node's upload (by its uploader), then rank 0 learns each node's
        files. Every rank runs it, in the same order of saves, on the saver's group."""
        import torch.distributed as dist

        written.result()  # DCP raises on every rank when any rank's write failed: nobody reaches the gather
        report = self.nodes.upload(directory, name) if self.nodes.uploader else None
        rank = dist.get_rank(self.group)
        reports = [None] * dist.get_world_size(self.group) if rank == 0 else None
        dist.gather_object(report, reports, dst=0, group=self.group)
        if rank != 0:
            return {}
        failed = [f"rank {r}'s node: {rep['error']}" for r, rep in enumerate(reports) if rep and "error" in rep]
        if failed:
            raise NodeUploadFailed(f"checkpoint {name} is incomplete in {self.nodes.remote_root}: "
                                   f"{'; '.join(failed)}")
        return {rel: entry for rep in reports if rep for rel, entry in rep["files"].items()}

    def wait(self) -> None:
        pending, self.pending = self.pending, None
        if pending is not None:
            try:
                pending.result()
            except NodeUploadFailed:
                pass  # rank 0's writer waits on the same future and reports it


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
    from utils.model.activation_checkpointing import parameter_fqn

    names = {id(p): parameter_fqn(n) for n, p in model.named_parameters()}
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
