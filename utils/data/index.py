"""The validated shard index: every `*.npz` under a data directory, ordered, checked once, cached.

`ShardIndex.build(data_dir, seq_len, vocab_size)` finds every `*.npz` under `data_dir` (recursively, each
real folder once, sorted by relative posix path; hidden files and folders are ignored, and counted; a
folder with a dataset.json holds exactly the shards it lists), checks each against the shard format
(utils/data/shards.py) and records how many `seq_len` sequences it holds. A shard a dataset.json lists must
also have the size and crc32c it lists: the size at every build (a stat), the crc32c when the file is first
scanned (the scan reads it whole anyway; the checksum runs over the pages just read, so a TB of data is not
read twice) and from the cache after that. The id scan is done once per file: results (the crc32c too) are
cached in `data_dir/.shard_index.json`, keyed by relative path, size and mtime, and reused while the file is
unchanged. Any bad file stops the build with a `ShardError` naming the file and the rule.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from utils.io import files
from utils.io.storage import file_crc32c
from utils.errors import NotAFileError, UserError
from utils.data.dataset_info import FILE as DATASET_FILE
from utils.data.dataset_info import DatasetInfo
from utils.data.shards import ShardError, ShardInfo, ShardLayout, check_header, check_vocab, inspect_shard, shard_error

CACHE_NAME = ".shard_index.json"
CACHE_VERSION = 1


class DataDirError(UserError, ValueError):
    """The data directory is missing, holds no shards, or cannot be split as asked."""


# ----------------------------------------------------------------------------------------------------
# The validation cache


def _load_cache(path: Path, log: Callable) -> dict:
    try:
        raw = json.loads(path.read_text())
        if raw.get("version") != CACHE_VERSION or not isinstance(raw.get("files"), dict):
            raise ValueError("unknown layout")
        return raw["files"]
    except FileNotFoundError:
        return {}
    except Exception as e:  # a corrupt cache costs one re-scan, never a failed start
        log(f"data: ignoring unreadable shard cache {path} ({e}); shards will be re-validated")
        return {}


def _layout_from_cache(entry, size: int, mtime_ns: int) -> ShardLayout | None:
    try:
        if entry["size"] != size or entry["mtime_ns"] != mtime_ns:
            return None
        layout = ShardLayout(bool(entry["compressed"]), int(entry["data_offset"]), str(entry["descr"]),
                         tuple(int(s) for s in entry["shape"]), bool(entry["fortran_order"]),
                         int(entry["min_id"]), int(entry["max_id"]))
        np.dtype(layout.descr)
        return layout
    except Exception:
        return None


def _write_cache(path: Path, entries: dict, log: Callable) -> None:
    try:
        files.write_text(path, json.dumps({"version": CACHE_VERSION, "files": entries}, sort_keys=True))
    except OSError as e:
        log(f"data: could not write shard cache {path} ({e}); shards will be re-validated next start")


# ----------------------------------------------------------------------------------------------------
# The index


@dataclass(frozen=True)
class Listed:
    """What a dataset.json says of one of its shards: its size and crc32c ("" where it gives none)."""
    description: Path
    bytes: int
    crc32c: str


@dataclass
class FoundShards:
    """What a walk of a data directory found: `files` to index, those `hidden` (they or a folder above them
    hidden), `notes` on what dataset.json files decided, and what they list of each file (`listed`)."""
    files: list[str] = field(default_factory=list)
    hidden: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    listed: dict[str, Listed] = field(default_factory=dict)


def _find_shards(root: Path) -> FoundShards:
    """The `.npz` files under root, each real folder walked once (files.walk_once: a symlink loop adds
    nothing).

    Hidden names are never data: a killed prepare_data's `.NAME.partial-*` output, editors' and sync
    tools' files, this module's own cache. A folder holding a dataset.json holds exactly the shards it
    lists: its other `.npz` files and sub-folders are not indexed. At the root both of its splits are
    indexed (train.py splits them by dataset.json); a dataset nested deeper adds its training shards only,
    so its validation split never becomes training data."""
    found = FoundShards()
    for dirpath, dirnames, filenames in files.walk_once(root):
        rel_dir = Path(dirpath).relative_to(root)
        if DATASET_FILE in filenames:
            _add_listed(found, root, rel_dir)
            dirnames[:] = []
            continue
        in_hidden = any(part.startswith(".") for part in rel_dir.parts)
        for name in filenames:
            if name.endswith(".npz") or (files.is_temp_name(name) and ".npz" in name):
                rel = (rel_dir / name).as_posix()
                (found.hidden if in_hidden or name.startswith(".") else found.files).append(rel)
    found.files.sort()
    found.hidden.sort()
    return found


def _add_listed(found: FoundShards, root: Path, rel_dir: Path) -> None:
    """The shards a dataset.json in root/rel_dir lists (see _find_shards) that are there: a partial download
    (`--max-files`) holds the first ones; a missing validation shard is ShardIndex.split_paths' error."""
    folder = root / rel_dir
    info = DatasetInfo.load(folder)
    nested = rel_dir != Path(".")
    listed = info.train_paths + ([] if nested else info.val_paths)
    present = [rel for rel in listed if (folder / rel).exists()]  # a FIFO listed: refused by _layouts
    found.files += [(rel_dir / rel).as_posix() for rel in present]
    for entry in (*info.shards, *(info.raw.get("validation") or {}).get("shards", [])):
        found.listed[(rel_dir / entry["path"]).as_posix()] = Listed(info.path, entry["bytes"], entry.get("crc32c", ""))
    absent = [rel for rel in info.train_paths if rel not in present]
    if absent:
        found.notes.append(f"data: {len(absent)} of the {len(info.train_paths)} training shards {info.path} lists "
                           f"are not in {folder} (e.g. {absent[0]}; a partial download?); the others are used")
    if nested and info.val_paths:
        found.notes.append(f"data: {rel_dir.as_posix()}/ holds its own {DATASET_FILE}: its {len(info.train_paths)} "
                           f"training shard(s) are used, its validation split ({len(info.val_paths)} shard(s)) is not")
    named = set(info.train_paths) | set(info.val_paths)
    unlisted = sorted(rel for rel in (Path(d, name).relative_to(folder).as_posix()
                                      for d, _, names in files.walk_once(folder) for name in names
                                      if name.endswith(".npz") and not name.startswith("."))
                      if rel not in named)
    if unlisted:
        found.notes.append(f"data: {len(unlisted)} .npz file(s) under {folder} are not listed in its {DATASET_FILE} "
                           f"and are not used (e.g. {unlisted[0]})")


class ShardIndex:
    """The validated, ordered list of shards under one directory and their sequence counts."""

    def __init__(self, root: Path, seq_len: int, vocab_size: int, shards: list[ShardInfo],
                 layouts: dict[str, ShardLayout]):
        self.root = Path(root)
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.shards = list(shards)
        self.layouts = {s.path: layouts[s.path] for s in self.shards}
        self.cumulative = np.cumsum([s.num_sequences for s in self.shards], dtype=np.int64)

    @classmethod
    def build(cls, data_dir, seq_len: int, vocab_size: int, max_files: int = -1, log=print) -> "ShardIndex":
        """Find, order and validate the shards under `data_dir`; raise before training on any bad one.

        Files whose size and mtime match the cache are not re-read; the vocabulary bound is checked
        from the cached min/max ids, so changing vocab_size or seq_len never needs a re-scan."""
        if seq_len < 1 or vocab_size < 1:
            raise ValueError(f"seq_len={seq_len} and vocab_size={vocab_size} must be positive")
        root = Path(data_dir)
        found = _find_shards(root) if root.is_dir() else FoundShards()
        all_files, hidden = found.files, found.hidden
        if hidden:
            log(f"data: ignoring {len(hidden)} .npz file(s) under hidden names in {root} (e.g. {hidden[0]}: "
                f"names starting with '.', such as a killed prepare_data's .NAME.partial-* folder)")
        for note in found.notes:
            log(note)
        files = _select(root, all_files, max_files)
        layouts, errors = _layouts(root, files, all_files, seq_len, log, found.listed)
        shards = []
        for rel in files:
            if rel in errors:
                continue
            layout = layouts[rel]
            try:  # header rules again: seq_len may differ from the run that filled the cache
                kind, count = check_header((root / rel).as_posix(), layout.shape, layout.dtype, seq_len)
                check_vocab((root / rel).as_posix(), layout, vocab_size)
            except ShardError as e:
                errors[rel] = e
                continue
            shards.append(ShardInfo(rel, kind, int(np.prod(layout.shape)), count, layout.dtype.name))
        _raise_for(errors, files, root)
        compressed = [s.path for s in shards if layouts[s.path].compressed]
        if compressed:
            log(f"data: {len(compressed)} of {len(shards)} shards are compressed (np.savez_compressed, e.g. "
                f"{compressed[0]}); they are decompressed whole into a per-process cache, which is much slower "
                "under a global shuffle than uncompressed np.savez shards, which are read in place")
        index = cls(root, seq_len, vocab_size, shards, layouts)
        log(f"data: {len(shards)} shard file(s) in {root}, {index.num_sequences:,} sequences of {seq_len} tokens")
        return index

    @property
    def num_sequences(self) -> int:
        return int(self.cumulative[-1]) if len(self.cumulative) else 0

    @property
    def num_tokens(self) -> int:
        return self.num_sequences * self.seq_len

    def __len__(self) -> int:
        return len(self.shards)

    def split(self, val_files: int) -> tuple["ShardIndex", "ShardIndex"]:
        """(train, val) by file: the last `val_files` files in sorted order are validation."""
        if val_files < 0:
            raise ValueError(f"val_files={val_files} must not be negative")
        if val_files >= len(self.shards):
            raise DataDirError(
                f"{self.root}: val_files={val_files} leaves no training file ({len(self.shards)} shard file(s) "
                "selected); lower val_files (--set val_files=N, 0 disables validation), raise max_files, "
                "or add shards")
        cut = len(self.shards) - val_files
        return self._part(self.shards[:cut]), self._part(self.shards[cut:])

    def split_paths(self, val_paths, max_files: int = -1) -> tuple["ShardIndex", "ShardIndex"]:
        """(train, val) by name: the files in `val_paths` (dataset.json's validation split) are validation,
        the others training, of which `max_files` (-1: all) are kept."""
        val_paths = list(val_paths)
        missing = sorted(set(val_paths) - {s.path for s in self.shards})
        if missing:
            raise DataDirError(f"{self.root}: the validation shard {missing[0]} listed in dataset.json is missing "
                               f"({len(missing)} in all); download or prepare the data again")
        chosen = set(val_paths)
        train = [s for s in self.shards if s.path not in chosen]
        train = train if max_files < 0 else train[:max_files]
        if not train:
            raise DataDirError(f"{self.root}: no training shard besides the validation split in dataset.json")
        return self._part(train), self._part([s for s in self.shards if s.path in chosen])

    def _part(self, shards) -> "ShardIndex":
        """An index over some of this one's shards."""
        return ShardIndex(self.root, self.seq_len, self.vocab_size, shards, self.layouts)

    def fingerprint(self) -> dict:
        """What a checkpoint stores to notice, on resume, that the data is not what it was."""
        h = hashlib.sha256()
        for s in self.shards:
            h.update(f"{s.path}\t{s.num_sequences}\n".encode())
        return {"num_files": len(self.shards), "num_sequences": self.num_sequences,
                "seq_len": self.seq_len, "sha256": h.hexdigest()[:16]}

    def files_consumed(self, position: int) -> int:
        """The `files{F}` of a checkpoint name at stream `position` (global samples consumed).

        F = epoch * num_files + the number of whole files' worth of sequences that fit in the samples
        consumed so far in this epoch, counting files by their sequence counts in sorted order. With a
        global shuffle this is "files' worth of data consumed", not "these particular files were read"."""
        n = self.num_sequences
        if n == 0:
            return 0
        epoch, consumed = divmod(int(position), n)
        return epoch * len(self.shards) + int(np.searchsorted(self.cumulative, consumed, side="right"))


def _select(root: Path, all_files: list[str], max_files: int) -> list[str]:
    advice = (f"make shards from your text with `python prepare_data.py --input CORPUS --tokenizer TOKENIZER "
              f"--output {root}`, download them with `python download_training_data.py --source gs://BUCKET/PREFIX "
              f"--dest {root}`, or point --data-dir at a folder of .npz shards")
    if not root.is_dir():
        raise DataDirError(f"data directory {root} does not exist; {advice}")
    if not all_files:
        raise DataDirError(f"data directory {root} holds no .npz shards; {advice}")
    files = all_files if max_files is None or max_files < 0 else all_files[:max_files]
    if not files:
        raise DataDirError(f"max_files={max_files} selects no shard in {root}; use -1 for all or a positive count")
    return files


def _not_listed(path: Path, what: str, found, listed: Listed) -> ShardError:
    return shard_error(path.as_posix(), f"has {what} {found}, but {listed.description} lists {getattr(listed, what)}",
                       "it is not the shard prepare_data.py wrote (corrupt, or replaced): download it again "
                       "(download_training_data.py verifies each file) or prepare the data again")


def _layouts(root: Path, chosen: list[str], all_files: list[str], seq_len: int, log: Callable,
             listed: dict[str, Listed]):
    """Each file's layout, from the cache while the file is unchanged, else scanned (and cached), and its size
    and crc32c checked against its dataset.json's `listed` entry: (layouts, errors) keyed by relative path."""
    cache_path = root / CACHE_NAME
    cache = _load_cache(cache_path, log)
    layouts: dict[str, ShardLayout] = {}
    errors: dict[str, ShardError] = {}
    to_scan: list[tuple[str, int, int, str]] = []
    for rel in chosen:
        try:
            st = files.regular_file(root / rel)  # a FIFO named like a shard is refused here, never opened
        except NotAFileError as e:
            errors[rel] = ShardError(str(e))
            continue
        except OSError as e:  # e.g. a dangling symlink
            errors[rel] = shard_error((root / rel).as_posix(), f"cannot be read ({e})", "fix or remove the file")
            continue
        expected = listed.get(rel)
        if expected is not None and st.st_size != expected.bytes:
            errors[rel] = _not_listed(root / rel, "bytes", st.st_size, expected)
            continue
        want_crc = expected.crc32c if expected is not None else ""
        layout = _layout_from_cache(cache.get(rel), st.st_size, st.st_mtime_ns)
        known_crc = cache[rel].get("crc32c") if layout is not None else None
        if layout is not None and (not want_crc or known_crc is not None):
            layouts[rel] = layout
            if want_crc and known_crc != want_crc:
                errors[rel] = _not_listed(root / rel, "crc32c", known_crc, expected)
        else:
            to_scan.append((rel, st.st_size, st.st_mtime_ns, want_crc))
    if not to_scan:
        return layouts, errors
    t0 = time.perf_counter()
    total = sum(item[1] for item in to_scan)
    log(f"data: validating {len(to_scan)} shard file(s), {total / 1e9:.2f} GB, in {root} "
        f"(once; results cached in {CACHE_NAME})")
    for (rel, size, mtime_ns, want_crc), result in zip(to_scan, _scan_all(root, to_scan, seq_len, log)):
        if isinstance(result, ShardError):
            errors[rel] = result
            continue
        result, crc = result
        layouts[rel] = result
        cache[rel] = {"size": size, "mtime_ns": mtime_ns, "compressed": result.compressed,
                      "data_offset": result.data_offset, "descr": result.descr, "shape": list(result.shape),
                      "fortran_order": result.fortran_order, "min_id": result.min_id, "max_id": result.max_id}
        if crc is not None:
            cache[rel]["crc32c"] = crc
            if crc != want_crc:
                errors[rel] = _not_listed(root / rel, "crc32c", crc, listed[rel])
    existing = set(all_files)
    _write_cache(cache_path, {k: v for k, v in cache.items() if k in existing}, log)
    log(f"data: checked {len(to_scan)} file(s) in {time.perf_counter() - t0:.1f} s")
    return layouts, errors


def _raise_for(errors: dict, files: list[str], root: Path) -> None:
    """One bad file: its own error. Several: one error listing (the first ten of) them."""
    if len(errors) == 1:
        raise next(iter(errors.values()))
    if errors:
        bad = [str(errors[rel]) for rel in files if rel in errors]
        more = f"\n  ... and {len(bad) - 10} more" if len(bad) > 10 else ""
        raise ShardError(f"{len(bad)} shard files in {root} break the shard format (training has not "
                         "started):\n  " + "\n  ".join(bad[:10]) + more)


def _scan_all(root: Path, to_scan, seq_len: int, log: Callable) -> list:
    """Inspect files on a few threads (reads, crc32 and min/max release the GIL), each (layout, its crc32c
    where a dataset.json lists one, else None) or a ShardError; keeps input order."""
    def one(item):
        path = root / item[0]
        try:
            layout = inspect_shard(path, path.as_posix(), seq_len)
            return layout, file_crc32c(path) if item[3] else None  # the file's pages are still in memory
        except ShardError as e:
            return e
        except OSError as e:  # gone or unreadable between the scan and the checksum
            return shard_error(path.as_posix(), f"cannot be read ({e})", "check the file's permissions and the disk")

    workers = max(1, min(8, os.cpu_count() or 1, len(to_scan)))
    results, last_log = [], time.monotonic()
    with ThreadPoolExecutor(workers) as pool:
        for i, r in enumerate(pool.map(one, to_scan), 1):
            results.append(r)
            if time.monotonic() - last_log > 10:
                log(f"data: validated {i}/{len(to_scan)} file(s)")
                last_log = time.monotonic()
    return results
