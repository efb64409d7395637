"""Weighted data mixtures: several shard folders (sources) read as one deterministic sequence stream.

The run's stream is global and decided per sequence, so it is the same for any world size, micro-batch
and accumulation: source i's m-th sequence since the phase began has the virtual time (m + 0.5) / w_i,
and the stream takes the sources' sequences in virtual-time order (a divisor sequence, as Sainte-Lague
seats parliaments; ties to the earlier source). Every source's count then stays within about a sequence
of its share at every position, so each global batch realises the weights to within a sequence or two;
computing it is a sort per micro-batch. Each source walks its own permutation, epoch after epoch: its own
position p is `perm(key, p // N)[p % N]`.

A phase begins at the start, on a resume whose effective weights differ from the checkpoint's, and when a
source reaches its `epochs` cap (it drops out, the others are renormalised). The state is per source:
sequences consumed, and consumed when the phase began, plus the phase's weights: O(1) to restore.

The source named `data` (what `data_dir` alone is) keeps the single-source order of the engine before
mixtures (`SeedSequence([seed, epoch])`), so a `data_dir` run's stream and cursor are unchanged; other
sources' orders are keyed by their name, so adding or reordering sources never changes another's order.

Within an epoch a source's order is its `Shuffle`: `global` (the default, the engine's order) permutes all its
sequences; `blocks` permutes its files, then shuffles the sequences within consecutive blocks of
`shuffle_block_shards` files (MosaicML streaming's block shuffle), so a stretch of steps reads a few files
rather than all of them: what a bounded cache of streamed shards needs (utils/data/stream_source.py). Either
way the order is a function of (seed, source, epoch) alone: world-size independent, O(1) to resume.
"""
from __future__ import annotations

import math
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from utils.data.source import DEFAULT_SOURCE, Source
from utils.errors import UserError



class MixtureError(UserError, ValueError):
    """A mixture that cannot be used or resumed as asked; the message names the source and what to do."""


def source_key(seed: int, name: str) -> list[int]:
    """The entropy of a source's permutations (the epoch is appended)."""
    return [seed] if name == DEFAULT_SOURCE else [seed, zlib.crc32(name.encode())]


def epoch_permutation(seed, epoch: int, n: int) -> np.ndarray:
    """The sample order of one epoch: a permutation of range(n) from numpy's PCG64 seeded by
    (seed, epoch); `seed` is an int or a source key (a list of ints)."""
    key = list(seed) if isinstance(seed, (list, tuple)) else [seed]
    perm = np.arange(n, dtype=np.int32 if n < 2**31 else np.int64)
    np.random.Generator(np.random.PCG64(np.random.SeedSequence(key + [epoch]))).shuffle(perm)
    return perm


def block_permutation(seed, epoch: int, file_sequences, block_files: int) -> np.ndarray:
    """The sample order of one epoch under shuffle=blocks: the files permuted by (seed, epoch), cut into
    consecutive blocks of `block_files` files, and the sequences of each block shuffled among themselves.
    `file_sequences[f]`: how many sequences file f holds (its sequences follow the earlier files')."""
    key = list(seed) if isinstance(seed, (list, tuple)) else [seed]
    sizes = np.asarray(file_sequences, dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(sizes)))
    n = int(starts[-1])
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(key + [epoch])))
    files = rng.permutation(len(sizes))
    perm = np.empty(n, dtype=np.int32 if n < 2**31 else np.int64)
    done = 0
    for first in range(0, len(files), block_files):
        block = np.concatenate([np.arange(starts[f], starts[f + 1]) for f in files[first:first + block_files]])
        rng.shuffle(block)
        perm[done:done + len(block)] = block
        done += len(block)
    return perm


SHUFFLES = ("global", "blocks")


@dataclass(frozen=True)
class Shuffle:
    """How each source orders its sequences within an epoch (the module docstring): `global` or `blocks` of
    `block_files` files."""
    kind: str = "global"
    block_files: int = 16

    def __post_init__(self):
        if self.kind not in SHUFFLES or self.block_files < 1:
            raise ValueError(f"shuffle must be one of {', '.join(SHUFFLES)} with at least one file per block, got "
                             f"{self.kind!r} with {self.block_files}")

    def describe(self) -> str:
        return "shuffle=global" if self.kind == "global" else f"shuffle=blocks of {self.block_files} shard(s)"

    def state(self) -> dict | None:
        """What a cursor records of the order (None for global: its cursor keeps the engine's original format)."""
        return None if self.kind == "global" else {"kind": self.kind, "block_files": self.block_files}

    def order(self, source: Source, seed: int) -> "EpochOrder":
        key = source_key(seed, source.name)
        if self.kind == "global":
            return EpochOrder(source.num_samples, key)
        sizes = source.data.file_sequences()
        return EpochOrder(source.num_samples, key,
                          lambda epoch: block_permutation(key, epoch, sizes, self.block_files))

    def files_at_once(self, file_sequences, step_sequences: int) -> int:
        """How many of a source's files a stretch of steps reads from, at most: every file under global; under
        blocks, two blocks (the one being read and the next) plus the files one step's sequences can span."""
        sizes = np.asarray(file_sequences, dtype=np.int64)
        if self.kind == "global" or not len(sizes):
            return len(sizes)
        return min(len(sizes), 2 * self.block_files + math.ceil(step_sequences / max(1, int(sizes.min()))))


class EpochOrder:
    """One source's own stream: position p -> sequence perm(p // n)[p % n], two epochs cached. `permute(epoch)`
    gives an epoch's order (default: the global `epoch_permutation` of the source's key)."""

    def __init__(self, num_samples: int, key: list[int], permute: Callable[[int], np.ndarray] | None = None):
        self.n, self.key = num_samples, key
        self.permute = permute or (lambda epoch: epoch_permutation(key, epoch, num_samples))
        self._perms: OrderedDict[int, np.ndarray] = OrderedDict()

    def perm(self, epoch: int) -> np.ndarray:
        perm = self._perms.get(epoch)
        if perm is None:
            perm = self._perms[epoch] = self.permute(epoch)
            while len(self._perms) > 2:
                self._perms.popitem(last=False)
        return perm

    def at(self, positions: np.ndarray) -> np.ndarray:
        """Sequence numbers at these stream positions (any order; usually one or two epochs)."""
        positions = np.asarray(positions, dtype=np.int64)
        out = np.empty(len(positions), dtype=np.int64)
        epochs, offsets = np.divmod(positions, self.n)
        for epoch in np.unique(epochs).tolist():
            mask = epochs == epoch
            out[mask] = self.perm(epoch)[offsets[mask]]
        return out


class MixturePlan:
    """The global stream's allocation: which source each next sequence comes from, and at which of its
    own positions. `take(n)` advances it; `snapshot()` / `restore()` are its whole state."""

    def __init__(self, sources: list[Source]):
        if not sources:
            raise MixtureError("data_mix has no source")
        self.sources = list(sources)
        self.consumed = [0] * len(sources)
        self.phase_start = [0] * len(sources)
        self.weights = self.effective_weights()

    def active(self, i: int) -> bool:
        s = self.sources[i]
        return s.weight > 0 and (s.cap is None or self.consumed[i] < s.cap)

    def effective_weights(self) -> list[float]:
        """The configured weights over the sources still active, normalised (0 for the others)."""
        raw = [s.weight if self.active(i) else 0.0 for i, s in enumerate(self.sources)]
        total = sum(raw)
        if total <= 0:
            capped = ", ".join(f"{s.name} ({s.epochs} epochs)" for s in self.sources if s.cap is not None)
            raise MixtureError(f"data_mix: every source with a positive weight has reached its epochs cap "
                               f"({capped}); raise `epochs` or add a source")
        return [w / total for w in raw]

    def new_phase(self) -> None:
        self.phase_start = list(self.consumed)
        self.weights = self.effective_weights()

    def _next_sources(self, live: list[int], n: int) -> np.ndarray:
        """The sources of the phase's next `n` sequences: source i's m-th sequence of the phase has the
        virtual time (m + 0.5) / w_i, and the stream takes them in time order (ties: the earlier source).
        Each source's next n times are candidates, so any chunking of the stream gives the same order."""
        times, owners = [], []
        for i in live:
            taken = self.consumed[i] - self.phase_start[i]
            times.append((taken + np.arange(n) + 0.5) / self.weights[i])
            owners.append(np.full(n, i, dtype=np.int64))
        times, owners = np.concatenate(times), np.concatenate(owners)
        return owners[np.lexsort((owners, times))[:n]]

    def take(self, n: int) -> tuple[np.ndarray, np.ndarray, list[str]]:
        """The next `n` sequences of the stream: (source numbers, their positions in each source's own
        stream, names of sources that reached their epochs cap within them)."""
        src = np.empty(n, dtype=np.int64)
        pos = np.empty(n, dtype=np.int64)
        dropped: list[str] = []
        k = 0
        while k < n:
            live = [i for i in range(len(self.sources)) if self.weights[i] > 0]
            picks = self._next_sources(live, n - k)
            for i in live:  # stop right after the sequence that fills a source's cap
                cap = self.sources[i].cap
                hits = np.flatnonzero(picks == i)
                if cap is not None and len(hits) >= cap - self.consumed[i]:
                    picks = picks[:hits[cap - self.consumed[i] - 1] + 1]
            chunk = slice(k, k + len(picks))
            src[chunk] = picks
            for i in live:
                mine = picks == i
                count = int(mine.sum())
                pos[chunk][mine] = np.arange(self.consumed[i], self.consumed[i] + count)
                self.consumed[i] += count
            k += len(picks)
            for i in live:
                if not self.active(i):
                    dropped.append(self.sources[i].name)
                    self.new_phase()  # raises when nothing is left to read
        return src, pos, dropped

    def snapshot(self) -> tuple:
        return tuple(self.consumed), tuple(self.phase_start), tuple(self.weights)

    def restore(self, snapshot: tuple) -> None:
        consumed, phase_start, weights = snapshot
        self.consumed, self.phase_start, self.weights = list(consumed), list(phase_start), list(weights)


def describe_change(old_weights: dict, new_weights: dict) -> str:
    """'web 0.75 -> 0.25, code 0.25 -> 0.75, added books 0.2, dropped news': the effective weights that
    changed."""
    parts = []
    for name, w in new_weights.items():
        if name not in old_weights:
            parts.append(f"added {name} {w:.4g}")
        elif abs(old_weights[name] - w) > 0:
            parts.append(f"{name} {old_weights[name]:.4g} -> {w:.4g}")
    parts += [f"dropped {name}" for name in old_weights if name not in new_weights]
    return ", ".join(parts)


def check_sources(sources: list[Source], infos: dict, warn: Callable[[str], None],
                  demo_data: bool = False) -> None:
    """Before a mixture is indexed: every local source's folder holds shards (the demo's data is built for a
    `data_dir` run only, never into a source), and its tokenizer is the others' (see check_tokenizers). A
    remote source (a URL) is checked by its type when opened."""
    for s in sources:
        if not isinstance(s.path, Path):
            continue
        missing = "does not exist" if not s.path.is_dir() else (
            "holds no .npz shards" if not any(s.path.rglob("*.npz")) else None)
        if missing:
            demo = " (the demo builds its data into data_dir only, never into a data_mix source)" if demo_data else ""
            raise MixtureError(f"data_mix source {s.name}: {s.path} {missing}{demo}; prepare or download its shards "
                               f"there (prepare_data.py, download_training_data.py), fix its path, or remove the "
                               f"source from data_mix (on a resume, the log then says it was dropped)")
    check_tokenizers(infos, warn)


def check_tokenizers(infos: dict, warn: Callable[[str], None]) -> None:
    """`infos`: source name -> its DatasetInfo or None. Every dataset.json present must name the same
    tokenizer: the same vocabulary and EOS id, and the same tokenizer file (its sha256), else one line naming
    both files. A source without a dataset.json cannot be checked: `warn` says so once, naming it."""
    present = [(name, info) for name, info in infos.items() if info is not None]
    if not present:
        return
    first_name, first = present[0]
    for name, info in present[1:]:
        if (info.vocab_size, info.eos_id) != (first.vocab_size, first.eos_id):
            raise MixtureError(
                f"data_mix: sources {first_name} and {name} have different tokenizers ({first.path}: vocab "
                f"{first.vocab_size}, eos {first.eos_id}; {info.path}: vocab {info.vocab_size}, eos "
                f"{info.eos_id}); prepare every source with the same tokenizer")
        digests = (first.tokenizer_sha256, info.tokenizer_sha256)
        if None not in digests and digests[0] != digests[1]:
            raise MixtureError(
                f"data_mix: sources {first_name} and {name} were prepared with different tokenizers of the same "
                f"size ({first.path}: tokenizer sha256 {digests[0][:12]}...; {info.path}: "
                f"{digests[1][:12]}...): the same ids mean different text; prepare every source with "
                f"the same tokenizer")
    unchecked = [name for name, info in infos.items() if info is None]
    if unchecked:
        warn(f"warning: data_mix source(s) {', '.join(unchecked)} have no dataset.json, so their tokenizer cannot be "
             f"checked against {first_name}'s ({first.path}); prepare them with prepare_data.py and the same "
             f"tokenizer, or make sure their ids are that tokenizer's")
