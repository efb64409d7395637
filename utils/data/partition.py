"""The partition plan of a prepare run, the validation rule, and the work of one partition.

The plan: the inputs, sorted, with their sizes, laid end to end and cut every `partition_bytes` bytes into
P partitions, so P comes from the data (never from the number of workers). A `.jsonl` or `.parquet` is cut
anywhere, at the byte (a range holds the lines, or row groups, that start in it: utils/data/corpus.py), so
one 50 GB file spreads over many partitions; a `.txt` (one document) and a `.gz` (a stream read from its
start) stay whole in the partition where they start. A last partition smaller than half the target joins
the one before, as the last shard of a partition does. The plan is a JSON document whose digest covers the
inputs (path, size, mtime or crc32c), the tokenizer, the settings and the cut; a staging area, a completion
record and a finished `dataset.json` all carry it, so nothing made from other inputs is ever taken for done.

Validation, by documents: a document is held out when a seeded hash of (its file's key, its position in
the file) falls below the validation rate. Each partition decides alone, and a document's fate is the same
whatever the partitioning or the executor. The rate is `--val-fraction`, raised for a small corpus so
validation still holds about MIN_VAL_DOCUMENTS documents (at most a quarter of them): the plan counts the
corpus's documents, reading no further than the 100 / fraction documents that show it is big enough, and
records the rate every partition applies.

One partition: its documents in order, each tokenized and followed by the EOS id, the training ones cut into
shards of `shard_tokens` ids (the last between half a shard and one and a half, or the partition's
remainder when it holds less), the validation ones kept as one array (the merge cuts the validation shards
from all partitions' arrays, so a partition's few validation documents never make a shard too short to
train from), then a completion record naming each file's size and crc32c, written last.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from utils.data.corpus import InputFile, PrepareError, read_documents
from utils.debug import partition_delay_s

PLAN_FORMAT = "gpt-neox-prepare-plan"
PLAN_VERSION = 1
PLAN_FILE = "plan.json"
RECORD_FILE = "done.json"
VAL_PIECE = "val.npz"
DEFAULT_PARTITION_BYTES = 128_000_000
MIN_VAL_DOCUMENTS = 100
MAX_RAISED_VAL_RATE = 0.25
BATCH_DOCUMENTS = 256
BATCH_CHARS = 1 << 20
# A document longer than this is encoded in pieces of about this many characters, each cut just before a
# space between two words (where byte-level BPE and SentencePiece pre-tokenizers cut anyway, so the ids
# are the whole document's), and its ids joined: a tokenizer's memory follows the piece, not the document.
PIECE_CHARS = 256 << 10


# ------------------------------------------------------------------------------------------------ the split

@dataclass(frozen=True)
class DocumentSplit:
    rate: float
    seed: int

    def is_validation(self, key: str, position: int) -> bool:
        if self.rate <= 0:
            return False
        digest = hashlib.blake2b(f"{self.seed}\0{key}\0{position}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") < self.rate * 2**64


def validation_rate(inputs: list[InputFile], text_field: str, fraction: float) -> float:
    """`fraction`, raised for a corpus of fewer than MIN_VAL_DOCUMENTS / fraction documents (see the module
    docstring); reads the corpus only that far."""
    if fraction <= 0:
        return 0.0
    enough = math.ceil(MIN_VAL_DOCUMENTS / fraction)
    documents = 0
    for source in inputs:
        for _, text in read_documents(source, text_field):
            documents += bool(text.strip())
            if documents >= enough:
                return fraction
    return max(fraction, min(MAX_RAISED_VAL_RATE, MIN_VAL_DOCUMENTS / documents)) if documents else fraction


# ------------------------------------------------------------------------------------------------ the plan

Piece = tuple[int, int, int]  # (input index, start byte, end byte)


def cut(inputs: list[InputFile], partition_bytes: int) -> list[list[Piece]]:
    """The inputs end to end, cut every `partition_bytes` (see the module docstring)."""
    partitions: list[list[Piece]] = []
    current: list[Piece] = []
    filled = 0
    for index, source in enumerate(inputs):
        position = 0
        while True:
            take = min(source.bytes - position, partition_bytes - filled) if source.splittable else source.bytes
            current.append((index, position, position + take))
            position, filled = position + take, filled + take
            if filled >= partition_bytes:
                partitions.append(current)
                current, filled = [], 0
            if position >= source.bytes:
                break
    if current:
        if partitions and filled < partition_bytes // 2:
            partitions[-1] = _joined(partitions[-1] + current)
        else:
            partitions.append(current)
    return partitions


def _joined(pieces: list[Piece]) -> list[Piece]:
    """Adjacent ranges of one file as one range (the same lines: those starting in either)."""
    out: list[Piece] = []
    for piece in pieces:
        if out and out[-1][0] == piece[0] and out[-1][2] == piece[1]:
            out[-1] = (piece[0], out[-1][1], piece[2])
        else:
            out.append(piece)
    return out


@dataclass(frozen=True)
class Plan:
    inputs: tuple[InputFile, ...]
    partitions: tuple[tuple[Piece, ...], ...]
    document: dict  # what plan.json holds
    digest: str

    @property
    def count(self) -> int:
        return len(self.partitions)

    def json_bytes(self) -> bytes:
        """plan.json: a line per setting, per input and per partition."""
        lines = []
        for key, value in self.document.items():
            if isinstance(value, list):
                items = ",\n  ".join(json.dumps(item) for item in value)
                lines.append(f' "{key}": [\n  {items}\n ]')
            else:
                lines.append(f' "{key}": {json.dumps(value)}')
        return ("{\n" + ",\n".join(lines) + "\n}\n").encode()


def make_plan(inputs: list[InputFile], partition_bytes: int, tokenizer: dict, settings: dict,
              split: DocumentSplit) -> Plan:
    """`tokenizer`: its sha256 and ids; `settings`: everything else the shards depend on."""
    partitions = cut(inputs, partition_bytes)
    identity = hashlib.sha256()
    for source in inputs:
        identity.update(f"{source.path}\t{source.key}\t{source.bytes}\t{source.stamp}\n".encode())
    document = {
        "format": PLAN_FORMAT, "version": PLAN_VERSION,
        "inputs_sha256": identity.hexdigest(), "tokenizer": tokenizer, "settings": settings,
        "validation": {"rate": split.rate, "seed": split.seed}, "partition_bytes": partition_bytes,
        "partitions": [[list(piece) for piece in pieces] for pieces in partitions],
    }
    digest = hashlib.sha256(json.dumps(document, sort_keys=True).encode()).hexdigest()
    document = {**document, "sha256": digest,
                "inputs": [{"path": s.location, "key": s.key, "bytes": s.bytes} for s in inputs]}
    return Plan(tuple(inputs), tuple(tuple(p) for p in partitions), document, digest)


# --------------------------------------------------------------------------------------------- one partition

class ShardWriter:
    """Cuts a token stream into 1-D shards of `shard_tokens` ids (the last takes the remainder), written
    under `root` as `name(k)`, each handed to `publish(path, name)` once written."""

    def __init__(self, root: Path, shard_tokens: int, dtype: np.dtype, name: Callable[[int], str],
                 publish: Callable[[Path, str], None] = lambda path, name: None):
        self.root, self.shard_tokens, self.dtype, self.name, self.publish = root, shard_tokens, dtype, name, publish
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
        name = self.name(len(self.shards))
        self.shards.append(save_shard(self.root, name, ids))
        self.publish(self.root / name, name)


def save_shard(root: Path, name: str, ids: np.ndarray) -> dict:
    """One 1-D shard file -> its entry: path (`name`), tokens, bytes, crc32c."""
    from utils.io.storage import file_crc32c

    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        np.savez(f, input_ids=np.ascontiguousarray(ids))
    return {"path": name, "tokens": int(ids.size), "bytes": path.stat().st_size, "crc32c": file_crc32c(path)}


def partition_folder(store, index: int) -> str:
    return f"{store.staging}/p{index:05d}"


@dataclass(frozen=True)
class PartitionJob:
    """Everything one partition's task needs (picklable: it travels to pool workers and Ray tasks)."""
    index: int
    plan: str  # the plan's digest, copied into the record
    pieces: tuple[tuple[InputFile, int, int], ...]
    store: object  # utils.data.output_store.LocalOutput | BucketOutput
    text_field: str
    shard_tokens: int
    dtype: str
    eos_id: int
    split: DocumentSplit


def partition_jobs(plan: Plan, indices: list[int], store, text_field: str, shard_tokens: int, dtype: str,
                   eos_id: int, split: DocumentSplit) -> list[PartitionJob]:
    return [PartitionJob(p, plan.digest, tuple((plan.inputs[i], start, end) for i, start, end in plan.partitions[p]),
                         store, text_field, shard_tokens, dtype, eos_id, split) for p in indices]


_TOKENIZER: dict = {}  # the last tokenizer this process built, by its JSON text


def _tokenizer(text: str):
    if _TOKENIZER.get("text") != text:
        from tokenizers import Tokenizer

        _TOKENIZER.update(text=text, tokenizer=Tokenizer.from_str(text))
    return _TOKENIZER["tokenizer"]


def tokenize_partition(job: PartitionJob, tokenizer_json: str) -> dict:
    """Writes one partition's shards and validation array under its staging folder, then its completion
    record; returns the record."""
    tokenizer = _tokenizer(tokenizer_json)
    store, folder = job.store, partition_folder(job.store, job.index)
    dtype = np.dtype(job.dtype)
    eos = np.array([job.eos_id], dtype=np.int64)
    record = {"partition": job.index, "plan": job.plan, "documents": 0, "documents_empty": 0, "tokens": 0,
              "validation": {"documents": 0, "tokens": 0}}
    with store.scratch(folder) as work:
        train = ShardWriter(work, job.shard_tokens, dtype, name=lambda k: f"shard-{k:05d}.npz",
                            publish=lambda path, name: store.publish(path, f"{folder}/{name}"))
        held_out: list[np.ndarray] = []
        pending: list[np.ndarray] = []  # the ids of a long document's pieces so far
        for batch in _batches(job, record):
            encoded = tokenizer.encode_batch([text for _, text, _ in batch], add_special_tokens=False)
            for (is_validation, _, ends), enc in zip(batch, encoded):
                pending.append(np.asarray(enc.ids, dtype=np.int64))
                if not ends:
                    continue
                document, pending = np.concatenate((*pending, eos)), []
                if not (document[:-1] != job.eos_id).any():  # only end-of-document tokens (its text is the
                    record["documents_empty"] += 1         # EOS token's string): no content, as an empty one
                    continue
                if is_validation:
                    held_out.append(document.astype(dtype))
                    record["validation"]["documents"] += 1
                    record["validation"]["tokens"] += document.size
                else:
                    train.add(document)
                record["documents"] += 1
                record["tokens"] += document.size
        train.close()
        record["shards"] = train.shards
        if held_out:
            piece = save_shard(work, VAL_PIECE, np.concatenate(held_out))
            store.publish(work / VAL_PIECE, f"{folder}/{VAL_PIECE}")
            record["validation"].update({k: piece[k] for k in ("path", "bytes", "crc32c")})
    delay = partition_delay_s()  # fault injection: a slow worker, for the tests that kill one
    if delay:
        time.sleep(delay)
    store.write_bytes(f"{folder}/{RECORD_FILE}", (json.dumps(record, indent=1) + "\n").encode())
    return record


def _batches(job: PartitionJob, record: dict) -> Iterator[list[tuple[bool, str, bool]]]:
    """(is validation, text, ends its document) of the partition's non-empty documents in order, a long
    one in pieces (`split_document`), in batches; empty ones are counted in `record` and skipped (as are, once
    tokenized, those of end-of-document tokens alone: tokenize_partition)."""
    batch, chars = [], 0
    for source, start, end in job.pieces:
        for position, text in read_documents(source, job.text_field, start, end):
            if not text.strip():
                record["documents_empty"] += 1
                continue
            is_validation = job.split.is_validation(source.key, position)
            pieces = split_document(text)
            for k, piece in enumerate(pieces):
                batch.append((is_validation, piece, k == len(pieces) - 1))
                chars += len(piece)
                if len(batch) >= BATCH_DOCUMENTS or chars >= BATCH_CHARS:
                    yield batch
                    batch, chars = [], 0
    if batch:
        yield batch


def split_document(text: str, piece_chars: int = PIECE_CHARS) -> list[str]:
    """`text` cut into pieces of about `piece_chars` characters, each cut just before a space that stands
    between two non-space characters (searched back up to a quarter piece; a text without one there is cut
    where the piece ends)."""
    if len(text) <= piece_chars:
        return [text]
    pieces, begin = [], 0
    while len(text) - begin > piece_chars:
        target = begin + piece_chars
        cut, floor = target, max(begin + 1, target - piece_chars // 4)
        while (cut := text.rfind(" ", floor, cut)) >= floor:
            if not text[cut - 1].isspace() and not text[cut + 1].isspace():
                break
        if cut < floor:
            cut = target
        pieces.append(text[begin:cut])
        begin = cut
    pieces.append(text[begin:])
    return pieces


def json_object(raw: bytes | None) -> dict | None:
    """A JSON object from a file prepare wrote (plan.json, done.json, dataset.json: maybe from a bucket, maybe
    crafted), or None for anything else: no file, not JSON, too deeply nested to parse, not an object."""
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def staged_plan_digest(raw: bytes | None) -> str | None:
    """The digest a staging area's plan.json names (None: no plan.json; "" one that names none). Only the
    digest is read, and only a plan.json naming this run's own digest is taken for it: the partitions are
    always this run's plan's, never the file's."""
    if raw is None:
        return None
    plan = json_object(raw)
    digest = plan.get("sha256") if plan is not None else None
    return digest if isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest) else ""


def read_record(store, plan: Plan, index: int) -> dict | None:
    """Partition `index`'s completion record when there is one made under this plan, else None."""
    record = json_object(store.read_bytes(f"{partition_folder(store, index)}/{RECORD_FILE}"))
    if not (isinstance(record, dict) and record.get("plan") == plan.digest and record.get("partition") == index):
        return None
    check_record(record, f"{store.url(partition_folder(store, index))}/{RECORD_FILE}", index)
    return record


_SHARD_NAME = re.compile(r"shard-\d{5,}\.npz")  # what tokenize_partition names a partition's shards


def check_record(record: dict, where: str, index: int) -> None:
    """A completion record (maybe from a bucket, maybe crafted) as tokenize_partition writes it: counts are
    non-negative integers, and every shard it names is a shard file of its own partition folder (a path such
    as ../../x would have the merge move a file from anywhere into the dataset). PrepareError naming the field."""
    def bad(field: str, what: str):
        raise PrepareError(f"{where}: {field} {what}; remove that file and run the same command again to redo "
                           f"partition {index}")

    def count(value, field: str) -> None:
        if type(value) is not int or value < 0:
            bad(field, f"is {value!r}, not a non-negative integer")

    for key in ("documents", "documents_empty", "tokens"):
        count(record.get(key), key)
    validation, shards = record.get("validation"), record.get("shards")
    if not isinstance(validation, dict):
        bad("validation", "is missing or not an object")
    for key in ("documents", "tokens") + (("bytes",) if validation.get("documents") else ()):
        count(validation.get(key), f"validation.{key}")
    if not isinstance(shards, list):
        bad("shards", "is missing or not a list")
    for i, shard in enumerate(shards):
        if not isinstance(shard, dict):
            bad(f"shards[{i}]", "is not an object")
        if not isinstance(shard.get("path"), str) or not _SHARD_NAME.fullmatch(shard["path"]):
            bad(f"shards[{i}].path", f"{shard.get('path')!r} is not a shard file of the partition's folder "
                                     f"(shard-NNNNN.npz)")
        for key in ("tokens", "bytes"):
            count(shard.get(key), f"shards[{i}].{key}")
