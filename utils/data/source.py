"""The data-source seam: what the loader and the mixture need of a source of training sequences, one record
per source, and the registry of source types.

A `SequenceSource` is anything that reads fixed-length token sequences by number: its length, a batch of
sequences by their numbers, the compact dtype batches travel in, a fingerprint that identifies its
sequences (a resume checks it), how many whole files a count of sequences covers (the checkpoint name's
`files{F}`) and a description for log lines. The `.npz` shard folder (`TokenSequenceDataset`, its type
"shards" in utils/data/shard_source.py) is the default; the loader (utils/data/loader.py) and the mixture
(utils/data/mixture.py) depend on this protocol only.

`Source` is the one record of a source: what the config says (name, weight, epochs cap, path, held-out
files) and, once opened, its training sequences (`data`). A source type is a `SourceType`: whether it
handles a configured source, and how to open it into (training, validation) sequences. Adding one is a
module that defines it plus its line in utils/data/build.py's `SOURCE_TYPES`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol, runtime_checkable

import numpy as np

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


@dataclass(frozen=True)
class Source:
    """One source: as configured, and once opened (`data`)."""
    name: str
    weight: float = 1.0
    epochs: int | None = None  # cap on passes through it (None: unlimited)
    path: Path | None = None  # where the config says it is
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


@dataclass(frozen=True)
class SourceType:
    name: str
    handles: Callable[[Source], bool]
    open: Callable[[Source, OpenRequest], tuple[SequenceSource, SequenceSource | None]]  # (training, validation)


def sources_from_config(cfg) -> list[Source]:
    """`data_mix`'s sources in their order, or `data_dir` alone as the one source `data` (not opened)."""
    if not cfg.data_mix:
        return [Source(DEFAULT_SOURCE, 1.0, None, Path(cfg.data_dir).expanduser().resolve(), cfg.val_files)]
    return [Source(name, float(e["weight"]), e.get("epochs"), Path(e["path"]).expanduser().resolve(),
                   e.get("val_files", cfg.val_files)) for name, e in cfg.data_mix.items()]
