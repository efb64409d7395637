"""`dataset.json`: what prepare_data.py writes beside the shards it makes, and what train.py reads from a
data directory to size the model's vocabulary by the tokenizer (and check ids against its real size).

    {"format": "gpt-neox-shards", "version": 1,
     "tokenizer": {"file": "tokenizer.json", "vocab_size": 50277, "eos_id": 0, "eos_token": "<|endoftext|>"},
     "dtype": "uint16", "documents": 1200, "documents_empty": 3, "tokens": 1843200, "shard_tokens": 16777216,
     "shards": [{"path": "part-00000/shard-00000.npz", "tokens": 1834000, "bytes": 3668258,
                 "crc32c": "AbCd1w==", "partition": 0}],
     "validation": {"documents": 12, "tokens": 9200, "fraction": 0.005, "rate": 0.005, "seed": 1234,
                    "shards": [{"path": "val/part-00000/shard-00000.npz", ...}]},
     "inputs": [{"path": "corpus/a.jsonl", "bytes": 5012}],
     "settings": {"text_field": "text", "eos_token": null, "shard_tokens": 16777216},
     "partitions": 1, "plan": "plan.json", "fingerprint": "9f2c..."}

`documents` and `tokens` count the whole corpus, both splits; `shards` are the training split's (each
with the partition that made it) and `validation` (absent in datasets prepared before it existed) the
held-out documents', with the rate applied (`fraction`, raised for a small corpus). Datasets prepared
before partitions have `"stride"` there instead and no `partitions`. It carries no timestamp, so the same
corpus prepared twice gives the same bytes. Every path it names (shards, the
tokenizer) is relative and stays inside its folder, symlinks followed; `load` refuses one that leaves it,
and a tokenizer file there other than the one it records (sha256: the shards' ids would mean other text).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import numpy as np

from utils.io import files
from utils.data.tokenizer import FILE as TOKENIZER_FILE
from utils.errors import UserError

MAX_DEFLATE_RATIO = 1032  # the most zlib's deflate compresses: a shard's bytes hold at most this many of its own
FILE = "dataset.json"
FORMAT = "gpt-neox-shards"
VERSION = 1


class DatasetInfoError(UserError, ValueError):
    """A dataset.json that cannot be used; the message names the file."""


@dataclass(frozen=True)
class DatasetInfo:
    path: Path
    vocab_size: int  # the tokenizer's ids, added tokens included: every id in the shards is below it
    eos_id: int
    eos_token: str
    dtype: str
    documents: int
    tokens: int
    shards: tuple[dict, ...]
    raw: dict

    @property
    def train_paths(self) -> list[str]:
        """The training split's shard files (relative paths)."""
        return [s["path"] for s in self.shards]

    @property
    def val_paths(self) -> list[str]:
        """The validation split's shard files (relative paths); empty without one."""
        return [s["path"] for s in (self.raw.get("validation") or {}).get("shards", [])]

    @property
    def tokenizer_sha256(self) -> str | None:
        """The sha256 of the tokenizer file the shards were made with (prepare_data.py records it)."""
        return self.raw["tokenizer"].get("sha256")

    @property
    def tokenizer_file(self) -> Path:
        return self.path.parent / self.raw["tokenizer"].get("file", TOKENIZER_FILE)

    @classmethod
    def load(cls, data_dir, check_tokenizer: bool = True) -> "DatasetInfo | None":
        """The dataset.json in `data_dir`, or None when there is none; with `check_tokenizer`, its tokenizer file
        must be the one it records (check_tokenizer)."""
        path = Path(data_dir) / FILE
        if not path.exists():
            return None
        try:
            raw = files.parse_json(files.read_text(path))  # a FIFO named dataset.json: refused, never waited on
            _check_fields(path, raw)
            tok = raw["tokenizer"]
            info = cls(path=path, vocab_size=int(tok["vocab_size"]), eos_id=int(tok["eos_id"]),
                       eos_token=str(tok.get("eos_token")), dtype=str(raw["dtype"]), documents=int(raw["documents"]),
                       tokens=int(raw["tokens"]), shards=tuple(raw["shards"]), raw=raw)
        except DatasetInfoError:
            raise
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DatasetInfoError(f"{path} is not a readable dataset description ({type(exc).__name__}: {exc}); "
                                   f"rerun prepare_data.py or remove the file") from None
        version = raw.get("version", 0)
        if raw.get("format") != FORMAT or type(version) is not int or version > VERSION:
            raise DatasetInfoError(f"{path}: format {raw.get('format')!r} version {raw.get('version')} is not "
                                   f"{FORMAT!r} up to version {VERSION}; update the code or rerun prepare_data.py")
        if info.vocab_size < 1 or not 0 <= info.eos_id < info.vocab_size:
            raise DatasetInfoError(f"{path}: vocab_size {info.vocab_size} and eos_id {info.eos_id} do not fit together")
        info._check_paths()
        if check_tokenizer:
            info.check_tokenizer()
        return info

    def _check_paths(self) -> None:
        """Every path this file names stays in its folder (a crafted one could name any file on the machine,
        and the tokenizer is copied into final_model/)."""
        try:
            named = [("tokenizer.file", self.raw["tokenizer"].get("file", TOKENIZER_FILE))]
            named += [("shards", p) for p in self.train_paths] + [("validation.shards", p) for p in self.val_paths]
        except (AttributeError, KeyError, TypeError) as exc:
            raise DatasetInfoError(f"{self.path}: a shard entry has no path ({type(exc).__name__}: {exc}); rerun "
                                   f"prepare_data.py or remove the file") from None
        for entry, rel in named:
            if not files.inside(self.path.parent, rel):
                raise DatasetInfoError(f"{self.path}: {entry} names {rel!r}, which leaves {self.path.parent} (an "
                                       f"absolute path, '..' or a symlink out); a dataset names only files inside "
                                       f"its folder: fix the entry or rerun prepare_data.py")


    def check_tokenizer(self) -> None:
        """The tokenizer file beside the shards is the one they were made with (the sha256 prepare_data.py
        recorded): another one would train, sample and export with ids that mean other text. Checked where the
        file is there (a streamed dataset's may not be)."""
        import hashlib

        recorded, file = self.tokenizer_sha256, self.tokenizer_file
        if recorded is None or not file.exists():
            return
        try:
            actual = hashlib.sha256(files.read_bytes(file)).hexdigest()
        except OSError as exc:  # a FIFO, a device or a folder of that name; a file this user may not read
            raise DatasetInfoError(f"{self.path} names the tokenizer {file}, which cannot be read ({exc})") from None
        if actual != recorded:
            raise DatasetInfoError(f"{file} has sha256 {actual[:16]}..., not the {recorded[:16]}... that {self.path} "
                                   f"records: the shards were made with another tokenizer; put back the "
                                   f"{file.name} prepare_data.py wrote beside them, or prepare the data again")


def _check_fields(path: Path, raw) -> None:
    """dataset.json's values (it may come from a bucket, or be crafted) before anything uses them: counts are
    non-negative integers (a string, 1e15 or -5 is refused, not read), the dtype a shard's, each shard entry a
    plain relative file path with its tokens and bytes, each listed once in one split (prepare_data.py never
    lists one twice: twice it would train twice an epoch, in both splits it would be validated on what was
    trained on, silently either way), and no shard holds more tokens than its bytes can. DatasetInfoError naming
    the file and field."""
    from utils.data.shards import ALLOWED_DTYPES

    def bad(field: str, value, want: str):
        raise DatasetInfoError(f"{path}: {field} is {value!r}, not {want}; rerun prepare_data.py or fix the entry")

    def count(value, field: str) -> int:
        if type(value) is not int or value < 0:
            bad(field, value, "a non-negative integer")
        return value

    if not isinstance(raw, dict) or not isinstance(raw.get("tokenizer"), dict):
        bad("tokenizer", raw.get("tokenizer") if isinstance(raw, dict) else raw, "an object")
    count(raw["tokenizer"].get("vocab_size"), "tokenizer.vocab_size")
    count(raw["tokenizer"].get("eos_id"), "tokenizer.eos_id")
    digest = raw["tokenizer"].get("sha256")
    if digest is not None and not (isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest)):
        bad("tokenizer.sha256", digest, "a sha256 (64 hex digits)")
    count(raw.get("documents"), "documents")
    count(raw.get("tokens"), "tokens")
    if raw.get("dtype") not in ALLOWED_DTYPES:
        bad("dtype", raw.get("dtype"), f"one of {', '.join(ALLOWED_DTYPES)}")
    itemsize = np.dtype(raw["dtype"]).itemsize
    splits = [("shards", raw.get("shards"))]
    if raw.get("validation") is not None:
        if not isinstance(raw["validation"], dict):
            bad("validation", raw["validation"], "an object")
        splits.append(("validation.shards", raw["validation"].get("shards", [])))
    listed: dict[str, str] = {}  # path -> the field that lists it
    for name, shards in splits:
        if not isinstance(shards, list):
            bad(name, shards, "a list")
        for i, shard in enumerate(shards):
            field = f"{name}[{i}]"
            if not isinstance(shard, dict):
                bad(field, shard, "an object")
            rel = shard.get("path")
            if (not isinstance(rel, str) or not rel or rel == "." or "\0" in rel
                    or PurePosixPath(rel).as_posix() != rel):
                bad(f"{field}.path", rel, "the relative path of a file (as part-00000/shard-00000.npz)")
            if rel in listed:
                raise DatasetInfoError(f"{path}: {field}.path names {rel}, which {listed[rel]} names too: a shard is "
                                       f"listed once, in one split (twice it would be trained on twice an epoch, or "
                                       f"validated on after training on it); rerun prepare_data.py or fix the entry")
            listed[rel] = f"{field}.path"
            tokens, size = count(shard.get("tokens"), f"{field}.tokens"), count(shard.get("bytes"), f"{field}.bytes")
            if not isinstance(shard.get("crc32c", ""), str):
                bad(f"{field}.crc32c", shard["crc32c"], "a string")
            if tokens * itemsize > size * MAX_DEFLATE_RATIO + 4096:
                raise DatasetInfoError(f"{path}: {field}.tokens is {tokens:,}, more {raw['dtype']} tokens than its "
                                       f"{size:,} bytes can hold; rerun prepare_data.py or fix the entry")


def end_of_document_id(data_dirs) -> int | None:
    """The EOS id the data's documents end with: the first data directory's dataset.json (prepare_data.py),
    or the demo build's record; None where neither says."""
    from utils.data import demo

    for data_dir in data_dirs:
        info = DatasetInfo.load(data_dir)
        if info is not None:
            return info.eos_id
        if demo.is_built(data_dir):
            return json.loads((Path(data_dir) / demo.MANIFEST).read_text())["eos_id"]
    return None
