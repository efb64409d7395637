"""A corpus and a tokenizer -> production shards: what `prepare_data.py` runs.

Inputs, in sorted path order: plain text (`.txt`, one document per file), JSON Lines (`.jsonl`, one
document per line in a text field) and the `.gz` of either, and Parquet (a text column) when pyarrow is
installed. Each document is tokenized (no special tokens added) and followed by the tokenizer's EOS id;
the concatenated stream is cut into 1-D shards of `shard_tokens` ids (uint16, or uint32 when the
vocabulary exceeds 65,536 ids), the last one holding the remainder (between half and one and a half
shards, so no shard is too short to cut a sequence from). A document may span two shards: the loader cuts
`seq_len` windows from the stream either way.

Validation split, by documents: one document in every block of `stride` consecutive documents, at a
position drawn from `seed` (stratified sampling), goes to the validation shards under `val/` instead, so
validation is a random sample of the whole corpus however its files are ordered, disjoint from training,
and the same whatever `workers` is. `stride` is 1 / `val_fraction`, lowered for a small corpus so that
validation holds at least MIN_VAL_DOCUMENTS documents where it can (never more than a quarter of them).
`dataset.json` lists both splits; train.py then validates on the `val/` shards.

Parallel and deterministic: the main process reads documents in order and hands batches to `workers`
processes that tokenize; results come back in order and one writer cuts the shards, so the output is
byte-identical whatever `workers` is. Atomic: everything is written into a hidden temporary directory
beside the output and renamed into place at the end, `dataset.json` included, so a killed run leaves no
shard where training would find it, and the next run clears the leftovers and starts again. A run on a
finished output with the same inputs, tokenizer and settings does nothing.
"""
from __future__ import annotations

import glob
import gzip
import hashlib
import io
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from utils import files
from utils.data.dataset_info import FILE as DATASET_FILE
from utils.data.dataset_info import FORMAT, VERSION
from utils.data.tokenizer import EOS_CANDIDATES, GPT2_FILES, read_tokenizer
from utils.data.tokenizer import FILE as TOKENIZER_FILE
from utils.errors import UserError

# 2^24 ids per shard: 32 MiB as uint16. Big enough that a bucket holds thousands, not millions, of objects
# and each download is efficient; small enough that the last `val_files` shards held out for validation are
# a small share of a modest corpus, and that a failed download costs little.
DEFAULT_SHARD_TOKENS = 1 << 24
DEFAULT_VAL_FRACTION = 0.005
DEFAULT_SPLIT_SEED = 1234
MIN_VAL_DOCUMENTS = 100
MIN_VAL_STRIDE = 4  # validation takes at most a quarter of the documents
# Fewer training shards than this and what works by file (parallel downloads, max_files, val_files) has
# little to work with: prepare warns, naming --shard-tokens.
MIN_TRAIN_SHARDS = 8
VAL_FOLDER = "val"
SHARDS_PER_FOLDER = 256
TEXT_SUFFIXES = (".txt", ".txt.gz")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")
PARQUET_SUFFIXES = (".parquet",)
SUFFIXES = TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES
BATCH_DOCUMENTS = 256
BATCH_CHARS = 4 << 20


class PrepareError(UserError):
    """Bad input for prepare_data.py; the message names the file (and line) and what to do."""


# ------------------------------------------------------------------------------------------------ inputs

def find_inputs(paths: list[str]) -> list[Path]:
    """Files, folders (recursive) and globs -> the supported files, sorted, each once."""
    found: set[Path] = set()
    for given in paths:
        matches = [Path(m) for m in sorted(glob.glob(given, recursive=True))] if glob.has_magic(given) else [Path(given)]
        if not matches:
            raise PrepareError(f"--input {given}: matches no file")
        for path in matches:
            if path.is_dir():
                found |= {p for p in path.rglob("*") if p.is_file() and p.name.endswith(SUFFIXES)}
            elif path.is_file():
                if not path.name.endswith(SUFFIXES):
                    raise PrepareError(f"{path}: not a supported input ({', '.join(SUFFIXES)})")
                found.add(path)
            else:
                raise PrepareError(f"--input {path}: no such file or folder")
    if not found:
        raise PrepareError(f"no input files ({', '.join(SUFFIXES)}) in {' '.join(paths)}")
    return sorted(found, key=lambda p: p.as_posix())


def _open_text(path: Path):
    raw = gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")
    return io.TextIOWrapper(raw, encoding="utf-8", errors="strict", newline="")


def read_documents(path: Path, text_field: str) -> Iterator[str]:
    """The documents of one input file, in order; a bad file or line is one PrepareError naming it."""
    try:
        if path.name.endswith(TEXT_SUFFIXES):
            with _open_text(path) as f:
                yield f.read()
        elif path.name.endswith(JSONL_SUFFIXES):
            with _open_text(path) as f:
                for number, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except ValueError as exc:
                        raise PrepareError(f"{path}:{number}: not valid JSON ({exc})") from None
                    if not isinstance(record, dict) or text_field not in record:
                        raise PrepareError(f"{path}:{number}: no '{text_field}' field; name the field with "
                                           f"--text-field") from None
                    if not isinstance(record[text_field], str):
                        raise PrepareError(f"{path}:{number}: '{text_field}' is a "
                                           f"{type(record[text_field]).__name__}, not a string") from None
                    yield record[text_field]
        else:
            yield from _parquet_documents(path, text_field)
    except UnicodeDecodeError as exc:
        raise PrepareError(f"{path}: not UTF-8 text ({exc.reason} at {_bad_utf8_position(path)})") from None
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise PrepareError(f"{path}: cannot be read ({exc})") from None


def _bad_utf8_position(path: Path) -> str:
    """"line N, byte B" of the first byte that is not UTF-8 (B counts from the start of the file, of the
    decompressed stream for .gz): the decoder's own offset is within its read buffer."""
    offset = 0
    with (gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")) as f:
        for number, line in enumerate(f, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as exc:
                return f"line {number}, byte {offset + exc.start}"
            offset += len(line)
    return "the end of the file"


def _parquet_documents(path: Path, text_field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise PrepareError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
    table = pq.ParquetFile(path)
    if text_field not in table.schema_arrow.names:
        raise PrepareError(f"{path}: no column '{text_field}' (columns: {', '.join(table.schema_arrow.names)}); "
                           f"name it with --text-field")
    for batch in table.iter_batches(columns=[text_field]):
        for value in batch.column(0).to_pylist():
            if value is not None and not isinstance(value, str):
                raise PrepareError(f"{path}: column '{text_field}' holds {type(value).__name__}, not strings")
            yield value or ""


# --------------------------------------------------------------------------------------------- tokenizer

@dataclass
class TokenizerInfo:
    json: bytes  # its tokenizer.json, written beside the shards
    vocab_size: int
    eos_id: int
    eos_token: str
    digest: str


def load_tokenizer(spec: str, eos_token: str | None = None) -> tuple[object, TokenizerInfo]:
    """The tokenizer `--tokenizer` names (utils/data/tokenizer.py: a tokenizer.json, an HF tokenizer directory
    holding one, or a GPT-2-style vocab.json + merges.txt) and its end-of-document token, which prepare needs."""
    loaded = read_tokenizer(spec)
    if loaded is None:
        raise PrepareError(f"--tokenizer {spec}: no {TOKENIZER_FILE} there, nor GPT-2-style "
                           f"{' + '.join(GPT2_FILES)} (give a tokenizers file or an HF tokenizer directory)")
    tokenizer = loaded.tokenizer
    name = eos_token or loaded.end_of_document()
    if name is None:
        raise PrepareError(f"--tokenizer {spec}: no end-of-document token found (none configured in "
                           f"tokenizer_config.json, none of {', '.join(EOS_CANDIDATES)}); name one with --eos-token")
    eos_id = tokenizer.token_to_id(name)
    if eos_id is None:
        raise PrepareError(f"--eos-token {name!r} is not in the vocabulary of {spec}")
    info = TokenizerInfo(loaded.json, loaded.vocab_size, eos_id, name, hashlib.sha256(loaded.json).hexdigest())
    return tokenizer, info


# ------------------------------------------------------------------------------------------ tokenizing

_WORKER_TOKENIZER = None


def _init_worker(tokenizer_json: str) -> None:
    global _WORKER_TOKENIZER
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process stops the pool (no traceback per worker)
    from tokenizers import Tokenizer

    _WORKER_TOKENIZER = Tokenizer.from_str(tokenizer_json)


def _encode(texts: list[str], tokenizer=None) -> list[np.ndarray]:
    tokenizer = tokenizer or _WORKER_TOKENIZER
    return [np.asarray(e.ids, dtype=np.int64) for e in tokenizer.encode_batch(texts, add_special_tokens=False)]


def _batches(inputs: list[Path], text_field: str, counts: "Counts") -> Iterator[list[str]]:
    """Non-empty documents in order, in batches; empty ones are counted and skipped."""
    batch, chars = [], 0
    for path in inputs:
        for text in read_documents(path, text_field):
            if not text.strip():
                counts.empty += 1
                continue
            batch.append(text)
            chars += len(text)
            if len(batch) >= BATCH_DOCUMENTS or chars >= BATCH_CHARS:
                yield batch
                batch, chars = [], 0
    if batch:
        yield batch


@dataclass
class Counts:
    documents: int = 0
    empty: int = 0
    tokens: int = 0
    val_documents: int = 0
    val_tokens: int = 0


# ------------------------------------------------------------------------------------------------ shards

class ShardWriter:
    """Cuts the token stream into shards of `shard_tokens` ids (the last takes the remainder)."""

    def __init__(self, root: Path, shard_tokens: int, dtype: np.dtype, folder: str = ""):
        self.root, self.shard_tokens, self.dtype, self.folder = root, shard_tokens, dtype, folder
        self.pending: list[np.ndarray] = []
        self.pending_tokens = 0
        self.shards: list[dict] = []

    def add(self, ids: np.ndarray) -> None:
        self.pending.append(ids.astype(self.dtype, copy=False))
        self.pending_tokens += ids.size
        # keep at least half a shard back, so the last shard is never a sliver
        while self.pending_tokens >= self.shard_tokens + self.shard_tokens // 2:
            stream = np.concatenate(self.pending)
            self._write(stream[:self.shard_tokens])
            rest = stream[self.shard_tokens:]
            self.pending, self.pending_tokens = [rest], rest.size

    def close(self) -> None:
        if self.pending_tokens:
            self._write(np.concatenate(self.pending))
        self.pending, self.pending_tokens = [], 0

    def _write(self, ids: np.ndarray) -> None:
        k = len(self.shards)
        rel = Path(self.folder, f"part-{k // SHARDS_PER_FOLDER:05d}", f"shard-{k:05d}.npz")
        (self.root / rel.parent).mkdir(parents=True, exist_ok=True)
        with open(self.root / rel, "wb") as f:
            np.savez(f, input_ids=np.ascontiguousarray(ids))
        from utils.storage import file_crc32c

        self.shards.append({"path": rel.as_posix(), "tokens": int(ids.size),
                            "bytes": (self.root / rel).stat().st_size, "crc32c": file_crc32c(self.root / rel)})


# ------------------------------------------------------------------------------------------ the split

class ValidationSplit:
    """Which documents (by their index in reading order) are validation: one in each block of `stride`."""

    def __init__(self, stride: int, seed: int):
        self.stride, self.seed = stride, seed
        self._block, self._pick = -1, -1

    def is_validation(self, index: int) -> bool:
        if self.stride == 0:
            return False
        block, position = divmod(index, self.stride)
        if block != self._block:
            digest = hashlib.blake2b(f"{self.seed}:{block}".encode(), digest_size=8).digest()
            self._block, self._pick = block, int.from_bytes(digest, "little") % self.stride
        return position == self._pick


def split_stride(files_in: list[Path], text_field: str, val_fraction: float) -> int:
    """1 / val_fraction, lowered (down to MIN_VAL_STRIDE) when the corpus has too few documents for
    MIN_VAL_DOCUMENTS of them at that rate; 0 without a split. Counting stops once the corpus is known to be
    big enough, so a large corpus is not read twice."""
    if val_fraction <= 0:
        return 0
    stride = max(MIN_VAL_STRIDE, round(1 / val_fraction))
    enough = stride * MIN_VAL_DOCUMENTS
    documents = 0
    for path in files_in:
        for text in read_documents(path, text_field):
            documents += bool(text.strip())
            if documents >= enough:
                return stride
    return max(MIN_VAL_STRIDE, min(stride, documents // MIN_VAL_DOCUMENTS))


# ------------------------------------------------------------------------------------------------ driver

@dataclass
class PrepareResult:
    output: Path
    documents: int
    empty: int
    tokens: int
    shards: int
    seconds: float
    reused: bool = False
    val_documents: int = 0
    val_shards: int = 0
    uploaded_to: str | None = None
    notes: list[str] = field(default_factory=list)


def fingerprint(inputs: list[Path], tok: TokenizerInfo, settings: dict) -> str:
    h = hashlib.sha256()
    for path in inputs:
        st = path.stat()
        h.update(f"{path.resolve().as_posix()}\t{st.st_size}\t{st.st_mtime_ns}\n".encode())
    h.update(tok.digest.encode())
    h.update(json.dumps(settings, sort_keys=True).encode())
    return h.hexdigest()


def prepare(inputs: list[str], tokenizer: str, output, workers: int = 1, text_field: str = "text",
            shard_tokens: int = DEFAULT_SHARD_TOKENS, eos_token: str | None = None,
            progress: Callable[[int, int], None] | None = None, val_fraction: float = DEFAULT_VAL_FRACTION,
            split_seed: int = DEFAULT_SPLIT_SEED) -> PrepareResult:
    """Tokenizes `inputs` into shards + tokenizer.json + dataset.json in `output` (see the module docstring)."""
    started = time.perf_counter()
    if shard_tokens < 1024:
        raise PrepareError(f"--shard-tokens {shard_tokens} is too small; use at least 1024 (default {DEFAULT_SHARD_TOKENS})")
    if workers < 1:
        raise PrepareError(f"--workers must be at least 1, got {workers}")
    if not 0 <= val_fraction < 0.5:
        raise PrepareError(f"--val-fraction {val_fraction} must be within [0, 0.5) (0: no validation split)")
    files_in = find_inputs(inputs)
    tok_obj, tok = load_tokenizer(tokenizer, eos_token)
    output = Path(output)
    settings = {"text_field": text_field, "eos_token": tok.eos_token, "shard_tokens": shard_tokens,
                "val_fraction": val_fraction, "split_seed": split_seed}
    digest = fingerprint(files_in, tok, settings)
    done = _finished(output, digest)
    if done is not None:
        return PrepareResult(output, done["documents"], done["documents_empty"], done["tokens"], len(done["shards"]),
                             time.perf_counter() - started, reused=True)
    if output.exists() and any(output.iterdir()):
        raise PrepareError(f"--output {output} is not empty (and holds no dataset prepared from these inputs and "
                           f"settings); choose a new folder or empty it")
    output.parent.mkdir(parents=True, exist_ok=True)
    files.remove_stale_temps(output.parent)
    dtype = np.dtype(np.uint16 if tok.vocab_size <= 65536 else np.uint32)
    counts = Counts()
    split = ValidationSplit(split_stride(files_in, text_field, val_fraction), split_seed)
    with files.disk_full_guard(output, advice=DISK_FULL_ADVICE), files.atomic_directory(output) as tmp:
        writer = ShardWriter(tmp, shard_tokens, dtype)
        val_writer = ShardWriter(tmp, shard_tokens, dtype, folder=VAL_FOLDER)
        eos = np.array([tok.eos_id], dtype=np.int64)
        for encoded in _tokenized(files_in, text_field, tok, tok_obj, workers, counts):
            for ids in encoded:
                document = np.concatenate((ids, eos))
                if split.is_validation(counts.documents):
                    val_writer.add(document)
                    counts.val_documents += 1
                    counts.val_tokens += document.size
                else:
                    writer.add(document)
                counts.documents += 1
                counts.tokens += document.size
            if progress:
                progress(counts.documents, counts.tokens)
        if counts.documents == 0:
            raise PrepareError(f"the corpus is empty: {len(files_in)} input file(s), {counts.empty} empty document(s)"
                               f" and no text")
        writer.close()
        val_writer.close()
        (tmp / TOKENIZER_FILE).write_bytes(tok.json)
        description = {
            "format": FORMAT, "version": VERSION,
            "tokenizer": {"file": TOKENIZER_FILE, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
                          "eos_token": tok.eos_token, "sha256": tok.digest},
            "dtype": dtype.name, "documents": counts.documents, "documents_empty": counts.empty,
            "tokens": counts.tokens, "shard_tokens": shard_tokens, "shards": writer.shards,
            "validation": {"documents": counts.val_documents, "tokens": counts.val_tokens,
                           "fraction": val_fraction, "stride": split.stride, "seed": split_seed,
                           "shards": val_writer.shards},
            "inputs": [{"path": p.as_posix(), "bytes": p.stat().st_size} for p in files_in],
            "settings": settings, "fingerprint": digest,
        }
        (tmp / DATASET_FILE).write_text(json.dumps(description, indent=1) + "\n")
        for path in tmp.rglob("*"):
            if path.is_file():
                files.set_default_mode(path)
    result = PrepareResult(output, counts.documents, counts.empty, counts.tokens, len(writer.shards),
                           time.perf_counter() - started, val_documents=counts.val_documents,
                           val_shards=len(val_writer.shards))
    train_tokens = counts.tokens - counts.val_tokens
    if len(writer.shards) < MIN_TRAIN_SHARDS and train_tokens >= MIN_TRAIN_SHARDS * 1024:
        result.notes.append(
            f"warning: the training split is {len(writer.shards)} shard file(s); parallel downloads, max_files and "
            f"val_files work by file, so for {MIN_TRAIN_SHARDS}+ files prepare it again with --shard-tokens "
            f"{max(1024, train_tokens // MIN_TRAIN_SHARDS):,} (training works either way)")
    return result


def _tokenized(files_in, text_field, tok: TokenizerInfo, tok_obj, workers: int, counts: Counts):
    """Token arrays per batch of documents, in input order; tokenized here or in `workers` processes."""
    batches = _batches(files_in, text_field, counts)
    if workers == 1:
        for batch in batches:
            yield _encode(batch, tok_obj)
        return
    import multiprocessing

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one thread per worker process
    context = multiprocessing.get_context("spawn")  # the tokenizers library must not be forked after use
    with context.Pool(workers, initializer=_init_worker, initargs=(tok.json.decode("utf-8"),)) as pool:
        yield from pool.imap(_encode, batches, chunksize=1)


def _finished(output: Path, digest: str) -> dict | None:
    try:
        description = json.loads((output / DATASET_FILE).read_text())
    except (OSError, ValueError):
        return None
    return description if description.get("fingerprint") == digest else None


def upload(output: Path, url: str) -> int:
    """Uploads a prepared dataset with the verified upload path, dataset.json last. Returns the file count."""
    from utils.storage import make_client, upload_directory

    check_upload_url(url)
    return len(upload_directory(make_client(), output, url.rstrip("/"), last=(DATASET_FILE,)))


def report_line(result: PrepareResult) -> str:
    rate = result.tokens / result.seconds if result.seconds else 0.0
    if result.reused:
        return (f"{result.output} already holds this dataset ({result.documents:,} documents, {result.tokens:,} "
                f"tokens in {result.shards} shards); nothing to do")
    split = (f"; validation: {result.val_documents:,} documents in {result.val_shards} shard(s) under "
             f"{VAL_FOLDER}/" if result.val_shards else "; no validation split")
    return (f"prepared {result.documents:,} documents ({result.empty:,} empty skipped), {result.tokens:,} tokens in "
            f"{result.shards} training shard(s) in {result.output}{split}: {result.seconds:.1f} s, "
            f"{rate:,.0f} tokens/s")


def stderr_progress():
    """A tqdm bar of documents and tokens on a terminal; a plain line every 30 s otherwise."""
    from tqdm import tqdm

    if sys.stderr.isatty():
        bar = tqdm(unit=" docs", desc="prepare", dynamic_ncols=True)

        def update(documents, tokens):
            bar.update(documents - bar.n)
            bar.set_postfix_str(f"{tokens:,} tokens", refresh=False)
        update.close = bar.close
        return update
    last = [time.monotonic()]

    def update(documents, tokens):
        if time.monotonic() - last[0] >= 30:
            print(f"prepare: {documents:,} documents, {tokens:,} tokens", file=sys.stderr, flush=True)
            last[0] = time.monotonic()
    update.close = lambda: None
    return update


# -------------------------------------------------------------------------- before any work (hardening)

DISK_FULL_ADVICE = "free space there and run the same command again: nothing was published"


def check_upload_url(url: str | None) -> None:
    """`--upload` must be a gs:// URL: checked before tokenizing, not after."""
    from utils.storage import parse_gs_url

    if url is None:
        return
    try:
        parse_gs_url(url)
    except ValueError as exc:
        raise PrepareError(f"--upload {url}: {exc}") from None


def lock_output(output) -> "OutputDirLock":
    """Holds `--output` for this run (a hidden `.NAME.lock` beside it) so that a second prepare_data on the
    same output is refused at start instead of both reporting success; `release()` it at the end."""
    from utils.lock import OutputDirLock

    output = Path(output)
    if output.exists() and not output.is_dir():
        raise PrepareError(f"--output {output} is a file; give a folder to create (or an empty one)")
    lock = OutputDirLock(output, lock_path=output.parent / f".{output.name}.lock", option="--output")
    lock.acquire(log=lambda msg: None)
    return lock
