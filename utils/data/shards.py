"""One `.npz` shard: reading its zip and npy headers, checking the shard format, scanning its ids.

Shard layout accepted: key `input_ids`, dtype uint16/int32/uint32/int64, either 1-D (a token stream, cut
into non-overlapping `seq_len` chunks, the tail shorter than `seq_len` dropped) or 2-D `[rows, length]`
with `length >= seq_len` (each row is one sequence; rows longer than `seq_len` are truncated to their first
`seq_len` tokens). Pickle is never used: object arrays are rejected from the npy header alone.
"""
from __future__ import annotations

import os
import struct
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from utils.errors import NotAFileError, UserError
from utils.io import files

ALLOWED_DTYPES = ("uint16", "int32", "uint32", "int64")
INPUT_KEY = "input_ids"
_SCAN_CHUNK_BYTES = 16 << 20
_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # zip local file header, 30 bytes
_LOCAL_HEADER_SIG = b"PK\x03\x04"


class ShardError(UserError, ValueError):
    """A shard breaks the shard format. The message reads `<path>: <rule broken>; <what to do>`."""


@dataclass(frozen=True)
class ShardInfo:
    path: str  # relative to the index root, posix separators
    kind: str  # "stream" (1-D) or "rows" (2-D)
    num_tokens: int  # ids stored in the file (before cutting / truncation)
    num_sequences: int  # seq_len sequences this file contributes
    dtype: str


@dataclass(frozen=True)
class ShardLayout:
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


def shard_error(name: str, rule: str, advice: str) -> ShardError:
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
        raise shard_error(name, f"'{INPUT_KEY}' is not a readable .npy array ({e})",
                    "regenerate the shard with np.savez(path, input_ids=array)") from None
    return shape, fortran, dtype


def check_header(name: str, shape: tuple, dtype: np.dtype, seq_len: int) -> tuple[str, int]:
    """Format rules visible from the header alone -> (kind, num_sequences)."""
    if dtype.hasobject:
        raise shard_error(name, f"'{INPUT_KEY}' is an object array (dtype={dtype}), which only pickle can load "
                         "and pickle is never used", f"save token ids as an integer array ({', '.join(ALLOWED_DTYPES)})")
    if dtype.kind not in "iu" or dtype.name not in ALLOWED_DTYPES:
        raise shard_error(name, f"'{INPUT_KEY}' has dtype {dtype} which is not allowed",
                    f"convert it to one of {', '.join(ALLOWED_DTYPES)} (uint16 fits vocabularies up to 65536)")
    if len(shape) == 1:
        kind, count = "stream", shape[0] // seq_len
        size_note = f"a 1-D stream of {shape[0]} tokens"
    elif len(shape) == 2:
        if shape[1] < seq_len:
            raise shard_error(name, f"2-D '{INPUT_KEY}' rows hold {shape[1]} tokens but seq_len is {seq_len}; rows "
                             "must be at least seq_len long (longer rows are truncated to seq_len)",
                        "re-cut the data with rows of seq_len tokens, save it as a 1-D token stream, "
                        "or lower seq_len")
        kind, count = "rows", shape[0]
        size_note = f"{shape[0]} rows"
    else:
        raise shard_error(name, f"'{INPUT_KEY}' is {len(shape)}-D (shape {tuple(shape)}); it must be 1-D (a token "
                         "stream) or 2-D [rows, seq_len]", "reshape it before saving")
    if count == 0:
        raise shard_error(name, f"holds 0 sequences of seq_len={seq_len} ({size_note})",
                    "remove the empty shard or merge it into another one")
    return kind, count


def _local_data_start(fh, info: zipfile.ZipInfo, name: str) -> int:
    """Offset of a member's bytes: after its local header (whose extra field may differ from the
    central directory's, so it is read from the local header itself)."""
    fh.seek(info.header_offset)
    raw = fh.read(_LOCAL_HEADER.size)
    if len(raw) != _LOCAL_HEADER.size or raw[:4] != _LOCAL_HEADER_SIG:
        raise shard_error(name, "is not a readable .npz (zip) archive (bad local header)",
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
                raise shard_error(name, f"is truncated: '{INPUT_KEY}' ends after {count - left} of {count} items "
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


def inspect_shard(path: Path, name: str, seq_len: int) -> ShardLayout:
    """Open one shard, check every format rule except the vocabulary bound, scan its ids (min/max)
    and, for stored members, verify the zip crc32. Raises ShardError."""
    try:
        files.regular_file(path)  # a FIFO or a device named like a shard: refused, never opened
        with open(path, "rb") as fh:
            try:
                zf = zipfile.ZipFile(fh)
            except (zipfile.BadZipFile, EOFError, OSError) as e:
                raise shard_error(name, f"is not a readable .npz (zip) archive ({e})",
                            "it may be truncated or not an npz at all: re-download it "
                            "(download_training_data.py verifies size and crc32c) or regenerate it") from None
            with zf:
                member = INPUT_KEY + ".npy"
                try:
                    info = zf.getinfo(member)
                except KeyError:
                    found = ", ".join(sorted(n.removesuffix(".npy") for n in zf.namelist())) or "nothing"
                    raise shard_error(name, f"has no '{INPUT_KEY}' array (found: {found})",
                                f"save shards with np.savez(path, {INPUT_KEY}=token_ids)") from None
                if info.flag_bits & 0x1:
                    raise shard_error(name, f"'{INPUT_KEY}' is encrypted", "save shards with plain np.savez")
                if info.compress_type == zipfile.ZIP_STORED:
                    return _inspect_stored(fh, info, path, name, seq_len)
                return _inspect_compressed(zf, info, name, seq_len)
    except ShardError:
        raise
    except NotAFileError as e:
        raise ShardError(str(e)) from None
    except (zipfile.BadZipFile, EOFError, zlib.error, NotImplementedError, RuntimeError, ValueError) as e:
        raise shard_error(name, f"is not a readable .npz (zip) archive ({e})",
                    "re-download or regenerate the shard") from None
    except OSError as e:
        raise shard_error(name, f"cannot be read ({e})", "check the file's permissions and the disk") from None


def _inspect_stored(fh, info: zipfile.ZipInfo, path: Path, name: str, seq_len: int) -> ShardLayout:
    start = _local_data_start(fh, info, name)
    fh.seek(start)
    shape, fortran, dtype = _read_npy_header(fh, name)
    kind, _ = check_header(name, shape, dtype, seq_len)
    data_offset = fh.tell()
    count = int(np.prod(shape, dtype=np.int64))
    nbytes = count * dtype.itemsize
    header_len = data_offset - start
    if info.file_size != header_len + nbytes or data_offset + nbytes > os.path.getsize(path):
        raise shard_error(name, f"is truncated or inconsistent: '{INPUT_KEY}' header promises {nbytes} data bytes "
                         f"but the zip member holds {info.file_size - header_len}",
                    "re-download or regenerate the shard")
    fh.seek(start)
    crc = zlib.crc32(fh.read(header_len))
    lo, hi, crc = _scan_ids(fh, dtype, count, name, crc)
    if crc != info.CRC:
        raise shard_error(name, "fails its zip crc32 check (the data is corrupt)", "re-download or regenerate the shard")
    return ShardLayout(False, data_offset, dtype.str, tuple(int(s) for s in shape), bool(fortran), lo, hi)


def _inspect_compressed(zf: zipfile.ZipFile, info: zipfile.ZipInfo, name: str, seq_len: int) -> ShardLayout:
    with zf.open(info) as fp:
        shape, fortran, dtype = _read_npy_header(fp, name)
        check_header(name, shape, dtype, seq_len)
        count = int(np.prod(shape, dtype=np.int64))
        lo, hi, _ = _scan_ids(fp, dtype, count, name)
        if fp.read(1):  # reading to the end also makes zipfile check the member's crc32
            raise shard_error(name, f"'{INPUT_KEY}' holds more bytes than its header describes",
                        "re-download or regenerate the shard")
    return ShardLayout(True, -1, dtype.str, tuple(int(s) for s in shape), bool(fortran), lo, hi)


def read_layout(path) -> ShardLayout:
    """Where a shard's array lives, from its zip and npy headers alone (no id scan: min_id and max_id are -1):
    for a reader of a file already checked by inspect_shard in another thread or process."""
    with open(path, "rb") as fh, zipfile.ZipFile(fh) as zf:
        info = zf.getinfo(INPUT_KEY + ".npy")
        if info.compress_type != zipfile.ZIP_STORED:
            with zf.open(info) as fp:
                shape, fortran, dtype = _read_npy_header(fp, str(path))
            return ShardLayout(True, -1, dtype.str, tuple(int(s) for s in shape), bool(fortran), -1, -1)
        fh.seek(_local_data_start(fh, info, str(path)))
        shape, fortran, dtype = _read_npy_header(fh, str(path))
        return ShardLayout(False, fh.tell(), dtype.str, tuple(int(s) for s in shape), bool(fortran), -1, -1)


def check_vocab(name: str, layout: ShardLayout, vocab_size: int) -> None:
    if layout.min_id < 0:
        raise shard_error(name, f"holds id {layout.min_id} < 0", "token ids must be non-negative: check the tokenizer output")
    if layout.max_id >= vocab_size:
        raise shard_error(name, f"holds id {layout.max_id} but vocab_size is {vocab_size} (ids must be < vocab_size)",
                    "the shard was tokenized for a bigger vocabulary: use the matching tokenizer/model or "
                    "re-tokenize")
