"""Tokenized `.npz` shards -> a validated shard index -> a resumable, rank-sharded batch stream.

Pieces, in the order the training loop meets them:

- `ShardIndex.build(data_dir, seq_len, vocab_size)` finds every `*.npz` under `data_dir` (recursively,
  sorted by relative posix path), checks each against the shard format (see DESIGN.md) and records how
  many `seq_len` sequences it holds. The id scan is done once per file: results are cached in
  `data_dir/.shard_index.json`, keyed by relative path, size and mtime, and reused while the file is
  unchanged. Any bad file stops the build with a `ShardError` naming the file and the rule.
- `TokenSequenceDataset(index)` maps a global sequence number to `seq_len` token ids. Uncompressed
  members are read in place at their offset inside the zip (positional reads, nothing loaded whole);
  compressed ones are decompressed whole, one shard at a time, into a small per-process LRU cache.
- `ResumableLoader` yields `[micro_batch_size, seq_len]` int64 batches forever. Its whole state is one
  integer, `position`: the number of global samples consumed (see `ShardedBatchSampler` for the order).
- `build_eval_batches` gives each rank its share of the first validation batches, in file order.

Shard layout accepted: key `input_ids`, dtype uint16/int32/uint32/int64, either 1-D (a token stream, cut
into non-overlapping `seq_len` chunks, the tail shorter than `seq_len` dropped) or 2-D `[rows, length]`
with `length >= seq_len` (each row is one sequence; rows longer than `seq_len` are truncated to their first
`seq_len` tokens). Pickle is never used: object arrays are rejected from the npy header alone.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import struct
import threading
import time
import warnings
import zipfile
import zlib
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

ALLOWED_DTYPES = ("uint16", "int32", "uint32", "int64")
INPUT_KEY = "input_ids"
CACHE_NAME = ".shard_index.json"
CACHE_VERSION = 1
# Shard files kept open per process (least recently used closed first): well under the usual 1024 limit.
MAX_OPEN_FILES = 128
# Decompressed shards kept per process (workers included); at least one shard is always kept.
COMPRESSED_CACHE_BYTES = 512 << 20
_SCAN_CHUNK_BYTES = 16 << 20
_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # zip local file header, 30 bytes
_LOCAL_HEADER_SIG = b"PK\x03\x04"


class ShardError(ValueError):
    """A shard breaks the shard format. The message reads `<path>: <rule broken>; <what to do>`."""


class DataDirError(ValueError):
    """The data directory is missing, holds no shards, or cannot be split as asked."""


@dataclass(frozen=True)
class ShardInfo:
    path: str  # relative to the index root, posix separators
    kind: str  # "stream" (1-D) or "rows" (2-D)
    num_tokens: int  # ids stored in the file (before cutting / truncation)
    num_sequences: int  # seq_len sequences this file contributes
    dtype: str


@dataclass(frozen=True)
class _Layout:
    """Where a shard's array lives: enough to memory-map it without re-reading the zip directory."""

    compressed: bool
    data_offset: int  # byte offset of the array data in the file (stored members only)
    descr: str  # numpy dtype descr, e.g. "<u2"
    shape: tuple
    fortran_order: bool
    min_id: int
    max_id: int

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.descr)


# ----------------------------------------------------------------------------------------------------
# Reading and checking one shard


def _fail(name: str, rule: str, advice: str) -> ShardError:
    return ShardError(f"{name}: {rule}; {advice}")


def _read_npy_header(fp, name: str) -> tuple[tuple, bool, np.dtype]:
    fmt = np.lib.format
    try:
        version = fmt.read_magic(fp)
        if version == (1, 0):
            shape, fortran, dtype = fmt.read_array_header_1_0(fp)
        elif version == (2, 0):
            shape, fortran, dtype = fmt.read_array_header_2_0(fp)
        else:  # 3.0 (utf-8 field names) has no public reader
            shape, fortran, dtype = fmt._read_array_header(fp, version)
    except Exception as e:  # numpy raises ValueError/EOFError/SyntaxError on a bad header
        raise _fail(name, f"'{INPUT_KEY}' is not a readable .npy array ({e})",
                    "regenerate the shard with np.savez(path, input_ids=array)") from None
    return shape, fortran, dtype


def _check_header(name: str, shape: tuple, dtype: np.dtype, seq_len: int) -> tuple[str, int]:
    """Format rules visible from the header alone -> (kind, num_sequences)."""
    if dtype.hasobject:
        raise _fail(name, f"'{INPUT_KEY}' is an object array (dtype={dtype}), which only pickle can load "
                         "and pickle is never used", f"save token ids as an integer array ({', '.join(ALLOWED_DTYPES)})")
    if dtype.kind not in "iu" or dtype.name not in ALLOWED_DTYPES:
        raise _fail(name, f"'{INPUT_KEY}' has dtype {dtype} which is not allowed",
                    f"convert it to one of {', '.join(ALLOWED_DTYPES)} (uint16 fits vocabularies up to 65536)")
    if len(shape) == 1:
        kind, count = "stream", shape[0] // seq_len
        size_note = f"a 1-D stream of {shape[0]} tokens"
    elif len(shape) == 2:
        if shape[1] < seq_len:
            raise _fail(name, f"2-D '{INPUT_KEY}' rows hold {shape[1]} tokens but seq_len is {seq_len}; rows "
                             "must be at least seq_len long (longer rows are truncated to seq_len)",
                        "re-cut the data with rows of seq_len tokens, save it as a 1-D token stream, "
                        "or lower seq_len")
        kind, count = "rows", shape[0]
        size_note = f"{shape[0]} rows"
    else:
        raise _fail(name, f"'{INPUT_KEY}' is {len(shape)}-D (shape {tuple(shape)}); it must be 1-D (a token "
                         "stream) or 2-D [rows, seq_len]", "reshape it before saving")
    if count == 0:
        raise _fail(name, f"holds 0 sequences of seq_len={seq_len} ({size_note})",
                    "remove the empty shard or merge it into another one")
    return kind, count


def _local_data_start(fh, info: zipfile.ZipInfo, name: str) -> int:
    """Offset of a member's bytes: after its local header (whose extra field may differ from the
    central directory's, so it is read from the local header itself)."""
    fh.seek(info.header_offset)
    raw = fh.read(_LOCAL_HEADER.size)
    if len(raw) != _LOCAL_HEADER.size or raw[:4] != _LOCAL_HEADER_SIG:
        raise _fail(name, "is not a readable .npz (zip) archive (bad local header)",
                    "re-download or regenerate the shard")
    fields = _LOCAL_HEADER.unpack(raw)
    name_len, extra_len = fields[9], fields[10]
    return info.header_offset + _LOCAL_HEADER.size + name_len + extra_len


def _scan_ids(fp, dtype: np.dtype, count: int, name: str, crc: int | None = None) -> tuple[int, int, int]:
    """Read `count` items of `dtype` from `fp` in chunks -> (min id, max id, running crc32).

    Chunked reads into one buffer (no mmap) so validating a big shard does not grow the resident set."""
    itemsize = dtype.itemsize
    chunk_items = max(1, _SCAN_CHUNK_BYTES // itemsize)
    buf = np.empty(min(count, chunk_items), dtype=dtype)
    view = memoryview(buf).cast("B")
    lo, hi, left = None, None, count
    running = crc if crc is not None else 0
    while left:
        n = min(left, chunk_items)
        want = n * itemsize
        got = 0
        while got < want:
            r = fp.readinto(view[got:want])
            if not r:
                raise _fail(name, f"is truncated: '{INPUT_KEY}' ends after {count - left} of {count} items "
                                 f"plus {got} bytes", "re-download or regenerate the shard")
            got += r
        if crc is not None:
            running = zlib.crc32(view[:want], running)
        part = buf[:n]
        a, b = int(part.min()), int(part.max())
        lo = a if lo is None else min(lo, a)
        hi = b if hi is None else max(hi, b)
        left -= n
    return lo, hi, running


def _inspect_shard(path: Path, name: str, seq_len: int) -> _Layout:
    """Open one shard, check every format rule except the vocabulary bound, scan its ids (min/max)
    and, for stored members, verify the zip crc32. Raises ShardError."""
    try:
        with open(path, "rb") as fh:
            try:
                zf = zipfile.ZipFile(fh)
            except (zipfile.BadZipFile, EOFError, OSError) as e:
                raise _fail(name, f"is not a readable .npz (zip) archive ({e})",
                            "it may be truncated or not an npz at all: re-download it "
                            "(download_training_data.py verifies size and crc32c) or regenerate it") from None
            with zf:
                member = INPUT_KEY + ".npy"
                try:
                    info = zf.getinfo(member)
                except KeyError:
                    found = ", ".join(sorted(n.removesuffix(".npy") for n in zf.namelist())) or "nothing"
                    raise _fail(name, f"has no '{INPUT_KEY}' array (found: {found})",
                                f"save shards with np.savez(path, {INPUT_KEY}=token_ids)") from None
                if info.flag_bits & 0x1:
                    raise _fail(name, f"'{INPUT_KEY}' is encrypted", "save shards with plain np.savez")
                if info.compress_type == zipfile.ZIP_STORED:
                    return _inspect_stored(fh, info, path, name, seq_len)
                return _inspect_compressed(zf, info, name, seq_len)
    except ShardError:
        raise
    except (zipfile.BadZipFile, EOFError, zlib.error, NotImplementedError, RuntimeError, ValueError) as e:
        raise _fail(name, f"is not a readable .npz (zip) archive ({e})",
                    "re-download or regenerate the shard") from None
    except OSError as e:
        raise _fail(name, f"cannot be read ({e})", "check the file's permissions and the disk") from None


def _inspect_stored(fh, info: zipfile.ZipInfo, path: Path, name: str, seq_len: int) -> _Layout:
    start = _local_data_start(fh, info, name)
    fh.seek(start)
    shape, fortran, dtype = _read_npy_header(fh, name)
    kind, _ = _check_header(name, shape, dtype, seq_len)
    data_offset = fh.tell()
    count = int(np.prod(shape, dtype=np.int64))
    nbytes = count * dtype.itemsize
    header_len = data_offset - start
    if info.file_size != header_len + nbytes or data_offset + nbytes > os.path.getsize(path):
        raise _fail(name, f"is truncated or inconsistent: '{INPUT_KEY}' header promises {nbytes} data bytes "
                         f"but the zip member holds {info.file_size - header_len}",
                    "re-download or regenerate the shard")
    fh.seek(start)
    crc = zlib.crc32(fh.read(header_len))
    lo, hi, crc = _scan_ids(fh, dtype, count, name, crc)
    if crc != info.CRC:
        raise _fail(name, "fails its zip crc32 check (the data is corrupt)", "re-download or regenerate the shard")
    return _Layout(False, data_offset, dtype.str, tuple(int(s) for s in shape), bool(fortran), lo, hi)


def _inspect_compressed(zf: zipfile.ZipFile, info: zipfile.ZipInfo, name: str, seq_len: int) -> _Layout:
    with zf.open(info) as fp:
        shape, fortran, dtype = _read_npy_header(fp, name)
        _check_header(name, shape, dtype, seq_len)
        count = int(np.prod(shape, dtype=np.int64))
        lo, hi, _ = _scan_ids(fp, dtype, count, name)
        if fp.read(1):  # reading to the end also makes zipfile check the member's crc32
            raise _fail(name, f"'{INPUT_KEY}' holds more bytes than its header describes",
                        "re-download or regenerate the shard")
    return _Layout(True, -1, dtype.str, tuple(int(s) for s in shape), bool(fortran), lo, hi)


def _sequences_in(layout: _Layout, seq_len: int) -> int:
    return layout.shape[0] // seq_len if len(layout.shape) == 1 else layout.shape[0]


def _check_vocab(name: str, layout: _Layout, vocab_size: int) -> None:
    if layout.min_id < 0:
        raise _fail(name, f"holds id {layout.min_id} < 0", "token ids must be non-negative: check the tokenizer output")
    if layout.max_id >= vocab_size:
        raise _fail(name, f"holds id {layout.max_id} but vocab_size is {vocab_size} (ids must be < vocab_size)",
                    "the shard was tokenized for a bigger vocabulary: use the matching tokenizer/model or "
                    "re-tokenize")


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


def _layout_from_cache(entry, size: int, mtime_ns: int) -> _Layout | None:
    try:
        if entry["size"] != size or entry["mtime_ns"] != mtime_ns:
            return None
        layout = _Layout(bool(entry["compressed"]), int(entry["data_offset"]), str(entry["descr"]),
                         tuple(int(s) for s in entry["shape"]), bool(entry["fortran_order"]),
                         int(entry["min_id"]), int(entry["max_id"]))
        np.dtype(layout.descr)
        return layout
    except Exception:
        return None


def _write_cache(path: Path, files: dict, log: Callable) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        tmp.write_text(json.dumps({"version": CACHE_VERSION, "files": files}, sort_keys=True))
        os.replace(tmp, path)
    except OSError as e:
        log(f"data: could not write shard cache {path} ({e}); shards will be re-validated next start")
        try:
            tmp.unlink()
        except OSError:
            pass


# ----------------------------------------------------------------------------------------------------
# The index


def _find_shards(root: Path) -> list[str]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames.sort()
        for name in filenames:
            if name.endswith(".npz"):
                found.append((Path(dirpath) / name).relative_to(root).as_posix())
    return sorted(found)


class ShardIndex:
    """The validated, ordered list of shards under one directory and their sequence counts."""

    def __init__(self, root: Path, seq_len: int, vocab_size: int, shards: list[ShardInfo],
                 layouts: dict[str, _Layout]):
        self.root = Path(root)
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.shards = list(shards)
        self._layouts = {s.path: layouts[s.path] for s in self.shards}
        self._cumulative = np.cumsum([s.num_sequences for s in self.shards], dtype=np.int64)

    @classmethod
    def build(cls, data_dir, seq_len: int, vocab_size: int, max_files: int = -1, log=print) -> "ShardIndex":
        """Find, order and validate the shards under `data_dir`; raise before training on any bad one.

        Files whose size and mtime match the cache are not re-read; the vocabulary bound is checked
        from the cached min/max ids, so changing vocab_size or seq_len never needs a re-scan."""
        if seq_len < 1 or vocab_size < 1:
            raise ValueError(f"seq_len={seq_len} and vocab_size={vocab_size} must be positive")
        root = Path(data_dir)
        advice = (f"download shards with `python download_training_data.py --source gs://BUCKET/PREFIX "
                  f"--dest {root}` or point --data-dir at a folder of .npz shards")
        if not root.is_dir():
            raise DataDirError(f"data directory {root} does not exist; {advice}")
        all_files = _find_shards(root)
        if not all_files:
            raise DataDirError(f"data directory {root} holds no .npz shards; {advice}")
        files = all_files if max_files is None or max_files < 0 else all_files[:max_files]
        if not files:
            raise DataDirError(f"max_files={max_files} selects no shard in {root}; use -1 for all or a positive count")

        cache_path = root / CACHE_NAME
        cache = _load_cache(cache_path, log)
        layouts: dict[str, _Layout] = {}
        errors: dict[str, ShardError] = {}
        to_scan: list[tuple[str, int, int]] = []
        for rel in files:
            try:
                st = (root / rel).stat()
            except OSError as e:  # e.g. a dangling symlink
                errors[rel] = _fail((root / rel).as_posix(), f"cannot be read ({e})", "fix or remove the file")
                continue
            layout = _layout_from_cache(cache.get(rel), st.st_size, st.st_mtime_ns)
            if layout is not None:
                layouts[rel] = layout
            else:
                to_scan.append((rel, st.st_size, st.st_mtime_ns))

        if to_scan:
            t0 = time.perf_counter()
            total = sum(s for _, s, _ in to_scan)
            log(f"data: validating {len(to_scan)} shard file(s), {total / 1e9:.2f} GB, in {root} "
                f"(once; results cached in {CACHE_NAME})")
            scanned = _scan_all(root, to_scan, seq_len, log)
            for (rel, size, mtime_ns), result in zip(to_scan, scanned):
                if isinstance(result, ShardError):
                    errors[rel] = result
                    continue
                layouts[rel] = result
                cache[rel] = {"size": size, "mtime_ns": mtime_ns, "compressed": result.compressed,
                              "data_offset": result.data_offset, "descr": result.descr,
                              "shape": list(result.shape), "fortran_order": result.fortran_order,
                              "min_id": result.min_id, "max_id": result.max_id}
            existing = set(all_files)
            _write_cache(cache_path, {k: v for k, v in cache.items() if k in existing}, log)
            log(f"data: checked {len(to_scan)} file(s) in {time.perf_counter() - t0:.1f} s")

        shards = []
        for rel in files:
            if rel in errors:
                continue
            layout = layouts[rel]
            try:  # header rules again: seq_len may differ from the run that filled the cache
                kind, count = _check_header((root / rel).as_posix(), layout.shape, layout.dtype, seq_len)
                _check_vocab((root / rel).as_posix(), layout, vocab_size)
            except ShardError as e:
                errors[rel] = e
                continue
            shards.append(ShardInfo(rel, kind, int(np.prod(layout.shape)), count, layout.dtype.name))
        if len(errors) == 1:
            raise next(iter(errors.values()))
        if errors:
            bad = [str(errors[rel]) for rel in files if rel in errors]
            more = f"\n  ... and {len(bad) - 10} more" if len(bad) > 10 else ""
            raise ShardError(f"{len(bad)} shard files in {root} break the shard format (training has not "
                             "started):\n  " + "\n  ".join(bad[:10]) + more)

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
        return int(self._cumulative[-1]) if len(self._cumulative) else 0

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
        make = lambda part: ShardIndex(self.root, self.seq_len, self.vocab_size, part, self._layouts)
        return make(self.shards[:cut]), make(self.shards[cut:])

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
        return epoch * len(self.shards) + int(np.searchsorted(self._cumulative, consumed, side="right"))


def _scan_all(root: Path, to_scan, seq_len: int, log: Callable) -> list:
    """Inspect files on a few threads (reads, crc32 and min/max release the GIL); keeps input order."""
    def one(item):
        try:
            path = root / item[0]
            return _inspect_shard(path, path.as_posix(), seq_len)
        except ShardError as e:
            return e

    workers = max(1, min(8, os.cpu_count() or 1, len(to_scan)))
    results, last_log = [], time.monotonic()
    with ThreadPoolExecutor(workers) as pool:
        for i, r in enumerate(pool.map(one, to_scan), 1):
            results.append(r)
            if time.monotonic() - last_log > 10:
                log(f"data: validated {i}/{len(to_scan)} file(s)")
                last_log = time.monotonic()
    return results


# ----------------------------------------------------------------------------------------------------
# Reading sequences


class TokenSequenceDataset(Dataset):
    """Sequence i of the index as int64 ids of length seq_len.

    Uncompressed shards are read with positional reads (os.preadv) at the array's offset inside the zip:
    one syscall per sequence straight from the page cache, nothing mapped, so the resident set does not
    grow with the data read (with mmap, every touched page-cache folio counts as RSS). Fortran-ordered
    2-D arrays, whose rows are not contiguous, are memory-mapped instead. Compressed shards are
    decompressed whole into a small per-process LRU cache. Files are opened lazily in each process; open
    descriptors and caches are dropped on pickling and after a fork, so DataLoader workers are safe."""

    def __init__(self, index: ShardIndex):
        self.index = index
        self.seq_len = index.seq_len
        self._paths = [str(index.root / s.path) for s in index.shards]
        self._layouts = [index._layouts[s.path] for s in index.shards]
        self._cumulative = index._cumulative
        self._starts = np.concatenate(([0], self._cumulative)).astype(np.int64)
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._fds: OrderedDict[int, int] = OrderedDict()
        self._maps: dict[int, np.ndarray] = {}
        self._decompressed: OrderedDict[int, np.ndarray] = OrderedDict()
        self._decompressed_bytes = 0

    def _close(self) -> None:
        fds, self._fds = self._fds, OrderedDict()
        for fd in fds.values():
            try:
                os.close(fd)
            except OSError:
                pass

    def __del__(self):
        if getattr(self, "_pid", None) == os.getpid():
            self._close()

    def __getstate__(self):
        state = self.__dict__.copy()
        for k in ("_fds", "_maps", "_decompressed"):
            state[k] = type(state[k])()
        state["_decompressed_bytes"] = 0
        return state

    def __len__(self) -> int:
        return self.index.num_sequences

    def _check_process(self) -> None:
        if self._pid != os.getpid():  # forked: the parent's descriptors and caches are the parent's
            self._close()
            self._reset()

    def _fd(self, f: int) -> int:
        fd = self._fds.get(f)
        if fd is not None:
            self._fds.move_to_end(f)
            return fd
        while len(self._fds) >= MAX_OPEN_FILES:
            os.close(self._fds.popitem(last=False)[1])
        fd = self._fds[f] = os.open(self._paths[f], os.O_RDONLY)
        return fd

    def _array(self, f: int) -> np.ndarray:
        """The whole array of shard f: a memmap (Fortran-ordered) or the decompressed copy (compressed)."""
        layout = self._layouts[f]
        if not layout.compressed:
            arr = self._maps.get(f)
            if arr is None:
                arr = self._maps[f] = np.memmap(self._paths[f], dtype=layout.dtype, mode="r",
                                                offset=layout.data_offset, shape=layout.shape, order="F")
            return arr
        arr = self._decompressed.get(f)
        if arr is not None:
            self._decompressed.move_to_end(f)
            return arr
        with zipfile.ZipFile(self._paths[f]) as zf, zf.open(INPUT_KEY + ".npy") as fp:
            arr = np.lib.format.read_array(fp, allow_pickle=False)
        while self._decompressed and self._decompressed_bytes + arr.nbytes > COMPRESSED_CACHE_BYTES:
            _, old = self._decompressed.popitem(last=False)
            self._decompressed_bytes -= old.nbytes
        self._decompressed[f] = arr
        self._decompressed_bytes += arr.nbytes
        return arr

    def _read_sequence(self, f: int, j: int, out: np.ndarray) -> None:
        layout, n = self._layouts[f], self.seq_len
        if layout.compressed or layout.fortran_order:
            arr = self._array(f)
            out[:] = arr[j * n:(j + 1) * n] if arr.ndim == 1 else arr[j, :n]
            return
        dtype = layout.dtype
        first = j * n if len(layout.shape) == 1 else j * layout.shape[1]
        buf = out if dtype == out.dtype else np.empty(n, dtype=dtype)  # out is C-contiguous
        want = n * dtype.itemsize
        got = os.preadv(self._fd(f), [buf[:n]], layout.data_offset + first * dtype.itemsize)
        if got != want:
            raise ShardError(f"{self._paths[f]}: read {got} of {want} bytes of sequence {j}; the file "
                             "changed or shrank since it was indexed: restart to re-validate it")
        if buf is not out:
            out[:] = buf

    @property
    def wire_dtype(self) -> np.dtype:
        """The smallest dtype that holds every id (< vocab_size): what workers send to the main process."""
        return np.dtype(np.uint16 if self.index.vocab_size <= 1 << 16 else np.int32)

    def get_batch(self, indices, dtype=np.int64) -> np.ndarray:
        """Sequences `indices` as one array [len(indices), seq_len] of `dtype` (int64 unless asked),
        read straight from the shards (no per-sample tensors, no collate)."""
        self._check_process()
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        n = len(self)
        if idx.size and (idx.min() < 0 or idx.max() >= n):
            raise IndexError(f"sequence index out of range [0, {n})")
        files = np.searchsorted(self._cumulative, idx, side="right")
        local = idx - self._starts[files]
        out = np.empty((len(idx), self.seq_len), dtype=dtype)
        for k, (f, j) in enumerate(zip(files.tolist(), local.tolist())):
            self._read_sequence(f, j, out[k])
        return out

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.from_numpy(self.get_batch([int(i)])[0])


class _BatchView(Dataset):
    """What the DataLoader indexes: a list of sequence numbers -> one [B, seq_len] numpy array of `dtype`.

    Workers return numpy arrays in the compact wire dtype: pickled through the result pipe they cost a
    fraction of what torch's per-tensor shared-memory hand-off costs, and the int64 widening happens once,
    in the main process."""

    def __init__(self, dataset: TokenSequenceDataset, dtype: np.dtype):
        self.dataset, self.dtype = dataset, dtype

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, indices: list[int]) -> np.ndarray:
        return self.dataset.get_batch(indices, dtype=self.dtype)


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


def epoch_permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    """The sample order of one epoch: a permutation of range(n) from numpy's PCG64 seeded by (seed, epoch)."""
    perm = np.arange(n, dtype=np.int32 if n < 2**31 else np.int64)
    np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch]))).shuffle(perm)
    return perm


class ShardedBatchSampler(Sampler[list[int]]):
    """Infinite stream of this rank's micro-batches of sequence numbers.

    The global sample stream is perm(seed, 0) ++ perm(seed, 1) ++ ...; stream position p is sample
    perm(seed, p // N)[p % N]. A global batch is G = micro_batch_size * world_size consecutive positions
    and rank r takes positions [r * micro, (r + 1) * micro) of each. Starting at `start_position` costs one
    permutation, whatever the position."""

    def __init__(self, num_samples: int, micro_batch_size: int, rank: int, world_size: int, seed: int,
                 start_position: int = 0):
        if num_samples < 1:
            raise ValueError("cannot sample from an empty dataset (0 sequences)")
        if not (0 <= rank < world_size) or micro_batch_size < 1:
            raise ValueError(f"need 0 <= rank < world_size and micro_batch_size >= 1 "
                             f"(got rank={rank}, world_size={world_size}, micro_batch_size={micro_batch_size})")
        if seed < 0:
            raise ValueError(f"seed={seed} must be non-negative")
        self.num_samples, self.micro, self.rank, self.world, self.seed = (
            num_samples, micro_batch_size, rank, world_size, seed)
        self.global_batch = micro_batch_size * world_size
        self.start_position = start_position
        self._perms: OrderedDict[int, np.ndarray] = OrderedDict()

    def _perm(self, epoch: int) -> np.ndarray:
        perm = self._perms.get(epoch)
        if perm is None:
            perm = epoch_permutation(self.seed, epoch, self.num_samples)
            self._perms[epoch] = perm
            while len(self._perms) > 2:
                self._perms.popitem(last=False)
        return perm

    def indices_at(self, first_position: int) -> list[int]:
        """Sample numbers at stream positions [first_position, first_position + micro)."""
        n, out = self.num_samples, []
        p, end = first_position, first_position + self.micro
        while p < end:
            epoch, offset = divmod(p, n)
            take = min(end - p, n - offset)
            out.extend(self._perm(epoch)[offset:offset + take].tolist())
            p += take
        return out

    def __iter__(self) -> Iterator[list[int]]:
        p = self.start_position + self.rank * self.micro
        while True:
            yield self.indices_at(p)
            p += self.global_batch


# ----------------------------------------------------------------------------------------------------
# The loader the training loop holds


class ResumableLoader:
    """This rank's infinite stream of [micro_batch_size, seq_len] LongTensors, checkpointable.

    `position` counts global samples in batches *returned* by __next__ (DataLoader prefetch is not
    counted), so state_dict() after k batches resumes at batch k + 1. Position is in global samples, so a
    run may resume with another world size or micro-batch size. load_state_dict() is O(1) in the position:
    it only recreates the DataLoader iterator (one epoch permutation, no batches read)."""

    def __init__(self, dataset: TokenSequenceDataset, micro_batch_size: int, rank: int, world_size: int,
                 seed: int, num_workers: int = 0, prefetch_factor: int = 2, pin_memory: bool = False):
        if len(dataset) < 1:
            raise ValueError("ResumableLoader needs a dataset with at least one sequence")
        self.dataset = dataset
        self.micro_batch_size, self.rank, self.world_size, self.seed = micro_batch_size, rank, world_size, seed
        if pin_memory and not torch.cuda.is_available():
            warnings.warn("ResumableLoader(pin_memory=True) without CUDA: batches will not be pinned")
            pin_memory = False
        self.num_workers, self.prefetch_factor, self.pin_memory = num_workers, prefetch_factor, pin_memory
        self.num_samples = len(dataset)
        self.global_batch = micro_batch_size * world_size
        ShardedBatchSampler(self.num_samples, micro_batch_size, rank, world_size, seed)  # validates arguments
        self._position = 0
        self._iterator = None

    @property
    def position(self) -> int:
        return self._position

    @property
    def epoch(self) -> int:
        return self._position // self.num_samples

    def _make_iterator(self):
        sampler = ShardedBatchSampler(self.num_samples, self.micro_batch_size, self.rank, self.world_size,
                                      self.seed, start_position=self._position)
        if self.num_workers == 0:
            # Read here, without a DataLoader (its per-batch bookkeeping costs more than the read), in the
            # wire dtype: no per-row conversion buffer; __next__ widens the whole batch once.
            return (self.dataset.get_batch(indices, dtype=self.dataset.wire_dtype) for indices in sampler)
        # batch_size=None: the sampler already yields whole micro-batches, each produced once in this
        # process and handed to one worker, which returns a ready [B, seq_len] array (no collate).
        loader = DataLoader(_BatchView(self.dataset, self.dataset.wire_dtype), sampler=sampler, batch_size=None,
                            collate_fn=_as_is, num_workers=self.num_workers, worker_init_fn=_ignore_stop_signals,
                            prefetch_factor=self.prefetch_factor, persistent_workers=False)
        return iter(loader)

    def __iter__(self) -> "ResumableLoader":
        return self

    def __next__(self) -> torch.Tensor:
        if self._iterator is None:
            self._iterator = self._make_iterator()
        batch = torch.from_numpy(next(self._iterator).astype(np.int64, copy=False))
        if self.pin_memory:
            batch = batch.pin_memory()
        self._position += self.global_batch
        return batch

    def state_dict(self) -> dict:
        epoch, consumed = divmod(self._position, self.num_samples)
        return {"position": self._position, "epoch": epoch, "consumed_in_epoch": consumed,
                "seed": self.seed, "num_samples": self.num_samples, "global_batch": self.global_batch}

    def load_state_dict(self, state: dict) -> None:
        """Continue at `state["position"]`. The saved seed is adopted (the order must stay the one the
        run started with); a different dataset size is refused."""
        try:
            position, num_samples, seed = int(state["position"]), int(state["num_samples"]), int(state["seed"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"data cursor state is malformed ({e!r}); expected the dict from "
                             "ResumableLoader.state_dict()") from None
        if num_samples != self.num_samples:
            raise ValueError(
                f"the data changed since the checkpoint: its cursor was saved over {num_samples:,} sequences "
                f"but this dataset has {self.num_samples:,}. Restore the same shards and "
                "seq_len/max_files/val_files to resume, or start a fresh run")
        if position < 0 or seed < 0:
            raise ValueError(f"data cursor state has position={position}, seed={seed}; both must be >= 0")
        self.close()
        self._position, self.seed = position, seed

    def close(self) -> None:
        """Stop DataLoader workers (also done when the loader is garbage-collected)."""
        it, self._iterator = self._iterator, None
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()


def build_eval_batches(dataset: TokenSequenceDataset, micro_batch_size: int, rank: int, world_size: int,
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
