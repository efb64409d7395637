"""A corpus and a tokenizer -> production shards: what `prepare_data.py` runs.

Inputs (utils/data/corpus.py), local or `gs://`, in sorted path order: plain text (`.txt`, one document
per file), JSON Lines (`.jsonl`, one document per line in a text field) and the `.gz` of either, and
Parquet (a text column) when pyarrow is installed. Each document is tokenized (no special tokens added)
and followed by the tokenizer's EOS id, and the stream is cut into 1-D shards of `shard_tokens` ids
(uint16, or uint32 when the vocabulary exceeds 65,536 ids). A document may span two shards: the loader
cuts `seq_len` windows from the stream either way.

At scale, in three steps (datatrove's and Megatron's shape). The plan (utils/data/partition.py) cuts the
inputs into partitions by bytes and fixes the validation rule: a seeded hash of (file, position) per
document, so each partition decides alone. An executor (utils/data/executors.py: a local process pool,
or Ray tasks) tokenizes each partition into its own shards, whose last is the partition's remainder, and
a completion record, under a staging area beside the output; a rerun skips every partition whose record
was made under the same plan. The merge reads the records in partition order, refuses a missing one
naming it, renames the shards into the final `part-NNNNN/shard-NNNNN.npz` numbering, cuts the validation
split's shards under `val/` from the partitions' held-out documents, and writes `tokenizer.json`,
`plan.json` and `dataset.json`, last. So the output, on disk or in a bucket (written straight there,
utils/data/output_store.py), is byte-identical whatever the executor, the number of workers or of reruns.

Atomic on disk: the dataset is assembled inside the hidden staging folder and renamed into place whole,
so a killed run leaves no shard where training would find it. In a bucket `dataset.json`, written last,
marks it done. A run on a finished output with the same inputs, tokenizer and settings does nothing.
"""
from __future__ import annotations

import hashlib
import io
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from utils.io import files
from utils.data.corpus import InputFile, PrepareError, list_inputs
from utils.data.dataset_info import FILE as DATASET_FILE
from utils.data.dataset_info import FORMAT, VERSION
from utils.data.executors import make_executor
from utils.data.output_store import LocalOutput, output_store
from utils.data.tokenizer import EOS_CANDIDATES, GPT2_FILES, read_tokenizer
from utils.data.tokenizer import FILE as TOKENIZER_FILE
from utils.data.partition import (DEFAULT_PARTITION_BYTES, PLAN_FILE, VAL_PIECE, DocumentSplit, Plan, ShardWriter,
                                  json_object, make_plan, partition_folder, partition_jobs, read_record,
                                  staged_plan_digest, validation_rate)

# 2^24 ids per shard: 32 MiB as uint16. Big enough that a bucket holds thousands, not millions, of objects
# and each download is efficient; small enough that the last `val_files` shards held out for validation are
# a small share of a modest corpus, and that a failed download costs little.
DEFAULT_SHARD_TOKENS = 1 << 24
DEFAULT_VAL_FRACTION = 0.005
DEFAULT_SPLIT_SEED = 1234
# Fewer training shards than this and what works by file (parallel downloads, max_files, val_files) has
# little to work with: prepare warns, naming --shard-tokens.
MIN_TRAIN_SHARDS = 8
VAL_FOLDER = "val"
SHARDS_PER_FOLDER = 256
STORE_THREADS = 16  # a bucket's small reads and renames at once
SHORT_SHARD_TOKENS = 2048  # the seq_len of the GPT-NeoX models: a shorter shard holds no training sequence


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


# ------------------------------------------------------------------------------------------------ driver

@dataclass
class PrepareResult:
    output: str
    documents: int
    empty: int
    tokens: int
    shards: int
    seconds: float
    reused: bool = False
    val_documents: int = 0
    val_shards: int = 0
    partitions: int = 0
    partitions_done_before: int = 0
    tokens_tokenized: int = 0  # by this run (a rerun skips what earlier runs did)
    startup_seconds: float = 0.0  # the executor's start (the pool's processes, Ray)
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class PrepareOptions:
    """prepare_data.py's options (its --help says each)."""

    workers: int = 1
    text_field: str = "text"
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    eos_token: str | None = None
    val_fraction: float = DEFAULT_VAL_FRACTION
    split_seed: int = DEFAULT_SPLIT_SEED
    partition_bytes: int = DEFAULT_PARTITION_BYTES
    executor: str = "local"
    ray_address: str | None = None
    merge_only: bool = False

    def check(self) -> None:
        if self.shard_tokens < 1024:
            raise PrepareError(f"--shard-tokens {self.shard_tokens} is too small; use at least 1024 (default "
                               f"{DEFAULT_SHARD_TOKENS})")
        if self.workers < 1:
            raise PrepareError(f"--workers must be at least 1, got {self.workers}")
        if not 0 <= self.val_fraction < 0.5:
            raise PrepareError(f"--val-fraction {self.val_fraction} must be within [0, 0.5) (0: no validation split)")
        if self.partition_bytes < 1:
            raise PrepareError(f"--partition-mb must be above 0 (default {DEFAULT_PARTITION_BYTES / 1e6:g})")


def prepare(inputs: list[str], tokenizer: str, output, options: PrepareOptions = PrepareOptions(),
            progress: Callable[[int, int, int], None] | None = None,
            log: Callable[[str], None] = lambda line: None) -> PrepareResult:
    """Tokenizes `inputs` into shards + tokenizer.json + plan.json + dataset.json at `output`, a folder or
    gs://BUCKET/PREFIX (see the module docstring). `progress(partitions done, partitions, tokens)`."""
    started = time.perf_counter()
    options.check()
    runner = make_executor(options.executor, options.workers, options.ray_address)
    store = output_store(output)
    sources = list_inputs(inputs)
    tok_obj, tok = load_tokenizer(tokenizer, options.eos_token)
    dataset = DatasetPlan.make(sources, tok, options)
    plan = dataset.plan
    with files.disk_full_guard(store.disk, advice=DISK_FULL_ADVICE):
        done = _finished(store, plan)
        if done is not None:
            store.remove(store.staging)  # left by a run killed after its dataset.json
            return PrepareResult(str(store.output), done["documents"], done["documents_empty"], done["tokens"],
                                 len(done["shards"]), time.perf_counter() - started, reused=True,
                                 partitions=plan.count, partitions_done_before=plan.count)
        finished = _staging(store, plan, log)
        total = sum(s.bytes for s in sources)
        log(f"plan: {plan.count} partition(s) of about {options.partition_bytes / 1e6:g} MB from {len(sources)} "
            f"input file(s), {total / 1e6:,.1f} MB; {len(finished)} of {plan.count} partitions already done")
        tokenized = 0
        if not options.merge_only:
            todo = sorted(set(range(plan.count)) - set(finished))
            jobs = partition_jobs(plan, todo, store, options.text_field, options.shard_tokens, dataset.dtype.name,
                                  tok.eos_id, dataset.split)
            done_count = len(finished)
            for record in runner.run(jobs, tok_obj.to_str()):
                done_count += 1
                tokenized += record["tokens"]
                if progress:
                    progress(done_count, plan.count, tokenized)
        description = _merge(store, dataset)
    result = PrepareResult(str(store.output), description["documents"], description["documents_empty"],
                           description["tokens"], len(description["shards"]), time.perf_counter() - started,
                           val_documents=description["validation"]["documents"],
                           val_shards=len(description["validation"]["shards"]), partitions=plan.count,
                           partitions_done_before=len(finished), tokens_tokenized=tokenized,
                           startup_seconds=runner.startup_seconds)
    result.notes += _warnings(description)
    return result


@dataclass(frozen=True)
class DatasetPlan:
    """What a prepare run makes, decided before any work: the partition plan, the validation split, the
    shards' dtype and the settings dataset.json records."""

    plan: Plan
    split: DocumentSplit
    tok: TokenizerInfo
    dtype: np.dtype
    sources: list
    options: PrepareOptions
    settings: dict

    @classmethod
    def make(cls, sources: list, tok: TokenizerInfo, options: PrepareOptions) -> "DatasetPlan":
        dtype = np.dtype(np.uint16 if tok.vocab_size <= 65536 else np.uint32)
        settings = {"text_field": options.text_field, "eos_token": tok.eos_token, "shard_tokens": options.shard_tokens,
                    "val_fraction": options.val_fraction, "split_seed": options.split_seed}
        split = DocumentSplit(validation_rate(sources, options.text_field, options.val_fraction), options.split_seed)
        plan = make_plan(sources, options.partition_bytes, {"sha256": tok.digest, "vocab_size": tok.vocab_size,
                                                            "eos_id": tok.eos_id, "eos_token": tok.eos_token},
                         settings, split)
        return cls(plan, split, tok, dtype, sources, options, settings)


def threaded_map(fn: Callable, items, threads: int, name: str) -> list:
    """[fn(item) for item in items] on up to `threads` daemon threads (a bucket's many small calls at once).
    The first exception in any of them is raised here at once: the others take no new item, and nothing
    waits for the calls still under way (daemon threads: not at exit either), so a dead or stuck thread never
    holds prepare; a stop signal reaches this (main) thread within a fraction of a second."""
    import threading

    items = list(items)
    results: list = [None] * len(items)
    failed: list[BaseException] = []
    lock, done = threading.Lock(), threading.Event()
    state = {"next": 0, "left": len(items)}

    def work() -> None:
        while not failed:
            with lock:
                i = state["next"]
                if i >= len(items):
                    return
                state["next"] += 1
            try:
                results[i] = fn(items[i])
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread, raised there
                with lock:
                    failed.append(exc)
                done.set()
                return
            with lock:
                state["left"] -= 1
                if not state["left"]:
                    done.set()

    if not items:
        return results
    for k in range(min(threads, len(items))):
        threading.Thread(target=work, name=f"{name}-{k}", daemon=True).start()
    while not done.wait(0.2):
        pass
    if failed:
        raise failed[0]
    return results


def _staging(store, plan: Plan, log: Callable[[str], None]) -> list[int]:
    """Readies the staging area for `plan` (an earlier run's under another plan is discarded); returns the
    partitions already done under this one."""
    staged = _staged_plan(store)
    ours = staged == plan.digest
    local = isinstance(store, LocalOutput)
    if store.holds_anything(store.name) and (local or not ours):  # in a bucket: maybe our interrupted merge
        raise PrepareError(f"--output {store.output} is not empty (and holds no dataset prepared from these "
                           f"inputs and settings); choose a new folder or empty it")
    if local:
        store.base.mkdir(parents=True, exist_ok=True)
        files.remove_stale_temps(store.base)
    if not ours:
        if staged is not None:
            log(f"discarding {store.url(store.staging)}: an earlier run's partitions of other inputs or settings")
        store.remove(store.staging)
        store.write_bytes(f"{store.staging}/{PLAN_FILE}", plan.json_bytes())
    return [p for p, record in enumerate(_records(store, plan)) if record is not None]


def _records(store, plan: Plan) -> list[dict | None]:
    """Each partition's completion record made under `plan`, or None; read in parallel (a bucket's
    thousands of small reads)."""
    return threaded_map(lambda p: read_record(store, plan, p), range(plan.count), STORE_THREADS, "prepare-records")


def _warnings(description: dict) -> list[str]:
    notes = []
    short = [s for s in description["shards"] + description["validation"]["shards"] if s["tokens"] < SHORT_SHARD_TOKENS]
    if short:
        notes.append(f"warning: {len(short)} shard(s) hold fewer than {SHORT_SHARD_TOKENS:,} tokens (e.g. "
                     f"{short[0]['path']}: {short[0]['tokens']:,}), the last of a partition holding little text; "
                     f"training refuses a shard shorter than its seq_len: a larger --partition-mb (or corpus) avoids them")
    train_tokens = description["tokens"] - description["validation"]["tokens"]
    suggested = max(1024, train_tokens // MIN_TRAIN_SHARDS)
    if len(description["shards"]) < MIN_TRAIN_SHARDS and suggested < description["shard_tokens"]:
        notes.append(f"warning: the training split is {len(description['shards'])} shard file(s); parallel downloads, "
                     f"max_files and val_files work by file, so for {MIN_TRAIN_SHARDS}+ files prepare it again with "
                     f"--shard-tokens {suggested:,} (training works either way)")
    return notes


def shard_name(folder: str, k: int) -> str:
    """The final layout: SHARDS_PER_FOLDER shards per part-NNNNN/ folder, numbered across the dataset."""
    return f"{folder}part-{k // SHARDS_PER_FOLDER:05d}/shard-{k:05d}.npz"


def _merge(store, dataset: DatasetPlan) -> dict:
    """Partitions' records in order -> the dataset's layout, dataset.json last (see the module docstring).
    Safe to repeat after an interruption: a shard already moved is found in its final place."""
    plan, tok, dtype, split, sources = dataset.plan, dataset.tok, dataset.dtype, dataset.split, dataset.sources
    shard_tokens, val_fraction, settings = dataset.options.shard_tokens, dataset.options.val_fraction, dataset.settings
    records = _records(store, plan)
    if None in records:
        p = records.index(None)
        raise PrepareError(f"partition {p} of {plan.count} has no completion record "
                           f"({store.url(partition_folder(store, p))}/done.json): it was never finished, or "
                           f"the record was removed; run the same command without --merge-only to redo it")
    counts = {key: sum(r[key] for r in records) for key in ("documents", "documents_empty", "tokens")}
    if counts["documents"] == 0:
        raise PrepareError(f"the corpus is empty: {len(sources)} input file(s), {counts['documents_empty']} empty "
                           f"document(s) (no text, or only end-of-document tokens: the tokenizer's "
                           f"{tok.eos_token!r}) and nothing else")
    moves, shards = [], []
    for p, record in enumerate(records):
        for shard in record["shards"]:
            final = shard_name("", len(shards))
            moves.append((p, f"{partition_folder(store, p)}/{shard['path']}", f"{store.assembly}/{final}", shard["bytes"]))
            shards.append({**shard, "path": final, "partition": p})
    threaded_map(lambda move: _move_shard(store, *move), moves, STORE_THREADS, "prepare-merge")
    with store.scratch(store.assembly) as work:
        held_out = ShardWriter(work, shard_tokens, dtype, name=lambda k: shard_name(f"{VAL_FOLDER}/", k),
                               publish=lambda path, name: store.publish(path, f"{store.assembly}/{name}"))
        for p, record in enumerate(records):
            if record["validation"]["documents"]:
                held_out.add(_validation_piece(store, p, record))
        held_out.close()
    description = {
        "format": FORMAT, "version": VERSION,
        "tokenizer": {"file": TOKENIZER_FILE, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
                      "eos_token": tok.eos_token, "sha256": tok.digest},
        "dtype": dtype.name, **counts, "shard_tokens": shard_tokens, "shards": shards,
        "validation": {"documents": sum(r["validation"]["documents"] for r in records),
                       "tokens": sum(r["validation"]["tokens"] for r in records),
                       "fraction": val_fraction, "rate": split.rate, "seed": split.seed,
                       "shards": held_out.shards},
        "inputs": [{"path": s.location, "bytes": s.bytes} for s in sources],
        "settings": settings, "partitions": plan.count, "plan": PLAN_FILE, "fingerprint": plan.digest,
    }
    store.write_bytes(f"{store.assembly}/{TOKENIZER_FILE}", tok.json)
    store.write_bytes(f"{store.assembly}/{PLAN_FILE}", plan.json_bytes())
    store.write_bytes(f"{store.assembly}/{DATASET_FILE}", (json.dumps(description, indent=1) + "\n").encode())
    store.finish()
    store.remove(store.staging)
    return description


def _move_shard(store, partition: int, source: str, dest: str, size: int) -> None:
    if store.size(source) == size:
        store.move(source, dest)
    elif store.size(dest) != size:  # not moved by an earlier, interrupted merge either
        raise PrepareError(f"{store.url(source)}: missing, not a regular file of its partition's folder (a symlink), "
                           f"or not the {size:,} bytes its partition's record says; remove "
                           f"{store.url(partition_folder(store, partition))}/done.json and run the same command again "
                           f"to redo partition {partition}")


def _validation_piece(store, partition: int, record: dict) -> np.ndarray:
    from utils.io.storage import bytes_match

    name = f"{partition_folder(store, partition)}/{VAL_PIECE}"
    raw = store.read_bytes(name)
    try:
        if bytes_match(raw, record["validation"]["bytes"], record["validation"]["crc32c"]):
            return np.load(io.BytesIO(raw), allow_pickle=False)["input_ids"]
    except Exception:  # noqa: BLE001 - not a shard (zipfile, numpy and KeyError alike): the same line below
        pass
    raise PrepareError(f"{store.url(name)}: missing, not a regular file of its partition's folder (a symlink), or "
                       f"not what its partition's record says; remove {store.url(partition_folder(store, partition))}"
                       f"/done.json and run the same command again to redo partition {partition}")


def _staged_plan(store) -> str | None:
    """The digest of the plan in the staging area, if there is one."""
    return staged_plan_digest(store.read_bytes(f"{store.staging}/{PLAN_FILE}"))


def _finished(store, plan: Plan) -> dict | None:
    """The output's dataset.json when it was made under `plan` and is whole (_check_reused), else None."""
    from utils.data.dataset_info import _check_fields

    description = json_object(store.read_bytes(f"{store.name}/{DATASET_FILE}"))
    if description is None or description.get("fingerprint") != plan.digest:
        return None
    _check_fields(store.url(f"{store.name}/{DATASET_FILE}"), description)  # read for the report: its counts
    _check_reused(store, description)
    return description


def _check_reused(store, description: dict) -> None:
    """A finished output taken as done (its dataset.json names this plan) is what the merge writes: its counts add
    up, its shards are the merge's names in order, and each is there, a regular file of the size listed
    (a crafted or damaged dataset.json would otherwise be reported done, and uploaded, as it stands)."""
    where = store.url(f"{store.name}/{DATASET_FILE}")

    def bad(problem: str):
        raise PrepareError(f"{where}: {problem}; remove {store.output} (or the file) and run the same command again")

    validation = description.get("validation")
    if not isinstance(validation, dict) or not isinstance(validation.get("shards"), list):
        bad("validation is missing or has no shard list")
    for key, value in (("documents_empty", description.get("documents_empty")),
                       ("validation.documents", validation.get("documents")),
                       ("validation.tokens", validation.get("tokens"))):
        if type(value) is not int or value < 0:
            bad(f"{key} is {value!r}, not a non-negative integer")
    splits = (("shards", "", description["shards"]), ("validation.shards", f"{VAL_FOLDER}/", validation["shards"]))
    for listing, folder, shards in splits:
        for k, shard in enumerate(shards):
            if shard["path"] != shard_name(folder, k):
                bad(f"{listing}[{k}].path is {shard['path']!r}, not {shard_name(folder, k)!r} (the merge's name)")
    val_tokens = sum(s["tokens"] for s in validation["shards"])
    if validation["tokens"] != val_tokens or description["tokens"] != val_tokens + sum(
            s["tokens"] for s in description["shards"]):
        bad(f"its token counts do not add up (tokens {description['tokens']:,}, validation.tokens "
            f"{validation['tokens']:,}, its shards' {val_tokens + sum(s['tokens'] for s in description['shards']):,})")
    listed = [s for _, _, shards in splits for s in shards]
    sizes = threaded_map(lambda s: store.size(f"{store.name}/{s['path']}"), listed, STORE_THREADS, "prepare-reuse")
    wrong = next((s for s, size in zip(listed, sizes) if size != s["bytes"]), None)
    if wrong is not None:
        bad(f"it lists {wrong['path']}, which is missing, not a regular file (a symlink) or not its {wrong['bytes']:,} "
            f"bytes")


def upload(output: Path, url: str) -> int:
    """Uploads a prepared dataset with the verified upload path, dataset.json last. Returns the file count."""
    from utils.io.storage import make_client, upload_directory

    check_upload_url(url)
    return len(upload_directory(make_client(), output, url.rstrip("/"), last=(DATASET_FILE,)))


def report_line(result: PrepareResult) -> str:
    if result.reused:
        return (f"{result.output} already holds this dataset ({result.documents:,} documents, {result.tokens:,} "
                f"tokens in {result.shards} shards); nothing to do")
    split = (f"; validation: {result.val_documents:,} documents in {result.val_shards} shard(s) under "
             f"{VAL_FOLDER}/" if result.val_shards else "; no validation split")
    before = f", {result.partitions_done_before} done by an earlier run" if result.partitions_done_before else ""
    rate = result.tokens_tokenized / result.seconds if result.seconds else 0.0
    return (f"prepared {result.documents:,} documents ({result.empty:,} empty skipped), {result.tokens:,} tokens in "
            f"{result.shards} training shard(s) in {result.output}{split}; {result.partitions} partition(s){before}: "
            f"{result.seconds:.1f} s, {rate:,.0f} tokens/s")


def stderr_progress():
    """A tqdm bar of partitions and tokens on a terminal; a plain line every 30 s otherwise."""
    from tqdm import tqdm

    if sys.stderr.isatty():
        bar = tqdm(unit=" partitions", desc="prepare", dynamic_ncols=True)

        def update(done, total, tokens):
            bar.total = total
            bar.update(done - bar.n)
            bar.set_postfix_str(f"{tokens:,} tokens", refresh=False)
        update.close = bar.close
        return update
    last = [time.monotonic()]

    def update(done, total, tokens):
        if time.monotonic() - last[0] >= 30:
            print(f"prepare: {done} of {total} partitions, {tokens:,} tokens", file=sys.stderr, flush=True)
            last[0] = time.monotonic()
    update.close = lambda: None
    return update


# -------------------------------------------------------------------------- before any work (hardening)

DISK_FULL_ADVICE = ("free space there and run the same command again: nothing was published, and the "
                    "partitions already done are kept")


def check_upload_url(url: str | None) -> None:
    """`--upload` must be a gs:// URL: checked before tokenizing, not after."""
    from utils.io.storage import parse_gs_url

    if url is None:
        return
    try:
        parse_gs_url(url)
    except ValueError as exc:
        raise PrepareError(f"--upload {url}: {exc}") from None


def lock_output(output) -> "OutputDirLock":
    """Holds `--output` for this run (a hidden `.NAME.lock` beside it) so that a second prepare_data on the
    same output is refused at start instead of both reporting success; `release()` it at the end."""
    from utils.io.lock import OutputDirLock

    output = Path(output)
    if output.exists() and not output.is_dir():
        raise PrepareError(f"--output {output} is a file; give a folder to create (or an empty one)")
    lock = OutputDirLock(output, lock_path=output.parent / f".{output.name}.lock", option="--output")
    lock.acquire(log=lambda msg: None)
    return lock


class BucketLock:
    """A gs:// `--output` held for this run, as lock_output holds a folder: the object `.NAME.lock` beside the
    prefix (host, pid, start), created only where there is none (`if_generation_match=0`: atomic in GCS), so a
    second prepare_data on the same prefix is refused at start instead of both publishing and the first one's
    report being false. A lock whose holder is a dead process of this host is taken over."""

    def __init__(self, url: str):
        from utils.data.output_store import BucketOutput
        from utils.io.storage import parse_gs_url

        store = BucketOutput(url)
        self.output, self.url = store.output, store.url(f".{store.name}.lock")
        self.bucket, self.name = parse_gs_url(self.url)
        self.generation = None

    def acquire(self) -> "BucketLock":
        import os
        import socket

        from utils.io.storage import make_client, retry_call, short_error

        record = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started_unix": time.time()})
        try:
            blob = make_client().bucket(self.bucket).blob(self.name)
            for _ in range(2):
                # bounded retries (the client's own go on for minutes while GCS does not answer)
                if retry_call(lambda: blob.exists(retry=None, timeout=30), what=f"checking {self.url}"):
                    held = self._held(blob)
                    if held.get("host") == socket.gethostname() and not files.pid_alive(int(held.get("pid") or 0)):
                        blob.delete()  # its holder died: taken over
                        continue
                    raise PrepareError(f"--output {self.output} is being prepared by another prepare_data.py (host "
                                       f"{held.get('host', '?')}, pid {held.get('pid', '?')}); wait for it to finish, "
                                       f"or if it is gone, remove {self.url}")
                blob.upload_from_string(record, content_type="application/json", if_generation_match=0)
                self.generation = blob.generation
                return self
        except PrepareError:
            raise
        except Exception as exc:  # noqa: BLE001 - GCS unreachable, a precondition lost to another run: one line
            raise PrepareError(f"--output {self.output}: cannot take its lock {self.url} ({short_error(exc)}); "
                               f"check the network / GCS (or another run took it) and run again") from None
        raise PrepareError(f"--output {self.output}: cannot take its lock {self.url}; run again")

    @staticmethod
    def _held(blob) -> dict:
        try:
            held = json.loads(blob.download_as_bytes())
            return held if isinstance(held, dict) else {}
        except Exception:  # noqa: BLE001 - unreadable or gone meanwhile: held by someone unknown
            return {}

    def release(self) -> None:
        from utils.io.storage import make_client, retry_call

        if self.generation is None:
            return
        blob = make_client().bucket(self.bucket).blob(self.name)
        try:  # bounded: a prepare that failed because GCS went away must not then wait minutes on its lock
            retry_call(lambda: blob.delete(if_generation_match=self.generation, retry=None, timeout=30),
                       what=f"removing {self.url}", retries=3)
        except Exception:  # noqa: BLE001 - gone already, or GCS away: a dead holder's lock is taken over
            pass
        self.generation = None
