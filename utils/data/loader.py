"""The order and the stream: a deterministic, rank-sharded, resumable batch loader, and eval batches.

`ResumableLoader` yields `[micro_batch_size, seq_len]` int64 batches forever, from one source of sequences
(any `SequenceSource`: utils/data/source.py) or a weighted mixture of several (utils/data/mixture.py decides which source each sequence of the global
stream comes from). Global micro-batch b is stream positions [b * G, (b + 1) * G), G = micro * world, and
rank r takes [r * micro, (r + 1) * micro) of it. The state is the number of sequences consumed from each
source (plus the mixture's phase), so restoring it is O(1) and valid across a change of process count.
Each source's order within an epoch is the run's `Shuffle` (global or blocks, utils/data/mixture.py).

A source that fetches its files (a `ReadAhead`, the gs:// stream) is handed this rank's schedule of reads
of it when an iterator starts (`source_schedule`, computed like the sampler's batches), told of each
micro-batch handed to a reader and of each returned to the loop, and the loop asks `unavailable()` at every
step boundary, which waits for the next step's files: so a file that stays unavailable stops the run
between steps, every rank at the same one, never halfway through a step.
`build_eval_batches` gives each rank its share of the first validation batches, in file order;
`EvalBatches` holds them per source.
"""
from __future__ import annotations

import signal
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from utils import debug

from utils.runtime import signals
from utils.data.mixture import MixtureError, MixturePlan, Shuffle, describe_change, epoch_permutation
from utils.data.source import DEFAULT_SOURCE, DataUnavailable, ReadAhead, SequenceSource, Source
from utils.errors import THREAD_FAILED, BackgroundFailure

__all__ = ["EvalBatches", "ResumableLoader", "build_eval_batches", "epoch_permutation"]


def read_picks(datasets: list[SequenceSource], sources: np.ndarray, indices: np.ndarray,
               dtype: np.dtype) -> np.ndarray:
    """Sequence indices[k] of source sources[k], as one [len, seq_len] array of `dtype`."""
    first = int(sources[0])
    if (sources == first).all():
        return datasets[first].get_batch(indices, dtype=dtype)
    out = np.empty((len(indices), datasets[first].seq_len), dtype=dtype)
    for s in np.unique(sources).tolist():
        mask = sources == s
        out[mask] = datasets[s].get_batch(indices[mask], dtype=dtype)
    return out


class _BatchView(Dataset):
    """What the DataLoader indexes: (sources, sequence numbers, meta) -> ([B, seq_len] numpy array of
    `dtype`, meta); `meta` rides along so that the loader learns its cursor from the batch it returns.

    Workers return numpy arrays in the compact wire dtype: pickled through the result pipe they cost a
    fraction of what torch's per-tensor shared-memory hand-off costs, and the int64 widening happens once,
    in the main process."""

    def __init__(self, datasets: list[SequenceSource], dtype: np.dtype):
        self.datasets, self.dtype = datasets, dtype

    def __len__(self) -> int:
        return sum(len(d) for d in self.datasets)

    def __getitem__(self, item):
        sources, indices, meta = item
        return read_picks(self.datasets, sources, indices, self.dtype), meta


def _as_is(batch):
    return batch


def _ignore_stop_signals(_worker_id: int) -> None:
    """DataLoader workers leave SIGTERM/SIGINT to the training process. A scheduler that signals the whole
    process group (SLURM, systemd, `timeout`, Ctrl-C) would otherwise kill the workers first and crash the
    loop before it can checkpoint; the workers still exit when the loader shuts them down or the main
    process dies."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


# ----------------------------------------------------------------------------------------------------
# Order and sharding


def _check_sampling(num_samples: int, micro_batch_size: int, rank: int, world_size: int, seed: int) -> None:
    if num_samples < 1:
        raise ValueError("cannot sample from an empty dataset (0 sequences)")
    if not (0 <= rank < world_size) or micro_batch_size < 1:
        raise ValueError(f"need 0 <= rank < world_size and micro_batch_size >= 1 "
                         f"(got rank={rank}, world_size={world_size}, micro_batch_size={micro_batch_size})")
    if seed < 0:
        raise ValueError(f"seed={seed} must be non-negative")


class MixtureBatchSampler(Sampler):
    """Rank r's micro-batches of the mixture's global stream, from the plan state `start`: yields
    (source numbers, sequence numbers, (plan state after this global micro-batch, sources dropped in it,
    the micro-batch's number b from 0)); `handed_out(b)` is called before each is yielded."""

    def __init__(self, specs: list[Source], micro_batch_size: int, rank: int, world_size: int, seed: int,
                 start: tuple, shuffle: Shuffle, handed_out: Callable[[int], None] | None = None):
        self.specs, self.micro, self.rank, self.world = specs, micro_batch_size, rank, world_size
        self.orders = [shuffle.order(s, seed) for s in specs]
        self.start, self.handed_out = start, handed_out

    def __iter__(self):
        plan = MixturePlan(self.specs)
        plan.restore(self.start)
        mine = slice(self.rank * self.micro, (self.rank + 1) * self.micro)
        b = 0
        while True:
            sources, positions, dropped = plan.take(self.micro * self.world)
            sources, positions = sources[mine], positions[mine]
            indices = np.empty(len(positions), dtype=np.int64)
            for s in np.unique(sources).tolist():
                mask = sources == s
                indices[mask] = self.orders[s].at(positions[mask])
            if self.handed_out is not None:
                self.handed_out(b)
            yield sources, indices, (plan.snapshot(), dropped, b)
            b += 1


@dataclass(frozen=True)
class RankSlice:
    """Which part of each global micro-batch a rank reads: rows [rank * micro, (rank + 1) * micro)."""

    micro_batch_size: int
    rank: int
    world_size: int

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.world_size

    @property
    def rows(self) -> slice:
        return slice(self.rank * self.micro_batch_size, (self.rank + 1) * self.micro_batch_size)


def source_schedule(specs: list[Source], share: RankSlice, seed: int, start: tuple, shuffle: Shuffle, source: int,
                    chunk: int = 256):
    """A rank's sequence numbers of source `source`, one array per micro-batch, from the plan state `start`:
    what MixtureBatchSampler's batches take of it, computed `chunk` global micro-batches at a time (the plan
    gives the same stream however it is cut). Ends where the mixture runs out (every source capped)."""
    plan = MixturePlan(specs)
    plan.restore(start)
    order = shuffle.order(specs[source], seed)
    g, mine = share.global_batch, share.rows
    while True:
        snapshot = plan.snapshot()
        try:
            sources, positions, _ = plan.take(g * chunk)
        except MixtureError:  # runs out within this chunk: the batches before it, one at a time
            if chunk == 1:
                return
            plan.restore(snapshot)
            yield from source_schedule(specs, share, seed, snapshot, shuffle, source, 1)
            return
        picked = sources.reshape(chunk, g)[:, mine] == source
        indices = order.at(positions.reshape(chunk, g)[:, mine][picked])
        yield from np.split(indices, np.cumsum(picked.sum(axis=1))[:-1])


# ----------------------------------------------------------------------------------------------------
# The loader the training loop holds


@dataclass(frozen=True)
class Readers:
    """How a loader reads ahead: DataLoader worker processes (0: in the loop's process), the batches each
    prepares ahead, and pinned memory (CUDA)."""

    num_workers: int = 0
    prefetch_factor: int = 2
    pin_memory: bool = False


class ResumableLoader:
    """This rank's infinite stream of [micro_batch_size, seq_len] LongTensors, checkpointable.

    `data` is one SequenceSource (the source `data` alone: the stream and cursor of a `data_dir` run) or a
    list of opened Sources. The cursor counts sequences in batches *returned* by __next__ (DataLoader prefetch is
    not counted), so state_dict() after k batches resumes at batch k + 1. It counts global sequences, so a
    run may resume with another world size or micro-batch size. load_state_dict() is O(1): it only
    recreates the DataLoader iterator (one permutation per source, no batches read)."""

    def __init__(self, data, micro_batch_size: int, rank: int, world_size: int, seed: int,
                 readers: Readers = Readers(), log: Callable[[str], None] | None = None,
                 shuffle: Shuffle | None = None):
        sources = list(data) if isinstance(data, (list, tuple)) else [Source(DEFAULT_SOURCE, data=data)]
        if not sources or any(s.data is None or len(s.data) < 1 for s in sources):
            raise ValueError("ResumableLoader needs sources with at least one sequence")
        if len({s.name for s in sources}) != len(sources):
            raise MixtureError(f"data_mix: source names must be unique, got {[s.name for s in sources]}")
        self.specs = sources
        self.datasets = [s.data for s in sources]
        self.shuffle = shuffle or Shuffle()
        self._read_ahead = [(i, d) for i, d in enumerate(self.datasets) if isinstance(d, ReadAhead)]
        self._returned = -1  # the last micro-batch of the current iterator returned to the loop
        self._any_returned = False  # whether any batch was returned in this process (a rollback keeps it)
        self.dataset = self.datasets[0]
        self.micro_batch_size, self.rank, self.world_size, self.seed = micro_batch_size, rank, world_size, seed
        self.log = log or (lambda _msg: None)
        pin_memory = readers.pin_memory
        if pin_memory and not torch.cuda.is_available():
            warnings.warn("ResumableLoader(pin_memory=True) without CUDA: batches will not be pinned")
            pin_memory = False
        self.num_workers, self.prefetch_factor = readers.num_workers, readers.prefetch_factor
        self.pin_memory = pin_memory
        self.num_samples = sum(s.num_samples for s in self.specs)
        self.global_batch = micro_batch_size * world_size
        _check_sampling(self.num_samples, micro_batch_size, rank, world_size, seed)
        self._plan = MixturePlan(self.specs)  # the cursor: the plan's state after the batches returned
        self._iterator = None
        self._poisoned = debug.poisoned_sequences()  # empty but in the spike guard's tests
        self.wait_s = 0.0  # seconds the loop has waited on this loader: in __next__ and in unavailable()

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.specs]

    @property
    def single(self) -> bool:
        """The `data` source alone: a data_dir run, whose cursor keeps the engine's original format."""
        return self.names == [DEFAULT_SOURCE]

    @property
    def consumed(self) -> dict[str, int]:
        """Global sequences consumed from each source."""
        return dict(zip(self.names, self._plan.consumed))

    @property
    def position(self) -> int:
        return sum(self._plan.consumed)

    @property
    def epoch(self) -> int:
        """Passes over the whole mixture (its total sequence count): the checkpoint name's `epoch`."""
        return self.position // self.num_samples

    def files_consumed(self) -> int:
        """The checkpoint name's `files{F}`: whole files' worth of sequences consumed, summed over sources."""
        return sum(d.files_consumed(c) for d, c in zip(self.datasets, self._plan.consumed))

    def fingerprint(self) -> dict | None:
        """What the checkpoint's record keeps of the data: the `data` source's files (as a data_dir run
        always has), else None; the cursor checks every source itself on resume."""
        if DEFAULT_SOURCE not in self.names:
            return None
        return self.datasets[self.names.index(DEFAULT_SOURCE)].fingerprint()

    def source_tokens(self) -> dict[str, int]:
        """`tokens/<name>` for a training row: tokens each source has contributed (none for `data` alone)."""
        if self.single:
            return {}
        return {f"tokens/{s.name}": c * d.seq_len for s, d, c in zip(self.specs, self.datasets, self._plan.consumed)}

    def describe(self, steps_left: int, global_batch: int) -> list[str]:
        """One line per source: sequences, weight, and the epochs through it the planned steps reach. Raises
        MixtureError before training when the epochs caps cannot feed the planned steps."""
        live = [i for i, w in enumerate(self._plan.weights) if w > 0]
        if all(self.specs[i].cap is not None for i in live):
            left = sum(self.specs[i].cap - self._plan.consumed[i] for i in live)
            if left < steps_left * global_batch:
                raise MixtureError(
                    f"data_mix: the epochs caps leave {left:,} sequences but the {steps_left:,} planned steps "
                    f"need {steps_left * global_batch:,}; raise a source's epochs, add a source or lower max_steps")
        if self.single:
            return []
        lines, weights = [], self._plan.weights
        for spec, d, c, w in zip(self.specs, self.datasets, self._plan.consumed, weights):
            planned = c + w * steps_left * global_batch
            cap = f", capped at {spec.epochs} epoch(s)" if spec.epochs is not None else ""
            if spec.cap is not None:
                planned = min(planned, spec.cap)
            lines.append(f"  source {spec.name}: {spec.num_samples:,} sequences in {d.describe()}, weight "
                         f"{spec.weight:g} ({w:.1%} of the stream){cap}; the planned steps take {planned / spec.num_samples:.2f} "
                         f"epoch(s) through it")
        return lines

    def _handed_out(self, batch: int) -> None:
        for _, d in self._read_ahead:
            d.handed_out(batch)

    def _make_iterator(self):
        start = self._plan.snapshot()
        sampler = MixtureBatchSampler(self.specs, self.micro_batch_size, self.rank, self.world_size, self.seed,
                                      start, self.shuffle, self._handed_out if self._read_ahead else None)
        self._returned = -1
        for i, d in self._read_ahead:
            share = RankSlice(self.micro_batch_size, self.rank, self.world_size)
            d.read_from(source_schedule(self.specs, share, self.seed, start, self.shuffle, i))
        wire = self.dataset.wire_dtype
        if self.num_workers == 0:
            # Read here, without a DataLoader (its per-batch bookkeeping costs more than the read), in the
            # wire dtype: no per-row conversion buffer; __next__ widens the whole batch once.
            return ((read_picks(self.datasets, sources, indices, wire), meta) for sources, indices, meta in sampler)
        # batch_size=None: the sampler already yields whole micro-batches, each produced once in this
        # process and handed to one worker, which returns a ready [B, seq_len] array (no collate).
        # Sources that fetch ahead run threads in this process: a fork would copy a lock one of them holds mid-call
        # (an import's, a library's) into a worker, which could then wait on it forever. Their workers are spawned.
        loader = DataLoader(_BatchView(self.datasets, wire), sampler=sampler, batch_size=None,
                            collate_fn=_as_is, num_workers=self.num_workers, worker_init_fn=_ignore_stop_signals,
                            prefetch_factor=self.prefetch_factor, persistent_workers=False,
                            multiprocessing_context="spawn" if self._read_ahead else None)
        return iter(loader)

    def __iter__(self) -> "ResumableLoader":
        return self

    def __next__(self) -> torch.Tensor:
        started = time.perf_counter()
        try:
            return self._next()
        finally:
            self.wait_s += time.perf_counter() - started

    def _next(self) -> torch.Tensor:
        if self._iterator is None:
            self._iterator = self._make_iterator()
        failed = self._wait_ready(self._returned + 1)
        if failed:  # said in one line here, not from inside a DataLoader worker
            raise (BackgroundFailure if failed.startswith(THREAD_FAILED) else DataUnavailable)(failed)
        stop = signals.stop_requested() if self._read_ahead and not self._any_returned else None
        if stop:  # the wait for this session's first batch ended by a stop signal: nothing trained, nothing to save
            raise signals.StoppedInSetup(stop, "waiting for the data of the first step")
        array, (plan_state, dropped, number) = next(self._iterator)
        if self._poisoned:
            array = debug.poison(array, self.position + self.rank * self.micro_batch_size, self._poisoned)
        batch = torch.from_numpy(array.astype(np.int64, copy=False))
        if self.pin_memory:
            batch = batch.pin_memory()
        self._plan.restore(plan_state)
        self._returned = number
        self._any_returned = True
        for _, d in self._read_ahead:
            d.returned(number)
        for name in dropped:
            spec = self.specs[self.names.index(name)]
            now = ", ".join(f"{n} {w:.4g}" for n, w in zip(self.names, self._plan.weights) if w > 0)
            self.log(f"data_mix: source {name} reached its cap of {spec.epochs} epoch(s) after "
                     f"{self.position:,} sequences and drops out; the others are renormalised: {now}")
        return batch

    def unavailable(self, micro_batches: int) -> str | None:
        """Before a step of `micro_batches` micro-batches: waits until the files they read are here (sources that
        fetch ahead; at once for the others) and returns None, or the one line naming a file that stayed
        unavailable; the loop then stops with a checkpoint instead of starting a step it could not finish."""
        if not self._read_ahead:
            return None
        started = time.perf_counter()
        if self._iterator is None:
            self._iterator = self._make_iterator()
        try:
            return self._wait_ready(self._returned + micro_batches)
        finally:
            self.wait_s += time.perf_counter() - started

    def _wait_ready(self, last_batch: int) -> str | None:
        for _, d in self._read_ahead:
            failed = d.wait_ready(last_batch)
            if failed:
                return failed
        return None

    # ------------------------------------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        order = {"shuffle": self.shuffle.state()} if self.shuffle.state() else {}  # global: the original format
        if self.single:
            epoch, consumed = divmod(self.position, self.num_samples)
            return {"position": self.position, "epoch": epoch, "consumed_in_epoch": consumed,
                    "seed": self.seed, "num_samples": self.num_samples, "global_batch": self.global_batch, **order}
        plan = self._plan
        return {"format": "mixture", "seed": self.seed, "position": self.position, "seq_len": self.dataset.seq_len,
                **order,
                "global_batch": self.global_batch,
                "sources": {s.name: {"consumed": c, "num_samples": s.num_samples,
                                     "sha256": d.fingerprint()["sha256"]}
                            for s, d, c in zip(self.specs, self.datasets, plan.consumed)},
                "phase_start": dict(zip(self.names, plan.phase_start)),
                "phase_weights": dict(zip(self.names, plan.weights))}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved cursor (this format, or the single-source {"position", "num_samples",
        "seed", ...} of a data_dir run). The saved seed is adopted (each source keeps its order). A kept source
        must have the same sequences; new sources start at 0; a saved source this mixture lacks is dropped (at
        least one must be kept); different effective weights start a new phase (logged, drops included)."""
        seed, saved, phase = _parse_cursor(state)
        self._check_cursor(state, saved)
        self.close()
        self.seed = seed
        self._plan = self._restored_plan(saved, phase)

    def _check_cursor(self, state: dict, saved: dict) -> None:
        """A saved cursor this loader can continue: a source in common, the same order and seq_len, and each
        kept source's sequences unchanged."""
        if not any(n in saved for n in self.names):
            raise MixtureError(f"data_mix: none of the checkpoint's sources ({', '.join(saved)}) is in this run's "
                               f"mixture ({', '.join(self.names)}); keep at least one, or start a fresh run")
        saved_order = state.get("shuffle") or None
        if saved_order != self.shuffle.state():
            was = Shuffle(**saved_order) if saved_order else Shuffle()
            raise MixtureError(f"the checkpoint's data cursor follows {was.describe()} but this run asks for "
                               f"{self.shuffle.describe()}; resume with the checkpoint's order (--set "
                               f"shuffle={was.kind} --set shuffle_block_shards={was.block_files}) or start a fresh run")
        if state.get("seq_len") not in (None, self.dataset.seq_len):
            raise MixtureError(f"the checkpoint's data cursor was saved with seq_len={state['seq_len']} but this run "
                               f"has seq_len={self.dataset.seq_len}; resume with --set seq_len={state['seq_len']}")
        for spec, d in zip(self.specs, self.datasets):
            if spec.name not in saved:
                continue
            _, num_samples, sha = saved[spec.name]
            what = "its cursor" if self.single else f"source {spec.name}'s cursor"
            if num_samples != spec.num_samples or (sha is not None and sha != d.fingerprint()["sha256"]):
                raise MixtureError(
                    f"the data changed since the checkpoint: {what} was saved over {num_samples:,} sequences but "
                    f"{d.describe()} now has {spec.num_samples:,} (or other files). Restore the same shards and "
                    f"seq_len/max_files/val_files to resume, or start a fresh run")

    def _restored_plan(self, saved: dict, phase: tuple | None) -> MixturePlan:
        """The mixture's plan at the saved positions: the saved phase when the weights are unchanged, else a new
        phase from here (said in the log)."""
        plan = MixturePlan(self.specs)
        plan.consumed = [saved[n][0] if n in saved else 0 for n in self.names]
        weights = dict(zip(self.names, plan.effective_weights()))
        if phase is not None and set(phase[0]) == set(self.names) and phase[1] == weights:
            plan.phase_start = [phase[0][n] for n in self.names]
            plan.weights = [weights[n] for n in self.names]
            return plan
        plan.new_phase()
        if len(self.names) > 1 or len(saved) > 1:
            old = phase[1] if phase is not None else {n: 1.0 / len(saved) for n in saved}
            dropped = [n for n in saved if n not in self.names]
            note = ("; a dropped source's position is forgotten (added again later, it starts at its "
                    "beginning)" if dropped else "")
            self.log(f"data_mix: the mixture changed since the checkpoint ({describe_change(old, weights)}); "
                     f"each kept source continues from its saved position, the new weights apply from the "
                     f"next step{note}")
        return plan

    def skip_to(self, cursor: dict) -> int:
        """Moves the cursor forward to `cursor`, a state_dict() this loader gave further on in the same stream:
        the sequences between are never read (the spike guard's rollback skips them). O(1), as
        load_state_dict. Returns how many sequences of the global stream were skipped."""
        start = self.position
        if int(cursor["position"]) < start:
            raise ValueError(f"skip_to: cursor position {cursor['position']} is behind this loader's ({start}); "
                             f"a skip only moves forward")
        self.load_state_dict(cursor)
        return self.position - start

    def close(self) -> None:
        """Stop DataLoader workers (also done when the loader is garbage-collected) and fetching ahead."""
        for _, d in self._read_ahead:
            d.stop_reading()
        it, self._iterator = self._iterator, None
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()


def build_eval_batches(dataset: SequenceSource, micro_batch_size: int, rank: int, world_size: int,
                       max_batches: int) -> list[torch.Tensor]:
    """This rank's share of the first `max_batches` global batches of `dataset` in file order.

    Global batch b covers sequences [b * G, (b + 1) * G), G = micro_batch_size * world_size; rank r takes
    [b * G + r * micro, b * G + (r + 1) * micro). There are min(max_batches, ceil(N / G)) batches on every
    rank; a last, partial global batch wraps around to the first sequences so that all ranks run the same
    number of eval steps."""
    n = len(dataset)
    if n == 0 or max_batches < 1:
        return []
    g = micro_batch_size * world_size
    count = min(max_batches, -(-n // g))
    batches = []
    for b in range(count):
        first = b * g + rank * micro_batch_size
        indices = [(first + k) % n for k in range(micro_batch_size)]
        batches.append(torch.from_numpy(dataset.get_batch(indices)))
    return batches


class EvalBatches(list):
    """This rank's eval batches of every source with held-out files, one after another (what preflight
    reads), and per source in `by_source` (name -> its batches). `weights` are the mixture's weights,
    normalised over these sources, for the mean `val_loss`."""

    def __init__(self, by_source: dict[str, list[torch.Tensor]], weights: dict[str, float]):
        self.by_source = {name: batches for name, batches in by_source.items() if batches}
        super().__init__(b for batches in self.by_source.values() for b in batches)
        total = sum(weights[name] for name in self.by_source)
        self.weights = {name: (weights[name] / total if total > 0 else 1.0 / len(self.by_source))
                        for name in self.by_source}
        self.per_source = list(by_source) != [DEFAULT_SOURCE]

    def row(self, losses: dict[str, float]) -> dict[str, float]:
        """The eval row's fields: `val_loss` (the weight-averaged mean) and `val_loss/<name>` per source
        (none for the `data` source alone)."""
        mean = sum(self.weights[name] * loss for name, loss in losses.items())
        if len(losses) == 1:
            mean = next(iter(losses.values()))  # exactly the one source's loss
        return {"val_loss": mean, **({f"val_loss/{n}": v for n, v in losses.items()} if self.per_source else {})}


def _parse_cursor(state: dict) -> tuple[int, dict, tuple | None]:
    """A saved cursor -> (seed, {source: (consumed, num_samples, sha256 or None)}, the saved phase or None)."""
    try:
        seed = int(state["seed"])
        if "sources" in state:
            saved = {str(n): (int(v["consumed"]), int(v["num_samples"]), v.get("sha256"))
                     for n, v in state["sources"].items()}
            phase = ({n: int(c) for n, c in state["phase_start"].items()},
                     {n: float(w) for n, w in state["phase_weights"].items()})
        else:
            saved = {DEFAULT_SOURCE: (int(state["position"]), int(state["num_samples"]), None)}
            phase = None
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"data cursor state is malformed ({e!r}); expected the dict from "
                         "ResumableLoader.state_dict()") from None
    if seed < 0 or any(c < 0 for c, _, _ in saved.values()):
        raise ValueError(f"data cursor state has negative counts or seed={seed}; all must be >= 0")
    return seed, saved, phase
