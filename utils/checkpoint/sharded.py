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

Nothing read from `dcp/` runs code. DCP's own reader unpickles `.metadata` and its planner unpickles the
non-tensor values (the optimizer's hyperparameters) with a full unpickler (torch.load without weights_only);
here `.metadata` goes through an unpickler that admits only DCP's metadata classes and the torch types they
hold (`MetadataReader`), the files it names must lie in `dcp/`, and non-tensor values load with
`weights_only=True` (`WeightsOnlyLoadPlanner`). Anything else is refused in one line naming the file. DCP reports a
failure on any rank as a `CheckpointException` (a BaseException, with every rank's traceback); loads and saves turn it
into one CheckpointError (a DiskFullError when the disk is full), so a bad checkpoint or a full disk is one
line, never a traceback.

Resume reshards: a DCP checkpoint loads into any world size and either strategy (DCP plans the reads
from each rank's current shapes), and an unsharded checkpoint (model.safetensors + optimizer.pt, written
by DDP runs, also before sharding existed) loads into an FSDP model as full state that each rank cuts to
its shards. State is keyed by parameter name throughout, so the optimizer state follows its parameter
whatever the layout.
"""
from __future__ import annotations

import functools
import pickle
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner

from utils.checkpoint.format import SHARDED_DIR, CheckpointError, NodeUploadFailed
from utils.errors import UserError
from utils.io import files

METADATA = ".metadata"
# The saver's gloo group also waits for the nodes' uploads (NodeUploads): far longer than a collective.
SAVER_GROUP_TIMEOUT = timedelta(hours=3)
# What `.metadata` may name: found by unpickling the metadata of our FSDP checkpoints (model and AdamW state,
# fp32 and bf16 runs, 1 and 2 ranks) while recording each global; torch dtypes (torch.float32, ...) besides.
_METADATA_GLOBALS = {
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata", "BytesStorageMetadata",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib._local", "PosixPath"),  # StorageMeta.checkpoint_id (3.13 moved it)
}


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
        from utils.io import files
        from utils.io.storage import parse_gs_url, upload_verified

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


class UnsafeCheckpoint(CheckpointError):
    """A file in `dcp/` holds more than data (a pickle that would import or call something else)."""


@functools.cache
def _buildable() -> dict[type, frozenset[str]]:
    """The classes whose instances `.metadata` may BUILD, each with the fields its state may set: DCP's metadata
    dataclasses (TensorProperties sets its own five from a tuple, through its __setstate__)."""
    import dataclasses

    from torch.distributed.checkpoint import metadata as m
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return {cls: frozenset(f.name for f in dataclasses.fields(cls))
            for cls in (m.Metadata, m.TensorStorageMetadata, m.TensorProperties, m.ChunkStorageMetadata,
                        m.BytesStorageMetadata, m.MetadataIndex, m.StorageMeta, _StorageInfo)}


class _MetadataUnpickler(pickle._Unpickler):  # the Python one: its BUILD can be checked (the C one's cannot)
    """Admits DCP's metadata names only (find_class), and BUILDs nothing but an instance of DCP's metadata
    dataclasses, setting only their own fields: a BUILD onto a class (pathlib.PosixPath's `_str`, which would
    have every path the process builds point at one file) or onto anything else is refused."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str):
        if (module, name) in _METADATA_GLOBALS or module == "torch" and isinstance(vars(torch).get(name), torch.dtype):
            return super().find_class(module, name)
        raise UnsafeCheckpoint(f"names {module}.{name}, which DCP's metadata never holds: refused (a checkpoint "
                               f"holds data, never code); delete this checkpoint or use another")

    def load_build(self):
        state, target = self.stack[-1], self.stack[-2]
        fields = None if isinstance(target, type) else _buildable().get(type(target))
        what = target.__name__ if isinstance(target, type) else type(target).__name__
        if fields is None:
            raise UnsafeCheckpoint(f"sets state on {what}, which is none of DCP's metadata: refused (a checkpoint "
                                   f"holds data, never code); delete this checkpoint or use another")
        if type(target).__name__ == "TensorProperties":
            ok = isinstance(state, tuple) and len(state) == len(fields)
        else:
            slots = state[1] if isinstance(state, tuple) and len(state) == 2 else None
            state = state[0] if isinstance(state, tuple) and len(state) == 2 else state
            ok = all(d is None or isinstance(d, dict) and all(isinstance(k, str) for k in d) and set(d) <= fields
                     for d in (state, slots))
        if not ok:
            raise UnsafeCheckpoint(f"sets state on {what} other than its fields ({', '.join(sorted(fields))}): "
                                   f"refused; delete this checkpoint or use another")
        super().load_build()

    dispatch[pickle.BUILD[0]] = load_build


class MetadataReader(FileSystemReader):
    """DCP's FileSystemReader, reading `.metadata` through _MetadataUnpickler (DCP's own unpickles anything)
    and refusing a shard file it names outside `dcp/`. `checked(checkpoint)` reads it before DCP runs: DCP
    catches a reader's error, logs its traceback and falls back to other files, so it is raised here first."""

    def __init__(self, path):
        super().__init__(path)
        self.metadata = None

    @classmethod
    def checked(cls, checkpoint) -> "MetadataReader":
        reader = cls(Path(checkpoint) / SHARDED_DIR)
        reader.read_metadata()
        return reader

    def read_metadata(self, *args, **kwargs):
        if self.metadata is None:
            self.metadata = self._read_safely(Path(self._get_metadata_path()))
        self.metadata.storage_meta.load_id = self.load_id  # as DCP's own reader does
        return self.metadata

    def _read_safely(self, path: Path):
        from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except UnsafeCheckpoint as exc:
            raise UnsafeCheckpoint(f"{path} {exc}") from None
        except Exception as exc:  # noqa: BLE001 - whatever a damaged pickle raises
            raise CheckpointError(f"{path} is unreadable ({_one_line(exc)}); the checkpoint is corrupt") from None
        if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
            raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP's metadata; the checkpoint "
                                  f"is corrupt")
        for item in metadata.storage_data.values():
            rel = getattr(item, "relative_path", None)
            if not (files.inside(self.path, rel) and "/" not in rel):
                raise UnsafeCheckpoint(f"{path} names the shard file {rel!r}, outside {self.path}: refused; delete "
                                       f"this checkpoint or use another")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        return metadata


class _WeightsOnlyBytes:
    """DCP's planners unpickle a state's non-tensor values (the optimizer's hyperparameters) with
    a full unpickler (torch.load without weights_only); this loads them with `weights_only=True`."""

    def load_bytes(self, read_item, value) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise UnsafeCheckpoint(f"{SHARDED_DIR}/ holds {fqn} as more than data ({str(exc).splitlines()[0]}): "
                                   f"refused (a checkpoint holds data, never code); delete this checkpoint or use "
                                   f"another") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


class WeightsOnlyLoadPlanner(_WeightsOnlyBytes, DefaultLoadPlanner):
    pass


class _WeightsOnlyEmptyPlanner(_WeightsOnlyBytes, _EmptyStateDictLoadPlanner):
    """Fills an empty state from the metadata (as torch's dcp_to_torch_save does), values with weights_only."""


def _first_failure(exc: BaseException) -> tuple[int | None, BaseException]:
    """(rank, exception) of the first rank's failure inside DCP's CheckpointException (which may nest)."""
    from torch.distributed.checkpoint.api import CheckpointException

    rank = None
    while isinstance(exc, CheckpointException) and exc.failures:
        rank, (exc, _trace) = min(exc.failures.items(), key=lambda item: item[0])
    return rank, exc


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


@contextmanager
def _dcp_errors(checkpoint: Path) -> Iterator[None]:
    """A DCP load's CheckpointException -> one UserError (`_dcp_failure`)."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as exc:
        raise _dcp_failure(exc, checkpoint, "reading") from None


def _dcp_failure(exc: BaseException, checkpoint: Path, doing: str, needed: int | None = None) -> UserError:
    """DCP's failure of a load or save on any rank, in one line: our own error raised inside DCP (a refused
    value) as it is, a full disk while writing as the DiskFullError the README promises, anything else as a
    CheckpointError naming the rank. torch's zip writer reports a full disk as a short write ("unexpected
    pos"), without the errno, so a write that leaves less free space than this rank's shards need (`needed`)
    counts as one too."""
    rank, cause = _first_failure(exc)
    if isinstance(cause, CheckpointError):
        return type(cause)(f"checkpoint {checkpoint}: {cause}")
    if needed is not None:
        try:
            full = files.is_disk_full(cause) or files.free_bytes(checkpoint.parent) < needed
        except OSError:
            full = False
        if full:
            return files.disk_full_error(checkpoint, needed, cause=cause)
    on = f" on rank {rank}" if rank is not None else ""
    return CheckpointError(f"checkpoint {checkpoint}: {doing} {SHARDED_DIR}/ failed{on} ({_one_line(cause)})")


def _dist() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


class ShardedSaver:
    """One rank's side of sharded saves: `start(model, optimizer, dest, name)` stages and returns a future
    for the write (with `nodes`, for the nodes' uploads too; on rank 0 its result is the files the other
    nodes uploaded; a failure is one UserError, on every rank); at most one is in flight (the next start
    waits for the previous one)."""

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
        state = {"model": model_state, "optim": optim_state}
        written = _failing_in_one_line(
            dcp.async_save(state, checkpoint_id=str(dest), storage_writer=self.writer, process_group=self.group,
                           no_dist=self.group is None),
            Path(dest).parent.parent / name, _tensor_bytes(state))
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


def _tensor_bytes(state) -> int:
    """Bytes of this rank's tensors in a (nested) state dict: what its shards of a save take on disk."""
    from utils.runtime.distributed import local_tensor

    if isinstance(state, torch.Tensor):
        return local_tensor(state).numel() * local_tensor(state).element_size()
    if isinstance(state, dict):
        return sum(_tensor_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_tensor_bytes(v) for v in state)
    return 0


def _failing_in_one_line(written: Future, checkpoint: Path, needed: int) -> Future:
    """DCP's future for a sharded write -> one whose failure is a single UserError (`_dcp_failure`)."""
    result: Future = Future()

    def done(future: Future) -> None:
        # DCP's thread, before whoever waits on `result` goes on (rank 0's writer then removes the partial
        # files): the free space is still what the failed write left
        exc = future.exception()
        if exc is None:
            result.set_result(future.result())
            return
        try:
            result.set_exception(_dcp_failure(exc, checkpoint, "writing", needed))
        except Exception as unexpected:  # noqa: BLE001 - the waiter must get an error, whatever happens here
            result.set_exception(CheckpointError(f"checkpoint {checkpoint}: writing {SHARDED_DIR}/ failed "
                                                 f"({_one_line(exc)}; {_one_line(unexpected)})"))

    written.add_done_callback(done)
    return result


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
    with warnings.catch_warnings(), _dcp_errors(directory):
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process": it is
        dcp.load(state, storage_reader=MetadataReader.checked(directory), planner=WeightsOnlyLoadPlanner(),
                 no_dist=not _dist())


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
    parameter name, using this optimizer's groups, which hold the same parameters in the same order. A state
    tensor (a moment, a momentum buffer) of another shape than its parameter is refused here, naming both:
    torch would load it and fail at the first step."""
    names = {}  # the state dict's names: wrappers (activation checkpointing) leave them as the model's own
    for name, p in model.state_dict(keep_vars=True).items():
        names.setdefault(id(p), name)  # a tied weight keeps its first name, as named_parameters() gives it
    state, groups = {}, []
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(f"the saved optimizer has {len(saved['param_groups'])} parameter groups, this one "
                         f"{len(optimizer.param_groups)}")
    for saved_group, group in zip(saved["param_groups"], optimizer.param_groups):
        if len(saved_group["params"]) != len(group["params"]):
            raise ValueError("the saved optimizer's parameter groups hold other parameters than this model's")
        fqns = [names[id(p)] for p in group["params"]]
        for number, fqn, param in zip(saved_group["params"], fqns, group["params"]):
            if number in saved["state"]:
                state[fqn] = saved["state"][number]
                _check_state_shapes(fqn, param, state[fqn])
        groups.append({**saved_group, "params": fqns})
    return {"state": state, "param_groups": groups}


def _check_state_shapes(name: str, param: torch.Tensor, saved) -> None:
    if not isinstance(saved, dict):
        raise ValueError(f"the saved optimizer state of {name} is {type(saved).__name__}, not a mapping")
    for key, value in saved.items():
        if isinstance(value, torch.Tensor) and value.dim() and tuple(value.shape) != tuple(param.shape):
            raise ValueError(f"the saved optimizer's {key} of {name} has shape {tuple(value.shape)}, the parameter "
                             f"{tuple(param.shape)}")


def read_full_model_state(directory) -> dict[str, torch.Tensor]:
    """The whole model's weights from a sharded checkpoint, in one process (for export): DCP reassembles
    every rank's shards; the optimizer state is not read."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict = {}  # filled from the metadata (what torch's own dcp_to_torch_save does)
    with _dcp_errors(directory):
        _load_state_dict(state, storage_reader=MetadataReader.checked(directory),
                         planner=_WeightsOnlyEmptyPlanner(keys={"model"}), no_dist=True)
    model = state["model"]
    return {k: v for k, v in model.items() if isinstance(v, torch.Tensor)}
