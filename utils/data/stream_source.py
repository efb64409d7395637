"""The "stream" source type: a prepared dataset in GCS (`data_dir=gs://BUCKET/PREFIX`, or a gs:// path in
`data_mix`) trained on without downloading it first.

The index comes from the dataset's `dataset.json` (prepare_data.py's: every shard's path, tokens, bytes and
crc32c), fetched with its tokenizer.json into `data_cache_dir/BUCKET/PREFIX/` (what sizes the vocabulary,
and what samples and exports read). A shard's sequences are its tokens // seq_len, as ShardIndex counts a
1-D shard, and the files are ordered and split as ShardIndex orders and splits a downloaded copy, so the
fingerprint, the cursor, the order and the checkpoint names are the copy's: a checkpoint of one resumes on
the other, and the losses are the same bit for bit.

Fetching happens in one place per training process: the `ShardFetcher` of each streamed source, whose cache
is `data_cache_dir/BUCKET/PREFIX/rank-R/` (locked for the run; files a previous run left there are reused
once they pass the checks). The loader hands it this rank's schedule of reads (ReadAhead,
utils/data/source.py); a coordinating thread walks the schedule ahead of the loop, as far as the cache's
share of `data_cache_gb` allows, and a few threads download the shards in the order they are first read,
each verified (size and crc32c against dataset.json, utils/io/storage.download_verified, retried) and checked
against the shard format (ids below the vocabulary, the sequences dataset.json promised) under a hidden
name before it is renamed into place. It is not fsynced: a copy a crash tore fails those checks when the next
run finds it and is fetched again, and a download waiting on the disk would stall behind any other writer on
the machine (a checkpoint's, another run's), draining the cache's lead on the loop. A shard no micro-batch
of the window reads any more is removed when room is needed, so files on disk + downloads in flight never
exceed the share. The cache is the engine's: what finished runs left in its other rank-R/ folders (those no
live run holds) makes room first, when the disk cannot hold this process's share of `data_cache_gb` or a
dataset's description (`evict_leftovers`).

DataLoader workers never fetch: they read only what this process fetched. A micro-batch goes to a worker
only once the fetcher holds its files (`handed_out`); the worker waits for a file's final name to appear
(present means checked) or for the `.unavailable` note the fetcher leaves beside it when it gives up; and
no reader keeps a descriptor or a mapping past its batch, so an evicted file frees its disk at once.

A shard that stays unavailable (its download retried, or failing its checks) is named in one line by
`wait_ready`, which the loop asks at every step boundary: the run then stops with a checkpoint, every rank
at the same step (train.py). The loop waits on GCS only when the files of its next step are not yet here.

The validation split is read into memory when the eval batches are made (once, before training): it never
takes room in the cache.
"""
from __future__ import annotations

import fcntl
import io
import itertools
import math
import os
import stat
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

import numpy as np

from utils.io import files

from utils.runtime import signals
from utils.data.dataset import TokenSequenceDataset
from utils.data.dataset_info import FILE as DATASET_FILE
from utils.data.dataset_info import DatasetInfo, DatasetInfoError
from utils.data.index import DataDirError, ShardIndex
from utils.data.shards import INPUT_KEY, ShardError, ShardInfo, ShardLayout, check_header, check_vocab, inspect_shard, read_layout
from utils.data.source import GB, CacheBudget, DataUnavailable, OpenRequest, Source, SourceType
from utils.data.tokenizer import FILE as TOKENIZER_FILE
from utils.errors import THREAD_FAILED, BackgroundFailure, DiskFullError, UserError
from utils.io.lock import LOCK_FILE, OutputDirLock
from utils.io.storage import (RemoteObject, StorageError, bytes_match, download_verified, file_crc32c, gs_url, join_name,
                           make_client, parse_gs_url, read_object, short_error, thread_client)

FETCH_THREADS = 4  # downloads in flight per source and process
FETCH_RETRIES = 5  # a failed download is tried this many more times (with backoff) before its shard is unavailable
LOOKAHEAD_BATCHES = 20_000  # the fetcher walks at most this many micro-batches ahead of the loop
SCAN_CHUNK = 64  # micro-batches of the schedule the coordinator reads between taking its lock
POLL_S = 0.005  # how often a DataLoader worker looks for a file the fetcher has not finished yet
UNAVAILABLE = ".unavailable"  # the empty note beside a file the fetcher gave up on (the line why stays in-process)
LOCK_ROOM = 4096  # bytes kept out of the cache's share for its lock file
WAIT_SLICE_S = 0.5  # a wait on the fetcher's threads: between two slices it looks for a dead thread and a stop signal
DESCRIPTION_ROOM = 16 << 20  # room made on a full cache disk for a tokenizer.json (Llama 3's: 9 MB) and dataset.json
CACHE_FULL_ADVICE = ("free space there, set data_cache_dir to a folder on a disk with room, or lower data_cache_gb to "
                     "what it holds")


class StreamError(UserError):
    """A gs:// dataset that cannot be streamed as configured; the message names it and what to do."""


def is_gcs(source: Source) -> bool:
    return isinstance(source.path, str) and source.path.startswith("gs://")


def cache_root(cache_dir: str) -> Path:
    """data_cache_dir, or by default a folder of this user's in the system's temporary directory (local disk
    on each node: a shared output folder would make every node's cache traffic network traffic)."""
    if cache_dir:
        return Path(cache_dir).expanduser().resolve()
    return Path(tempfile.gettempdir()) / f"gpt-neox-data-cache-{os.getuid()}"


_DESCRIBED: dict[tuple[str, str], Path] = {}  # (url, data_cache_dir) -> folder, fetched once per process
_DESCRIBED_LOCK = threading.Lock()


def description_dir(source: Source, cache_dir: str) -> Path:
    """The local folder holding the dataset's dataset.json and tokenizer.json: fetched there from the bucket
    (once per process, written atomically, so the node's processes may race). On a disk full of what earlier
    runs left in the cache, their shards make room first (evict_leftovers)."""
    url = source.path.rstrip("/")
    with _DESCRIBED_LOCK:
        if (url, cache_dir) in _DESCRIBED:
            return _DESCRIBED[url, cache_dir]
        bucket, prefix = parse_gs_url(url)
        root, client = cache_root(cache_dir), make_client()
        description = read_object(client, gs_url(bucket, join_name(prefix, DATASET_FILE)))
        if description is None:
            raise StreamError(f"{url}/{DATASET_FILE} not found: training from gs:// reads the dataset description "
                              f"prepare_data.py writes (every shard's size and crc32c); prepare the data with --output "
                              f"{url}, or download the shards (download_training_data.py) and train from the copy")
        try:
            folder = _fetch_description(client, url, root, description)
        except DiskFullError:
            if not evict_leftovers(root, None, len(description) + DESCRIPTION_ROOM)[1]:
                raise
            folder = _fetch_description(client, url, root, description)
        _DESCRIBED[url, cache_dir] = folder
        return folder


def _fetch_description(client, url: str, root: Path, description: bytes) -> Path:
    """dataset.json (`description`) and the tokenizer.json it names, from the bucket into its folder under the
    cache's `root`, checked as the bucket's files (their errors name them). Returns the folder."""
    bucket, prefix = parse_gs_url(url)
    folder = root / bucket / prefix
    with files.write_guard(folder, advice=CACHE_FULL_ADVICE, denied_advice="set data_cache_dir to a folder you may "
                                                                           "write"):
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except (NotADirectoryError, FileExistsError):
            raise StreamError(f"data_cache_dir {root}: {folder} cannot be made there (a file is in the way); set "
                              f"data_cache_dir to a folder") from None
        files.write_bytes(folder / DATASET_FILE, description)
        try:
            info = DatasetInfo.load(folder, check_tokenizer=False)  # a stale cached tokenizer is replaced below
            tokenizer = info.raw["tokenizer"].get("file", TOKENIZER_FILE)
            text = read_object(client, gs_url(bucket, join_name(prefix, tokenizer)))
            if text is None:
                (folder / tokenizer).unlink(missing_ok=True)
            else:
                files.write_bytes(folder / tokenizer, text)
            info.check_tokenizer()
        except DatasetInfoError as exc:  # named as the bucket's files, not their cached copies
            raise DatasetInfoError(str(exc).replace(str(folder), url)) from None
    return folder


def evict_leftovers(root: Path, keep: Path | None, need: int) -> tuple[int, int]:
    """Removes shards earlier runs left in the cache under `root` (each rank-R/ folder no live run holds, but
    `keep`), least recently written first, until the disk has `need` bytes free or none is left. The cache is
    the engine's: a bound (data_cache_gb) or a full disk would otherwise fail on what finished runs left there.
    Returns (bytes, files) removed."""
    if files.free_bytes(root) >= need:
        return 0, 0
    held, leftovers = [], []
    try:
        for lock_path in sorted(root.glob(f"**/rank-*/{LOCK_FILE}")):
            if lock_path.parent == keep:
                continue
            fd = os.open(lock_path, os.O_RDWR | os.O_CLOEXEC)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # not written to: the disk may have no room
            except BlockingIOError:  # a live run streams there
                os.close(fd)
                continue
            held.append(fd)
            leftovers += [p for p in lock_path.parent.rglob("*") if p.name != LOCK_FILE and p.is_file()
                          and not p.is_symlink()]
        freed = count = 0
        for path in sorted(leftovers, key=lambda p: p.stat().st_mtime):
            if files.free_bytes(root) >= need:
                break
            freed, count = freed + path.stat().st_size, count + 1
            path.unlink()
        return freed, count
    finally:
        for fd in held:
            os.close(fd)


# ------------------------------------------------------------------------------------------------- opening


def open_stream(source: Source, request: OpenRequest) -> tuple["StreamedShards", "RemoteValidation"]:
    """(training, validation) sequences of a gs:// dataset: indexed from its dataset.json as ShardIndex indexes
    the downloaded copy (sorted paths, both splits; the same split and max_files rules)."""
    url = source.path.rstrip("/")
    folder = description_dir(source, request.cache_dir)
    info = DatasetInfo.load(folder)
    entries = {s["path"]: s for s in (*info.shards, *(info.raw.get("validation") or {}).get("shards", []))}
    listed = sorted(entries)
    val_paths = info.val_paths
    chosen = listed if val_paths or request.max_files < 0 else listed[:request.max_files]
    shards = []
    for rel in chosen:  # a 1-D token stream: the format's rules from its header, as ShardIndex checks them
        kind, count = check_header(f"{url}/{rel}", (int(entries[rel]["tokens"]),), np.dtype(info.dtype), request.seq_len)
        shards.append(ShardInfo(rel, kind, int(entries[rel]["tokens"]), count, info.dtype))
    cache = folder / f"rank-{request.rank}"
    index = ShardIndex(cache, request.seq_len, request.vocab_size, shards, {rel: None for rel in chosen})
    try:
        train, val = index.split_paths(val_paths, request.max_files) if val_paths else index.split(source.val_files)
    except DataDirError as exc:
        raise DataDirError(str(exc).replace(str(cache), url)) from None
    request.log(f"data: streaming {len(train)} shard file(s), {train.num_sequences:,} sequences of {request.seq_len} "
                f"tokens, from {url} (cached in {cache})" + (f"; validation on the {len(val)} shard(s) of its split"
                                                             if val_paths else ""))
    shuffle = request.shuffle
    sizes = sorted((int(entries[s.path]["bytes"]) for s in train.shards), reverse=True)
    at_once = shuffle.files_at_once([s.num_sequences for s in train.shards], request.step_sequences)
    described = sum(p.stat().st_size for p in folder.iterdir() if p.is_file()) + LOCK_ROOM
    need = sum(sizes[:at_once]) + described
    request.cache.reserve(source.name, need, f"source {source.name} ({url}) under {shuffle.describe()} reads "
                                             f"{'all ' if at_once == len(sizes) else 'up to '}{at_once} of its "
                                             f"{len(sizes)} shards at once, {need / GB:.3g} GB")
    share = _fetch_budget(request.cache, source.name, described)
    if share is not None:  # data_cache_gb: the disk holds this process's share, what earlier runs left going first
        freed, count = evict_leftovers(cache_root(request.cache_dir), cache, share - bytes_under(cache))
        if count:
            request.log(f"data: removed {count} shard file(s), {freed / 1e6:,.1f} MB, that earlier runs left in "
                        f"{cache_root(request.cache_dir)}, to make room for this run's share of data_cache_gb")
    fetcher = ShardFetcher(url, cache, [entries[s.path] for s in train.shards], request.seq_len, request.vocab_size,
                           budget=lambda: _fetch_budget(request.cache, source.name, described), log=request.log)
    return StreamedShards(train, url, fetcher), RemoteValidation(val, url, [entries[s.path] for s in val.shards])


def _fetch_budget(cache: CacheBudget, name: str, described: int) -> int | None:
    share = cache.share(name)
    return None if share is None else share - described


# ------------------------------------------------------------------------------------------------ fetching


class ShardFetcher:
    """One streamed source's cache in this process, and the threads that fill it (the module docstring).
    Files are numbered as the source's shards. Every state change happens under one lock, with three
    conditions on it: `_ready_cv` wakes readers (a file came or failed), `_plan_cv` the coordinator (there is
    something for it to do) and `_task_cv` a download thread; the loop's per-batch calls wake the coordinator
    only when it waits on them, so a quiet fetcher costs the loop nothing. Micro-batches in the window
    (scanned and not yet returned) decide which files are wanted."""

    def __init__(self, url: str, folder: Path, entries: list[dict], seq_len: int, vocab_size: int, budget, log):
        self.url, self.folder, self.seq_len, self.vocab_size, self.budget, self.log = (
            url, folder, seq_len, vocab_size, budget, log)
        self.bucket, self.prefix = parse_gs_url(url)
        self.rels = [e["path"] for e in entries]
        self.sizes = [int(e["bytes"]) for e in entries]
        self.crcs = [e.get("crc32c", "") for e in entries]
        self.sequences = [int(e["tokens"]) // seq_len for e in entries]
        self.cumulative = np.cumsum(self.sequences)
        self._lock_state = threading.Lock()
        self._ready_cv = threading.Condition(self._lock_state)
        self._plan_cv = threading.Condition(self._lock_state)
        self._task_cv = threading.Condition(self._lock_state)
        self._room_short = False  # the last fetch to start found no room
        self._wake_at = math.inf  # the returned micro-batch that gives the waiting coordinator something to do
        self._on_disk: dict[int, int] = {}  # file -> bytes, ready or left by an earlier run (not yet checked)
        self._ready: set[int] = set()
        self._inflight: set[int] = set()
        self._inflight_bytes = 0  # of downloads in flight not already on disk
        self._tasks: deque[int] = deque()
        self._workers: list[threading.Thread] = []
        self._generation = 0
        self._coordinator: threading.Thread | None = None
        self._said_stale = False  # whether a stale cached copy was said (once per run)
        self._died: str | None = None  # the line of a thread that failed: every wait returns it from then on
        self.peak_bytes = self.fetched = self.fetched_bytes = 0
        self._reset_window()
        self._lock = OutputDirLock(folder, option="data_cache_dir")
        self._lock.acquire(log)  # refused now, before training, if another run streams into this folder
        self._lock.release()

    def _reset_window(self) -> None:
        self._running = False
        self._window: deque[tuple[int, tuple[int, ...]]] = deque()  # (micro-batch, files it reads), in order
        self._uses: dict[int, int] = {}  # file -> window micro-batches reading it (present: wanted)
        self._last_use: dict[int, int] = {}  # wanted file -> the last window micro-batch reading it
        self._wanted_bytes = 0
        self._queue: deque[int] = deque()  # wanted files in the order they are first read
        self._failed: dict[int, str] = {}
        self._scanned = self._returned = self._handed = self._waiting = -1
        self._exhausted = False

    def path(self, f: int) -> Path:
        return self.folder / self.rels[f]

    def _adopt_leftovers(self) -> None:
        """Files an earlier run left: shards of the right size are kept (checked before first use); partial
        downloads, unchecked files, notes and anything not a regular file of its own (a FIFO, a socket, a
        symlink: reading a FIFO would wait for good) go."""
        index = {rel: f for f, rel in enumerate(self.rels)}
        self._on_disk = {f: b for f, b in self._on_disk.items() if f in self._inflight}
        self._ready -= set(self._ready) - set(self._on_disk)
        files.remove_stale_temps(self.folder, recursive=True)  # a killed run's partial downloads
        for dirpath, _, names in os.walk(self.folder):
            for name in names:
                path = Path(dirpath, name)
                rel = path.relative_to(self.folder).as_posix()
                f = index.get(rel)
                if rel == self._lock.path.name or f in self._inflight or files.is_temp_name(name):
                    continue  # the lock; a download still running in this process
                st = path.lstat()
                if f is not None and stat.S_ISREG(st.st_mode) and st.st_size == self.sizes[f]:
                    self._on_disk[f] = self.sizes[f]
                else:
                    path.unlink(missing_ok=True)
        self._measure()

    # -------------------------------------------------------------------------------- the loader's side

    def read_from(self, schedule) -> None:
        """Starts walking `schedule` (the cache folder is locked until stop())."""
        self.stop()
        self._lock.acquire(self.log)
        self._adopt_leftovers()
        with self._lock_state:
            for f in self._failed:  # tried again along the new schedule
                self.path(f).with_name(self.path(f).name + UNAVAILABLE).unlink(missing_ok=True)
            self._reset_window()
            self._running = True
            generation = self._generation
        while len(self._workers) < FETCH_THREADS:
            worker = threading.Thread(target=self._guarded(self._work), name=f"data-fetch-{len(self._workers)}",
                                      daemon=True)
            worker.start()
            self._workers.append(worker)
        self._coordinator = threading.Thread(target=self._guarded(self._coordinate), args=(schedule, generation),
                                             daemon=True, name="data-fetch-plan")
        self._coordinator.start()

    def handed_out(self, batch: int) -> None:
        with self._lock_state:
            self._handed = max(self._handed, batch)
            if batch > self._scanned:
                self._plan_cv.notify()

    def returned(self, batch: int) -> None:
        with self._lock_state:
            self._returned = max(self._returned, batch)
            self._expire()
            if batch >= self._wake_at:
                self._plan_cv.notify()

    def _guarded(self, target):
        """`target` for a thread: whatever it raises (a bug, MemoryError, an error inside an error handler) is kept
        as the one line every wait returns from then on, and every waiter wakes; nothing waits on it again."""
        def run(*args):
            try:
                target(*args)
            except BaseException as exc:  # noqa: BLE001 - handed to the loop, which stops with it
                self._fail(f"{THREAD_FAILED}: {threading.current_thread().name} of {self.url}: {short_error(exc)}")
        return run

    def _fail(self, line: str) -> None:
        with self._lock_state:
            if self._died is None:
                self._died = line
            self._ready_cv.notify_all()
            self._plan_cv.notify_all()
            self._task_cv.notify_all()

    def _check_threads(self) -> None:
        """Under the lock, while a schedule runs: a thread gone without a word (it cannot, guarded) is a failure."""
        dead = [t.name for t in [self._coordinator, *self._workers] if t is not None and not t.is_alive()]
        if dead and self._running and self._died is None:
            self._died = f"{THREAD_FAILED}: {dead[0]} of {self.url} is gone"

    def wait_ready(self, last_batch: int) -> str | None:
        """None once the files of micro-batches up to `last_batch` are here (or a stop signal came: the loop
        then stops), else the line naming what failed: a file that stayed unavailable, or a thread."""
        with self._lock_state:
            self._waiting = max(self._waiting, last_batch)
            if last_batch > self._scanned:
                self._plan_cv.notify()
            while True:
                if self._died is not None:
                    return self._died
                needed = {f for b, fs in itertools.takewhile(lambda e: e[0] <= last_batch, self._window) for f in fs}
                failed = sorted(f for f in needed if f in self._failed)
                if failed:
                    return self._failed[failed[0]]
                if (self._scanned >= last_batch or self._exhausted) and needed <= self._ready:
                    return None
                if not self._running or signals.stop_requested():
                    return None
                self._ready_cv.wait(WAIT_SLICE_S)
                self._check_threads()

    def wait_for(self, needed: list[int]) -> None:
        """In this process, before reading: until `needed` are here; fetched at once when no schedule runs."""
        with self._lock_state:
            while True:
                missing = [f for f in needed if f not in self._ready]
                if not missing:
                    return
                if self._died is not None:
                    raise BackgroundFailure(self._died)
                failed = [f for f in missing if f in self._failed]
                if failed:
                    raise DataUnavailable(self._failed[failed[0]])
                if not self._running:
                    todo = [f for f in missing if f not in self._inflight]
                    self._inflight.update(todo)
                    self._inflight_bytes += sum(self.sizes[f] for f in todo if f not in self._on_disk)
                    self._lock_state.release()
                    try:
                        for f in todo:
                            self._fetch(f)
                    finally:
                        self._lock_state.acquire()
                    continue
                if self._scanned >= self._handed and any(f not in self._uses for f in missing):
                    raise RuntimeError(f"{self.url}: a read outside the schedule the loader handed over (files "
                                       f"{missing[:3]})")
                self._plan_cv.notify()
                stop = signals.stop_requested()
                if stop:
                    raise signals.StoppedInSetup(stop, "waiting for the data of the first step")
                self._ready_cv.wait(WAIT_SLICE_S)
                self._check_threads()

    def stop(self) -> None:
        """Ends the current schedule: the coordinator stops, queued downloads are dropped (those in flight
        finish in their threads); the files stay."""
        with self._lock_state:
            was_running = self._running
            self._running = False
            self._generation += 1
            for f in self._tasks:
                self._inflight.discard(f)
                if f not in self._on_disk:
                    self._inflight_bytes -= self.sizes[f]
            self._tasks.clear()
            self._plan_cv.notify_all()
            self._ready_cv.notify_all()
        if self._coordinator is not None:
            self._coordinator.join(timeout=10)
            self._coordinator = None
        if was_running:
            self._lock.release()
            if self.fetched:
                budget = self.budget()
                bound = f"the {budget:,} bytes it may use" if budget is not None else "no bound"
                self.log(f"data: {self.url}: fetched {self.fetched} shard(s), {self.fetched_bytes:,} bytes; its cache "
                         f"{self.folder} peaked at {self.peak_bytes:,} bytes of {bound}")

    # ----------------------------------------------------------------------------------- the coordinator

    def _coordinate(self, schedule, generation: int) -> None:
        """Walks the schedule SCAN_CHUNK micro-batches at a time outside the lock, then admits them under it while
        they fit: taking the lock for each micro-batch scanned ahead would starve a reader waiting for it (Python's
        locks are not fair, and this thread holds the GIL between releasing and taking it again)."""
        pending: deque[tuple[int, tuple[int, ...]]] = deque()  # scanned, not yet admitted
        ended = False
        while True:
            with self._lock_state:
                if self._generation != generation:
                    return
                self._expire()
                while pending and self._admits(*pending[0]):
                    self._admit(*pending.popleft())
                if ended and not pending and not self._exhausted:
                    self._exhausted = True
                    self._ready_cv.notify_all()
                self._start_fetches()
                if pending or self._exhausted or not self._scanning():
                    self._wake_at = self._next_wake(bool(pending))
                    self._plan_cv.wait()
                    self._wake_at = math.inf
                    continue
                batch = self._scanned + 1
            for k in range(SCAN_CHUNK):
                try:
                    indices = next(schedule)
                except StopIteration:
                    ended = True
                    break
                pending.append((batch + k, tuple(sorted(set(
                    np.searchsorted(self.cumulative, indices, side="right").tolist())))))

    def _next_wake(self, admission_waits: bool) -> float:
        """The returned micro-batch after which the coordinator has something to do: waiting for room, the
        earliest last read of a wanted file (that file then frees); with the window at its longest, a quarter of
        it on. Otherwise only a micro-batch handed out beyond the window, or a fetch ending, wakes it."""
        if admission_waits or self._room_short:
            return min(self._last_use[f] for f in self._uses) if self._uses else -1
        if len(self._window) >= LOOKAHEAD_BATCHES:
            return self._window[0][0] + LOOKAHEAD_BATCHES // 4
        return math.inf

    def _must_cover(self) -> int:
        return max(self._handed, self._waiting, self._returned + 1)

    def _scanning(self) -> bool:
        """Whether to look further ahead: to cover a micro-batch handed out or waited for, or while the window
        is short and does not yet want every file."""
        return (self._scanned < self._must_cover()
                or (len(self._window) < LOOKAHEAD_BATCHES and len(self._uses) < len(self.rels)))

    def _admits(self, batch: int, needed: tuple[int, ...]) -> bool:
        budget = self.budget()
        if batch <= self._must_cover() or budget is None:
            return True
        return self._wanted_bytes + sum(self.sizes[f] for f in needed if f not in self._uses) <= budget

    def _admit(self, batch: int, needed: tuple[int, ...]) -> None:
        self._scanned = batch
        if batch <= self._returned:
            return
        self._window.append((batch, needed))
        for f in needed:
            if f not in self._uses:
                self._uses[f] = 0
                self._wanted_bytes += self.sizes[f]
                self._queue.append(f)
            self._uses[f] += 1
            self._last_use[f] = batch
        if batch <= self._must_cover():  # only a reader waits for the scan to reach a batch: waking it for every
            self._ready_cv.notify_all()  # batch scanned ahead would have it fight the coordinator for the lock

    def _expire(self) -> None:
        while self._window and self._window[0][0] <= self._returned:
            for f in self._window.popleft()[1]:
                self._uses[f] -= 1
                if not self._uses[f]:
                    del self._uses[f], self._last_use[f]
                    self._wanted_bytes -= self.sizes[f]

    def _start_fetches(self) -> None:
        """Wanted files in first-read order, while they fit: files no window micro-batch reads make room."""
        budget = self.budget()
        self._room_short = False
        while self._queue and len(self._inflight) < FETCH_THREADS:
            f = self._queue[0]
            if f not in self._uses or f in self._ready or f in self._inflight or f in self._failed:
                self._queue.popleft()
                continue
            new = 0 if f in self._on_disk else self.sizes[f]
            if budget is not None and not self._make_room(new, budget):
                self._room_short = True
                return
            self._queue.popleft()
            self._inflight.add(f)
            self._inflight_bytes += new
            self._tasks.append(f)
            self._task_cv.notify()

    def _make_room(self, new: int, budget: int) -> bool:
        used = lambda: sum(self._on_disk.values()) + self._inflight_bytes  # noqa: E731
        if used() + new <= budget:
            return True
        self._measure()
        unwanted = [f for f in self._on_disk if f not in self._uses and f not in self._inflight]
        unchecked = [f for f in self._on_disk if f not in self._ready and f not in self._inflight and f in self._uses]
        for f in unwanted + unchecked:  # an earlier run's file, wanted later: fetched again when its turn comes
            self.path(f).unlink(missing_ok=True)
            del self._on_disk[f]
            self._ready.discard(f)
            if used() + new <= budget:
                return True
        return not self._on_disk and not self._inflight  # alone, a file may be fetched whatever its size

    # -------------------------------------------------------------------------------------- the fetchers

    def _work(self) -> None:
        while True:
            with self._lock_state:
                while not self._tasks:
                    self._task_cv.wait()
                f = self._tasks.popleft()
            self._fetch(f)

    def _fetch(self, f: int) -> None:
        """File f into the cache (kept if an earlier run left it and it passes the checks), then ready; or
        failed, with its note for the workers. Runs without the lock."""
        path, url = self.path(f), f"{self.url}/{self.rels[f]}"
        unchecked = path.with_name(f".{path.name}.unchecked")
        with self._lock_state:
            left_here = f in self._on_disk
        downloaded, failure = 0, None
        try:
            if not (left_here and self._current(f, path) and self._passes(f, path)):
                path.unlink(missing_ok=True)
                # not fsynced (durable=False): a copy a crash tore fails _current/_passes next run, fetched again
                downloaded = download_verified(thread_client(), self.bucket, RemoteObject(
                    join_name(self.prefix, self.rels[f]), self.sizes[f], self.crcs[f]), unchecked,
                    retries=FETCH_RETRIES, durable=False)
                self._check(f, unchecked)
                os.replace(unchecked, path)
        except Exception as exc:  # noqa: BLE001 - any failure makes the shard unavailable, said in one line
            cause = str(exc) if isinstance(exc, UserError) else short_error(exc)
            failure = f"unavailable data ({cause if url in cause else f'{url}: {cause}'})"
            path.unlink(missing_ok=True)
            unchecked.unlink(missing_ok=True)
            try:
                files.write_text(path.with_name(path.name + UNAVAILABLE), "")  # empty: takes no room
            except OSError:
                pass
        with self._lock_state:
            self._inflight.discard(f)
            if f not in self._on_disk:
                self._inflight_bytes -= self.sizes[f]
            if failure is None:
                self._on_disk[f] = self.sizes[f]
                self._ready.add(f)
                self.fetched += bool(downloaded)
                self.fetched_bytes += downloaded
            else:
                self._on_disk.pop(f, None)
                self._ready.discard(f)
                self._failed[f] = failure
            self._measure()
            self._ready_cv.notify_all()
            self._plan_cv.notify()

    def _check(self, f: int, path: Path) -> None:
        """The shard format's rules, the vocabulary, and the sequences dataset.json promised (ShardError)."""
        name = f"{self.url}/{self.rels[f]}"
        layout = inspect_shard(path, name, self.seq_len)
        check_vocab(name, layout, self.vocab_size)
        _, count = check_header(name, layout.shape, layout.dtype, self.seq_len)
        if count != self.sequences[f]:
            raise ShardError(f"{name}: holds {count} sequences of {self.seq_len} tokens but dataset.json's count "
                             f"gives {self.sequences[f]}; prepare the dataset again with prepare_data.py")

    def _current(self, f: int, path: Path) -> bool:
        """Whether a file an earlier run left is the one dataset.json lists now (its crc32c: a dataset prepared
        again under the same prefix keeps its shards' names and sizes). A stale one is fetched again, said once."""
        if not self.crcs[f] or file_crc32c(path) == self.crcs[f]:
            return True
        with self._lock_state:
            said, self._said_stale = self._said_stale, True
        if not said:
            self.log(f"data: {self.url}: the cache {self.folder} holds copies of its shards other than its dataset.json "
                     f"lists now (crc32c; prepared again?), e.g. {self.rels[f]}: each is fetched again")
        return False

    def _passes(self, f: int, path: Path) -> bool:
        try:
            self._check(f, path)
            return True
        except ShardError:
            return False

    def _measure(self) -> None:
        """Bytes under the cache folder now (partial downloads included): the peak is what the run reports."""
        self.peak_bytes = max(self.peak_bytes, bytes_under(self.folder))


def bytes_under(folder: Path) -> int:
    """Bytes of the files under `folder` now (one removed while it looks is skipped)."""
    total = 0
    for dirpath, _, names in os.walk(folder):
        for name in names:
            try:
                total += os.stat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


# ------------------------------------------------------------------------------------------------- reading


class StreamedShards(TokenSequenceDataset):
    """A gs:// dataset's training sequences, read from this process's cache as TokenSequenceDataset reads a
    shard folder, fetched ahead by the ShardFetcher (ReadAhead). In a DataLoader worker, reads wait for the
    fetcher's files (the module docstring)."""

    def __init__(self, index: ShardIndex, url: str, fetcher: ShardFetcher):
        super().__init__(index)
        self.url, self._fetcher, self._owner = url, fetcher, os.getpid()

    def __getstate__(self):
        state = super().__getstate__()
        state["_fetcher"] = None  # a worker reads; only the training process fetches
        return state

    def describe(self) -> str:
        return self.url

    def read_from(self, schedule) -> None:
        self._fetcher.read_from(schedule)

    def handed_out(self, batch: int) -> None:
        self._fetcher.handed_out(batch)

    def returned(self, batch: int) -> None:
        self._fetcher.returned(batch)

    def wait_ready(self, last_batch: int) -> str | None:
        return self._fetcher.wait_ready(last_batch)

    def stop_reading(self) -> None:
        self._fetcher.stop()

    def get_batch(self, indices, dtype=np.int64) -> np.ndarray:
        self._check_process()
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"sequence index out of range [0, {len(self)})")
        needed = sorted(set(np.searchsorted(self._cumulative, idx, side="right").tolist()))
        if os.getpid() == self._owner:
            self._fetcher.wait_for(needed)
        else:
            for f in needed:
                self._await_file(Path(self._paths[f]), self._owner)
        for f in needed:
            if self._layouts[f] is None:
                self._layouts[f] = read_layout(self._paths[f])
        try:
            return super().get_batch(idx, dtype)
        finally:  # nothing of an evicted file may stay open
            self._close()
            self._maps.clear()

    @staticmethod
    def _await_file(path: Path, owner: int) -> None:
        note = path.with_name(path.name + UNAVAILABLE)
        while not path.exists():
            if note.exists():  # the training process names why in its own line before it reads this batch
                raise DataUnavailable(f"{path}: the training process could not fetch it")
            if os.getppid() != owner:
                raise DataUnavailable(f"{path}: the training process that fetches it is gone")
            time.sleep(POLL_S)


class RemoteValidation(TokenSequenceDataset):
    """A gs:// dataset's validation sequences: each shard read whole into memory when first needed (verified
    against dataset.json's size and crc32c, checked as the training shards are), the last two kept."""

    def __init__(self, index: ShardIndex, url: str, entries: list[dict]):
        super().__init__(index)
        self.url, self.entries = url, entries
        self._arrays: dict[int, np.ndarray] = {}

    def describe(self) -> str:
        return f"{self.url} (validation)"

    def _array(self, f: int) -> np.ndarray:
        if f not in self._arrays:
            entry, url = self.entries[f], f"{self.url}/{self.entries[f]['path']}"
            data = read_object(make_client(), url, retries=FETCH_RETRIES)
            if not bytes_match(data, int(entry["bytes"]), entry.get("crc32c", "")):
                raise StorageError(f"{url}: missing, or not the {entry['bytes']} bytes with the crc32c dataset.json "
                                   f"lists; prepare the dataset again or restore the file")
            with np.load(io.BytesIO(data), allow_pickle=False) as npz:
                array = npz[INPUT_KEY]
            check_header(url, array.shape, array.dtype, self.seq_len)
            check_vocab(url, ShardLayout(True, -1, array.dtype.str, array.shape, False, int(array.min()),
                                         int(array.max())), self.index.vocab_size)
            while len(self._arrays) >= 2:
                self._arrays.pop(next(iter(self._arrays)))
            self._arrays[f] = array
        return self._arrays[f]

    def _read_sequence(self, f: int, j: int, out: np.ndarray) -> None:
        arr, n = self._array(f), self.seq_len
        out[:] = arr[j * n:(j + 1) * n] if arr.ndim == 1 else arr[j, :n]


STREAM = SourceType("stream", handles=is_gcs, open=open_stream, description_dir=description_dir)
