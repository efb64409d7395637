"""The data-source seam: what the loader and the mixture need of a source of training sequences, one record
per source, and the registry of source types.

A `SequenceSource` is anything that reads fixed-length token sequences by number: its length, a batch of
sequences by their numbers, the compact dtype batches travel in, a fingerprint that identifies its
sequences (a resume checks it), how many whole files a count of sequences covers (the checkpoint name's
`files{F}`) and a description for log lines. The `.npz` shard folder (`TokenSequenceDataset`, its type
"shards" in utils/data/shard_source.py) is the default; the loader (utils/data/loader.py) and the mixture
(utils/data/mixture.py) depend on this protocol only.

A source that must fetch what it reads (a `gs://` dataset streamed into a bounded local cache) is also a
`ReadAhead`: the loader hands it this rank's schedule of reads, says which micro-batches it has handed to a
reader and which it has returned, and asks at each step boundary whether the next step's data is there. All
such sources share the run's `CacheBudget` (data_cache_gb): each reserves, when opened, what its order
reads at once, and one that does not fit is refused before training.

`Source` is the one record of a source: what the config says (name, weight, epochs cap, path or URL,
held-out files) and, once opened, its training sequences (`data`). A source type is a `SourceType`: whether
it handles a configured source, how to open it into (training, validation) sequences, and where its
dataset.json and tokenizer.json are on this machine. Adding one is a module that defines it plus its line in
utils/data/build.py's `SOURCE_TYPES`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Protocol, runtime_checkable

import numpy as np

from utils.errors import UserError
from utils.settings import Settings

DEFAULT_SOURCE = "data"  # the name `data_dir` alone has (its stream and cursor are the engine's original ones)


@runtime_checkable
class SequenceSource(Protocol):
    seq_len: int

    def __len__(self) -> int:
        """Sequences it holds."""

    def get_batch(self, indices, dtype=np.int64) -> np.ndarray:
        """Sequences `indices` as one [len(indices), seq_len] array of `dtype`."""

    @property
    def wire_dtype(self) -> np.dtype:
        """The smallest dtype that holds every id: what loader workers send to the training process."""

    def fingerprint(self) -> dict:
        """Identifies its sequences: at least {"sha256": ...}; a resume refuses a source whose fingerprint changed."""

    def files_consumed(self, position: int) -> int:
        """The checkpoint name's `files{F}` at stream `position` (sequences consumed, all epochs): whole
        files' worth (or units of the source's own) read, counting every epoch's files."""

    def describe(self) -> str:
        """Where it reads from, for log lines."""

    def file_sequences(self) -> np.ndarray:
        """Sequences in each of its files, in order (shuffle=blocks shuffles within blocks of files)."""


@runtime_checkable
class ReadAhead(Protocol):
    """A source that fetches its files before they are read. Micro-batches are numbered from 0 for each
    schedule; the loader calls these from the training process only."""

    def read_from(self, schedule: Iterator[np.ndarray]) -> None:
        """From now on this rank reads, micro-batch after micro-batch, the sequence numbers `schedule` yields
        (an empty array where a micro-batch takes none of this source): fetch ahead along it."""

    def handed_out(self, batch: int) -> None:
        """Micro-batch `batch` goes to a reader (this process or a DataLoader worker): keep its files."""

    def returned(self, batch: int) -> None:
        """Micro-batch `batch` reached the loop: files only it and earlier ones read may go."""

    def wait_ready(self, last_batch: int) -> str | None:
        """Wait until every file micro-batches up to `last_batch` read is here; None, or the one line saying
        which file stayed unavailable."""

    def stop_reading(self) -> None:
        """No more reads along this schedule: stop fetching (the files already here stay for the next one)."""


class DataUnavailable(UserError):
    """A file a source must fetch stayed unavailable (or failed its checks); the message names it."""


class CacheTooSmall(UserError):
    """The cache bound cannot hold what the chosen order reads at once."""


GB = 1e9


@dataclass
class CacheBudget:
    """Local disk this process's caching sources may fill: `data_cache_gb` (0: no bound) split evenly over
    the node's training processes. Each source reserves what its order reads at once when it is opened; needs
    beyond the bound are refused in one line. A source's share is its need scaled up by the room left over,
    so a larger bound lets every source fetch further ahead."""
    data_cache_gb: float = 0.0
    processes: int = 1
    needs: dict[str, tuple[int, str]] = field(default_factory=dict)  # name -> (bytes, what they are)

    @property
    def total_bytes(self) -> int | None:
        return int(self.data_cache_gb * GB / self.processes) if self.data_cache_gb else None

    def reserve(self, name: str, need: int, what: str) -> None:
        self.needs[name] = (need, what)
        total, needed = self.total_bytes, sum(b for b, _ in self.needs.values())
        if total is not None and needed > total:
            each = (f" ({total / GB:.3g} GB for each of this node's {self.processes} processes)"
                    if self.processes > 1 else "")
            raise CacheTooSmall(f"data_cache_gb={self.data_cache_gb:g}{each} cannot hold what the data order reads "
                                f"at once: {'; '.join(w for _, w in self.needs.values())}; raise data_cache_gb to at "
                                f"least {needed * self.processes / GB:.3g}, use shuffle=blocks with fewer "
                                f"shuffle_block_shards, or train from a downloaded copy (download_training_data.py)")

    def share(self, name: str) -> int | None:
        total = self.total_bytes
        if total is None:
            return None
        needed = sum(b for b, _ in self.needs.values())
        return total if needed == 0 else int(total * self.needs[name][0] / needed)


@dataclass(frozen=True)
class Source:
    """One source: as configured, and once opened (`data`)."""
    name: str
    weight: float = 1.0
    epochs: int | None = None  # cap on passes through it (None: unlimited)
    path: Path | str | None = None  # where the config says it is: a local folder, or a URL (gs://...)
    val_files: int = 0  # files held out for validation when it has no validation split of its own
    data: SequenceSource | None = None  # its training sequences, once opened

    @property
    def num_samples(self) -> int:
        return len(self.data)

    @property
    def cap(self) -> int | None:
        """Sequences this source may contribute in the whole run (None: unlimited)."""
        return None if self.epochs is None else self.epochs * self.num_samples


@dataclass(frozen=True)
class OpenRequest:
    """What opening a source needs to know of the run."""
    seq_len: int
    vocab_size: int
    max_files: int = -1
    build_demo: bool = False  # the demo preset: build its data into an empty data_dir
    log: Callable[[str], None] = print
    rank: int = 0
    shuffle: object = None  # the run's Shuffle (utils/data/mixture.py); None: global
    step_sequences: int = 1  # sequences one optimizer step takes, all ranks together
    cache_dir: str = ""  # data_cache_dir ("": the default, see utils/data/stream_source.py)
    cache: CacheBudget = field(default_factory=CacheBudget)


def described_in_place(source: Source, _cache_dir: str) -> Path:
    """A local source's dataset.json and tokenizer.json are in its own folder."""
    return Path(source.path)


@dataclass(frozen=True)
class SourceType:
    name: str
    handles: Callable[[Source], bool]
    open: Callable[[Source, OpenRequest], tuple[SequenceSource, SequenceSource | None]]  # (training, validation)
    # the local folder holding its dataset.json and tokenizer.json, given data_cache_dir (fetched there if need be)
    description_dir: Callable[[Source, str], Path] = described_in_place


def location(path: str) -> Path | str:
    """A configured data path: a URL (scheme://...) as written, else the local folder, resolved."""
    return path if "://" in path else Path(path).expanduser().resolve()


@dataclass(frozen=True)
class DataSettings(Settings):
    """What a run's data reads (utils/data/build.py builds it): the sources, how they are cut into batches and
    in what order, the cache of streamed data."""

    data_dir: str
    data_mix: dict
    max_files: int
    val_files: int
    demo_data: bool
    dataloader_num_workers: int
    prefetch_factor: int
    shuffle: str
    shuffle_block_shards: int
    data_cache_gb: float
    data_cache_dir: str
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    eval_batches: int
    seed: int
    eos_id: int


def configured_sources(settings: DataSettings) -> list[Source]:
    """`data_mix`'s sources in their order, or `data_dir` alone as the one source `data` (not opened)."""
    if not settings.data_mix:
        return [Source(DEFAULT_SOURCE, 1.0, None, location(settings.data_dir), settings.val_files)]
    return [Source(name, float(e["weight"]), e.get("epochs"), location(e["path"]),
                   e.get("val_files", settings.val_files)) for name, e in settings.data_mix.items()]
