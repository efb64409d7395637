"""A corpus for `prepare_data.py`: its input files (local or `gs://`), listed with sizes, and the documents
of any byte range of one of them.

Formats: plain text (`.txt`, one document per file), JSON Lines (`.jsonl`, one document per line in a text
field), the `.gz` of either, and Parquet (a text column; needs pyarrow). A byte range `[start, end)` of a
`.jsonl` holds the lines that start inside it, and of a `.parquet` the row groups whose first byte is inside
it, so ranges that tile a file read each document exactly once, and a 50 GB file can be cut anywhere. A
`.txt` is one document and a `.gz` cannot be entered mid-stream: those are read whole.

Each document comes with its position in its file: the byte offset of its line (in the decompressed
stream for `.jsonl.gz`), its row number for Parquet, 0 for a `.txt`. With the file's `key` (its path
below the `--input` folder or prefix that found it, or its name), the position names the document without
counting the documents before it, which is what lets a partition decide its validation documents alone.
"""
from __future__ import annotations

import glob
import gzip
import json
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from utils.io import files
from utils.errors import UserError

TEXT_SUFFIXES = (".txt", ".txt.gz")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")
PARQUET_SUFFIXES = (".parquet",)
SUFFIXES = TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES
SPLITTABLE_SUFFIXES = (".jsonl", ".parquet")
READ_CHUNK = 1 << 20
# The largest document prepare reads (its UTF-8 bytes): one over this is refused in one line before it is
# read whole (a 1 MB gzip can hold a 1 GB line). Below it a document is tokenized in pieces
# (partition.PIECE_CHARS), so a worker's memory follows the piece, not the document (docs/data.md).
# Books are a few MB; a larger "document" is a corpus that lost its separators.
MAX_DOCUMENT_BYTES = 64 << 20


class PrepareError(UserError):
    """Bad input for prepare_data.py; the message names the file (and line) and what to do."""


@dataclass(frozen=True)
class InputFile:
    location: str  # as found: a path as the --input named it, or gs://BUCKET/NAME
    path: str  # what a worker opens: the absolute local path, or the gs:// URL
    key: str  # the file's name in the validation draw: its path below the --input folder, or its name
    bytes: int
    stamp: str  # changes when the content may have: mtime_ns on disk, crc32c in a bucket

    @property
    def splittable(self) -> bool:
        return self.location.endswith(SPLITTABLE_SUFFIXES)


# ------------------------------------------------------------------------------------------------ listing

def list_inputs(given: list[str]) -> list[InputFile]:
    """Files, folders (recursive), globs and gs:// prefixes or objects -> the supported files, sorted by
    location, each once."""
    found: dict[str, InputFile] = {}
    for spec in given:
        for item in (_bucket_inputs(spec) if spec.startswith("gs://") else _local_inputs(spec)):
            found.setdefault(item.path, item)
    if not found:
        raise PrepareError(f"no input files ({', '.join(SUFFIXES)}) in {' '.join(given)}")
    return sorted(found.values(), key=lambda f: f.location)


def _local_inputs(given: str) -> list[InputFile]:
    matches = [Path(m) for m in sorted(glob.glob(given, recursive=True))] if glob.has_magic(given) else [Path(given)]
    if not matches:
        raise PrepareError(f"--input {given}: matches no file")
    found = []
    for path in matches:
        if path.is_dir():
            walked = (Path(folder, name) for folder, _, names in files.walk_once(path) for name in names)
            found += [(p, p.relative_to(path).as_posix()) for p in walked  # each real folder once
                      if p.name.endswith(SUFFIXES) and p.is_file()]
        elif path.is_file():
            if not path.name.endswith(SUFFIXES):
                raise PrepareError(f"{path}: not a supported input ({', '.join(SUFFIXES)})")
            found.append((path, path.name))
        elif path.exists():  # a FIFO, a socket or a device: never opened (a FIFO would wait for a writer)
            raise PrepareError(f"--input {path}: not a regular file or folder; give the file itself")
        else:
            raise PrepareError(f"--input {path}: no such file or folder")
    items = []
    for path, key in found:
        st = path.stat()
        items.append(InputFile(path.as_posix(), os.path.abspath(path), key, st.st_size, str(st.st_mtime_ns)))
    return items


def _bucket_inputs(url: str) -> list[InputFile]:
    from utils.io.storage import StorageError, gs_url, list_objects, make_client, parse_gs_url, stat_object

    try:
        bucket, prefix = parse_gs_url(url)
    except ValueError as exc:
        raise PrepareError(f"--input {url}: {exc}") from None
    try:
        client = make_client()
        under = [(o, o.name[len(prefix) + 1:] if prefix else o.name)
                 for o in list_objects(client, bucket, prefix, suffix=None)]
        one = stat_object(client, url) if not under and prefix.endswith(SUFFIXES) else None  # the URL names one
    except StorageError as exc:
        raise PrepareError(f"--input {url}: {exc}") from None
    if one is not None:
        under = [(one, prefix.rpartition("/")[2])]
    if not under:
        raise PrepareError(f"--input {url}: no objects there; check the bucket and prefix")
    return [InputFile(gs_url(bucket, o.name), gs_url(bucket, o.name), key, o.size, o.crc32c)
            for o, key in under if o.name.endswith(SUFFIXES)]


# ------------------------------------------------------------------------------------------------ reading

def open_binary(path: str):
    """A seekable binary reader of a local file or a gs:// object."""
    if path.startswith("gs://"):
        from utils.io.storage import make_client, open_object

        return open_object(make_client(), path)
    return open(path, "rb")


def read_documents(source: InputFile | str | Path, text_field: str, start: int = 0,
                   end: int | None = None) -> Iterator[tuple[int, str]]:
    """(position, text) of each document of `source` in `[start, end)` (see the module docstring), in
    order; a bad file or line is one PrepareError naming it."""
    shown, path = (source.location, source.path) if isinstance(source, InputFile) else (str(source), str(source))
    try:
        if shown.endswith(TEXT_SUFFIXES):
            with _open_stream(path) as f:
                data = f.read(MAX_DOCUMENT_BYTES + 1)
            if len(data) > MAX_DOCUMENT_BYTES:
                raise PrepareError(_too_big(shown, "a .txt file is one document"))
            try:
                yield 0, data.decode("utf-8")
            except UnicodeDecodeError as exc:
                line = data.count(b"\n", 0, exc.start) + 1
                raise PrepareError(f"{shown}: not UTF-8 text ({exc.reason} at line {line}, byte {exc.start})") from None
        elif shown.endswith(JSONL_SUFFIXES):
            whole = shown.endswith(".gz")
            yield from _jsonl_documents(shown, path, text_field, 0 if whole else start, None if whole else end)
        else:
            yield from _parquet_documents(shown, path, text_field, start, end)
    except (EOFError, gzip.BadGzipFile) as exc:
        raise PrepareError(f"{shown}: cannot be read ({exc})") from None
    except Exception as exc:
        failure = _read_failure(shown, path, exc)
        if failure is None:
            raise
        raise failure from None


def _read_failure(shown: str, path: str, exc: Exception) -> Exception | None:
    """The one-line error for a file that could not be read, or None for an exception that is no such
    failure. A bucket's read that broke off is a StorageError (worth a retry of the partition); a missing or
    forbidden object, like an unreadable local file, is a PrepareError (the user fixes it)."""
    if isinstance(exc, PrepareError):
        return None
    if not path.startswith("gs://"):
        return PrepareError(f"{shown}: cannot be read ({exc})") if isinstance(exc, OSError) else None
    from google.api_core.exceptions import GoogleAPIError

    from utils.io.storage import StorageError, is_transient

    if not isinstance(exc, (OSError, GoogleAPIError)):
        return None
    kind = StorageError if isinstance(exc, OSError) or is_transient(exc) else PrepareError
    return kind(f"{shown}: cannot be read ({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''})")


@contextmanager
def _open_stream(path: str):
    """The bytes of a file, decompressed for .gz (a gzip stream is read from its start)."""
    with open_binary(path) as raw:
        yield gzip.GzipFile(fileobj=raw, mode="rb") if path.endswith(".gz") else raw


def _jsonl_documents(shown: str, path: str, text_field: str, start: int, end: int | None):
    with _open_stream(path) as f:
        offset = start
        if start:
            f.seek(start - 1)
            offset += len(f.readline()) - 1  # the line holding byte start-1 belongs to the range before
        while end is None or offset < end:
            raw = f.readline(MAX_DOCUMENT_BYTES + 1)
            if not raw:
                break
            here, offset = offset, offset + len(raw)
            if len(raw) > MAX_DOCUMENT_BYTES:
                raise PrepareError(_too_big(f"{shown}:{_line_number(path, here)}", "a JSONL line is one document"))
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise PrepareError(f"{shown}: not UTF-8 text ({exc.reason} at line {_line_number(path, here)}, "
                                   f"byte {here + exc.start})") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise PrepareError(f"{shown}:{_line_number(path, here)}: not valid JSON ({exc})") from None
            except RecursionError:
                raise PrepareError(f"{shown}:{_line_number(path, here)}: JSON nested too deeply to read") from None
            if not isinstance(record, dict) or text_field not in record:
                raise PrepareError(f"{shown}:{_line_number(path, here)}: no '{text_field}' field; name the field "
                                   f"with --text-field") from None
            if not isinstance(record[text_field], str):
                raise PrepareError(f"{shown}:{_line_number(path, here)}: '{text_field}' is a "
                                   f"{type(record[text_field]).__name__}, not a string") from None
            text = record[text_field]
            if not text.isascii():
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError as exc:
                    raise PrepareError(f"{shown}:{_line_number(path, here)}: '{text_field}' holds a lone surrogate "
                                       f"(\\u{ord(text[exc.start]):04x} at character {exc.start}), which is not text; "
                                       f"fix or drop the line") from None
            yield here, text


def _too_big(where: str, unit: str) -> str:
    return (f"{where}: a document over {MAX_DOCUMENT_BYTES >> 20} MiB ({unit}; prepare reads at most that much "
            f"of one); split it into smaller documents")


def _line_number(path: str, offset: int) -> int:
    """The line number of the line starting at byte `offset` (of the decompressed stream for .gz): counted
    only for an error message, so a range far into a big file need not count its lines as it reads."""
    lines, left = 1, offset
    with _open_stream(path) as f:
        while left > 0:
            chunk = f.read(min(READ_CHUNK, left))
            if not chunk:
                break
            lines += chunk.count(b"\n")
            left -= len(chunk)
    return lines


def _parquet_documents(shown: str, path: str, text_field: str, start: int, end: int | None):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise PrepareError(f"{shown}: reading Parquet needs pyarrow (pip install pyarrow)") from None
    with open_binary(path) as f:
        table = pq.ParquetFile(f)
        if text_field not in table.schema_arrow.names:
            raise PrepareError(f"{shown}: no column '{text_field}' (columns: {', '.join(table.schema_arrow.names)}); "
                               f"name it with --text-field")
        row = 0
        for group in range(table.metadata.num_row_groups):
            meta = table.metadata.row_group(group)
            if start <= _first_byte(meta) and (end is None or _first_byte(meta) < end):
                values = table.read_row_group(group, columns=[text_field]).column(0).to_pylist()
                for number, value in enumerate(values, row):
                    if value is not None and not isinstance(value, str):
                        raise PrepareError(f"{shown}: column '{text_field}' holds {type(value).__name__}, not strings")
                    if value and len(value) > MAX_DOCUMENT_BYTES // 4 and len(value.encode()) > MAX_DOCUMENT_BYTES:
                        raise PrepareError(_too_big(f"{shown}: row {number}", "a row is one document"))
                    yield number, value or ""
            row += meta.num_rows


def _first_byte(row_group) -> int:
    """Where a row group's data starts in its file: its earliest column chunk (dictionary page first)."""
    starts = []
    for i in range(row_group.num_columns):
        column = row_group.column(i)
        dictionary = column.dictionary_page_offset if column.has_dictionary_page else None
        starts.append(dictionary if dictionary else column.data_page_offset)
    return min(starts)
