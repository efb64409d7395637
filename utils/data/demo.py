"""The demo corpus: Python's own standard library, tokenized into shards, with no network and no credentials.

`build_demo_data(data_dir, vocab_size, seq_len)` reads the standard library's `.py` files (sorted by path,
shuffled with a fixed seed, capped at a few MB), trains a byte-level BPE tokenizer of exactly `vocab_size` ids with the EOS token at
id 0, and writes shards in the production format (docs/contracts.md "The shard format") into a nested tree:

    data_dir/part-00/shard-00000.npz ... data_dir/part-03/shard-00019.npz   (1-D token streams)
    two of them hold 2-D [rows, seq_len] sequences instead, so both shard layouts are exercised
    data_dir/tokenizer.json                                                 (the trained tokenizer)
    data_dir/demo_data.json                                                 (what was built, for reuse)

The build happens in a hidden sibling folder that is renamed to `data_dir` only when complete, so a killed
build leaves nothing that looks like data. The same machine always builds identical shards.
"""
from __future__ import annotations

import json
import random
import sysconfig
import time
from pathlib import Path
from typing import Callable

import numpy as np

from utils.io import files
from utils.data.tokenizer import FILE as TOKENIZER_FILE
from utils.errors import UserError

EOS_TOKEN = "<|endoftext|>"
EOS_ID = 0
MANIFEST = "demo_data.json"
CORPUS_BYTES = 6_000_000  # ~1.9M tokens at vocab 2048: enough for the demo preset, built in seconds
NUM_SHARDS = 20
SHARDS_PER_PART = 5
TWO_D_SHARDS = (3, 11)  # shard numbers stored as [rows, seq_len]; both inside the training split
# Folders of the standard library left out: installed packages, test suites, codec tables.
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__",
                       "encodings"})


class DemoDataError(UserError, RuntimeError):
    """The demo data directory cannot be used as asked; the message says why and what to do."""


def shard_paths(data_dir: Path) -> list[Path]:
    return sorted(Path(data_dir).rglob("*.npz"))


def is_built(data_dir: Path) -> bool:
    data_dir = Path(data_dir)
    return (data_dir / MANIFEST).is_file() and (data_dir / TOKENIZER_FILE).is_file() and bool(shard_paths(data_dir))


def build_demo_data(data_dir, vocab_size: int, seq_len: int, log: Callable[[str], None] = print) -> Path:
    """Build the demo shards and tokenizer into `data_dir` (a no-op when they are already there)."""
    data_dir = Path(data_dir)
    if is_built(data_dir):
        _check_reusable(data_dir, vocab_size, seq_len)
        return data_dir
    if data_dir.exists() and not data_dir.is_dir():
        raise DemoDataError(f"data_dir {data_dir} is a file; point the run at a folder")
    if data_dir.exists() and any(data_dir.iterdir()):
        raise DemoDataError(
            f"{data_dir} is not empty but holds no complete demo build ({MANIFEST}, {TOKENIZER_FILE} and "
            f"shards); point the run at another data_dir or remove that folder"
        )
    if vocab_size < 300:
        raise DemoDataError(f"vocab_size={vocab_size} is too small for a byte-level BPE (needs 257 + merges)")

    started = time.perf_counter()
    data_dir.parent.mkdir(parents=True, exist_ok=True)
    files.remove_stale_temps(data_dir.parent)
    try:
        with files.write_guard(data_dir, advice=f"free space there or point data_dir at a disk with room; nothing was "
                               f"written to {data_dir}"), \
                files.atomic_directory(data_dir, replace=False) as tmp:
            names, texts = read_stdlib_corpus(CORPUS_BYTES)
            log(f"demo data: {len(texts)} standard-library files, {sum(map(len, texts)) / 1e6:.1f} MB of text")
            tokenizer = train_tokenizer(texts, vocab_size)
            tokenizer.save(str(tmp / TOKENIZER_FILE))
            stream = encode_documents(tokenizer, texts)
            shards = write_shards(tmp, stream, seq_len)
            manifest = {
                "vocab_size": vocab_size, "seq_len": seq_len, "eos_id": EOS_ID, "eos_token": EOS_TOKEN,
                "documents": len(texts), "tokens": int(stream.size), "shards": shards,
                "source": "python standard library", "python": sysconfig.get_python_version(),
                "first_file": names[0], "last_file": names[-1],
            }
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    except FileExistsError:
        if not is_built(data_dir):
            raise
        return data_dir  # a concurrent build won; its shards are identical
    log(f"demo data: {stream.size:,} tokens in {len(shards)} shards, vocab {vocab_size}, "
        f"written to {data_dir} in {time.perf_counter() - started:.1f}s")
    return data_dir


def read_stdlib_corpus(max_bytes: int = CORPUS_BYTES) -> tuple[list[str], list[str]]:
    """Standard-library `.py` files in a fixed shuffled order, until `max_bytes` of text: (names, texts)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    candidates = sorted(
        (p.relative_to(root).as_posix(), p) for p in root.rglob("*.py")
        if not SKIP_DIRS.intersection(p.relative_to(root).parts)
    )
    # A fixed-seed shuffle of the sorted list: still deterministic, and the corpus and the held-out last
    # shards are samples of the whole library rather than its alphabetical tail.
    random.Random(0).shuffle(candidates)
    names, texts, total = [], [], 0
    for name, path in candidates:
        try:
            text = path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if not text.strip() or EOS_TOKEN in text:
            continue
        names.append(name)
        texts.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    if not texts:
        raise DemoDataError(f"no readable .py files under the standard library at {root}")
    return names, texts


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE with exactly `vocab_size` ids; EOS is id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    if tokenizer.token_to_id(EOS_TOKEN) != EOS_ID or tokenizer.get_vocab_size() != vocab_size:
        raise DemoDataError(
            f"the trained tokenizer has {tokenizer.get_vocab_size()} ids and EOS id "
            f"{tokenizer.token_to_id(EOS_TOKEN)}; expected {vocab_size} ids with EOS at {EOS_ID} "
            f"(is the corpus too small for this vocab_size?)"
        )
    return tokenizer


def encode_documents(tokenizer, texts: list[str]) -> np.ndarray:
    """All documents as one uint16 stream, each followed by EOS."""
    if tokenizer.get_vocab_size() > np.iinfo(np.uint16).max + 1:
        raise DemoDataError("vocab_size above 65536 does not fit the uint16 shard format")
    parts = []
    for enc in tokenizer.encode_batch(texts, add_special_tokens=False):
        parts.append(np.asarray(enc.ids, dtype=np.uint16))
        parts.append(np.array([EOS_ID], dtype=np.uint16))
    return np.concatenate(parts)


def write_shards(out_dir: Path, stream: np.ndarray, seq_len: int) -> list[dict]:
    """Cut the stream into NUM_SHARDS about equal pieces, at document ends where one is near, and save them
    as `part-PP/shard-NNNNN.npz`."""
    ends = np.flatnonzero(stream == EOS_ID) + 1  # positions just after each document
    size = stream.size
    slack = size // (4 * NUM_SHARDS)
    bounds = [0]
    for k in range(1, NUM_SHARDS):
        # Cut at the first document end within a quarter shard after the even split point, else at that
        # point itself (inside a long document): shards stay about equal whatever the document order.
        target = k * size // NUM_SHARDS
        i = int(np.searchsorted(ends, target))
        bounds.append(int(ends[i]) if i < ends.size and ends[i] <= target + slack else target)
    bounds.append(size)
    if min(b - a for a, b in zip(bounds, bounds[1:])) < 2 * seq_len:
        raise DemoDataError(f"the corpus ({size:,} tokens) is too small for {NUM_SHARDS} shards of "
                            f"at least {2 * seq_len} tokens")

    shards = []
    for k in range(NUM_SHARDS):
        tokens = stream[bounds[k]:bounds[k + 1]]
        if k in TWO_D_SHARDS:
            rows = tokens.size // seq_len
            if rows == 0:
                raise DemoDataError(f"shard {k} has fewer than seq_len={seq_len} tokens")
            tokens = tokens[: rows * seq_len].reshape(rows, seq_len)
        rel = Path(f"part-{k // SHARDS_PER_PART:02d}") / f"shard-{k:05d}.npz"
        (out_dir / rel.parent).mkdir(exist_ok=True)
        np.savez(out_dir / rel, input_ids=np.ascontiguousarray(tokens, dtype=np.uint16))
        shards.append({"path": rel.as_posix(), "shape": list(tokens.shape)})
    return shards


def _check_reusable(data_dir: Path, vocab_size: int, seq_len: int) -> None:
    manifest = json.loads((data_dir / MANIFEST).read_text())
    if (manifest.get("vocab_size"), manifest.get("seq_len")) != (vocab_size, seq_len):
        raise DemoDataError(
            f"{data_dir} holds demo data built for vocab_size={manifest.get('vocab_size')} "
            f"seq_len={manifest.get('seq_len')}, but this run needs vocab_size={vocab_size} seq_len={seq_len}; "
            f"use another data_dir (e.g. --set data_dir={data_dir}-{vocab_size}-{seq_len}) or remove that folder"
        )
