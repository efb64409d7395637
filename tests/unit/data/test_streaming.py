"""Training from gs:// (utils/data/stream_source.py) against the GCS emulator, and the shuffle orders
(utils/data/mixture.py): a streamed dataset indexes, orders and reads as its downloaded copy does, in this
process and through train.py (bitwise-equal losses and cursors, for each order); a bounded cache stays within
its bound through an epoch; a GCS outage stops the run with a checkpoint and one line, and a resume continues;
a slow GCS does not slow the loop while the cache is ahead; two ranks fetch only what they read."""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.e2e.test_prepare_data import bpe_tokenizer, text
from tests.trainkit import REPO_ROOT, TINY, metrics, run, train_rows
from utils.data import build
from utils.data.dataset_info import FILE as DATASET_FILE
from utils.data.loader import MixtureBatchSampler, RankSlice, Readers, ResumableLoader, source_schedule
from utils.data.mixture import MixtureError, Shuffle, block_permutation
from utils.data.source import CacheBudget, CacheTooSmall, OpenRequest, Source
from utils.data.stream_source import StreamError, bytes_under
from utils.errors import UserError

SEQ, VOCAB = 32, 364  # the tokenizer's ids (prepare_data.py's dataset.json says so)
SHARD_TOKENS = 1024  # 32 sequences per training shard
PEAK_RE = re.compile(r"peaked at ([\d,]+) bytes")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """prepare_data.py's output for a small corpus: 23 training shards of 32 sequences, 5 validation shards."""
    root = tmp_path_factory.mktemp("streaming")
    (root / "corpus").mkdir()
    rng = random.Random(0)
    with open(root / "corpus" / "docs.jsonl", "w") as f:
        for i in range(600):
            f.write(json.dumps({"text": text(rng, 20 + i % 50)}) + "\n")
    from utils.data.prepare import PrepareOptions, prepare

    prepare([str(root / "corpus")], str(bpe_tokenizer(root / "tokenizer.json")), root / "local",
            PrepareOptions(shard_tokens=SHARD_TOKENS, val_fraction=0.02))
    return root / "local"


def upload(local: Path, url: str) -> str:
    from utils.io.storage import make_client, parse_gs_url, upload_verified

    bucket, prefix = parse_gs_url(url)
    client = make_client()
    for path in sorted(p for p in local.rglob("*") if p.is_file() and not p.name.startswith(".")):
        if path.name != DATASET_FILE:
            upload_verified(client, bucket, path, f"{prefix}/{path.relative_to(local).as_posix()}")
    upload_verified(client, bucket, local / DATASET_FILE, f"{prefix}/{DATASET_FILE}")  # last, as prepare does
    return url


@pytest.fixture
def bucket(gcs_emulator, prepared) -> str:
    return upload(prepared, f"gs://{gcs_emulator.bucket}/ds")


def request(cache_dir: Path, shuffle: Shuffle, cache_gb: float = 0.0, rank: int = 0) -> OpenRequest:
    return OpenRequest(SEQ, VOCAB, log=lambda _line: None, rank=rank, shuffle=shuffle, step_sequences=8,
                       cache_dir=str(cache_dir), cache=CacheBudget(cache_gb))


class MediaLog:
    """The emulator's object downloads (alt=media), by object name; optionally slowed by `delay_s`."""

    def __init__(self, monkeypatch):
        from gcp_storage_emulator.server import RequestHandler

        self.names: list[str] = []
        self.delay_s = 0.0
        original = RequestHandler.do_GET

        def do_get(handler):
            if "alt=media" in handler.path:
                self.names.append(re.sub(r"\?.*", "", handler.path.split("/o/", 1)[1]).replace("%2F", "/"))
                time.sleep(self.delay_s)
            original(handler)

        monkeypatch.setattr(RequestHandler, "do_GET", do_get)

    def shards(self, prefix: str) -> list[str]:
        return [n for n in self.names if n.startswith(prefix + "/") and n.endswith(".npz")]


# ------------------------------------------------------------------------------------------------ the orders


def test_blocks_permutes_files_then_shuffles_within_blocks_any_world_size_and_o1_resume(prepared):
    sizes = np.array([3, 5, 2, 7, 4])
    perm = block_permutation([1], 0, sizes, 2)
    assert sorted(perm.tolist()) == list(range(sizes.sum()))
    file_of = np.searchsorted(np.cumsum(sizes), perm, side="right")
    blocks, start = [], 0
    while start < len(perm):  # consecutive blocks of 2 files: each block's sequences from its own 2 files
        files = []
        for f in file_of[start:]:
            if f not in files and len(files) == 2:
                break
            files += [] if f in files else [int(f)]
        blocks.append(files)
        start += int(sizes[files].sum())
    assert sorted(f for b in blocks for f in b) == list(range(5)) and [len(b) for b in blocks] == [2, 2, 1]
    assert not np.array_equal(perm, block_permutation([1], 1, sizes, 2))  # a new order each epoch

    index = build.open_source(Source("data", path=prepared), request(prepared, Shuffle("blocks", 4)))[0]
    blocks4 = Shuffle("blocks", 4)
    one = ResumableLoader(index, 4, 0, 1, seed=7, shuffle=blocks4)
    two = [ResumableLoader(index, 2, r, 2, seed=7, shuffle=blocks4) for r in (0, 1)]
    seen = []
    for _ in range(60):
        batch = next(one)
        assert torch.equal(batch, torch.cat([next(r) for r in two]))
        seen.append(batch)
    ends = np.cumsum(index.file_sequences())
    for epoch in (0, 1):  # any 4 files' worth of consecutive sequences comes from at most two blocks: 8 files
        files = np.searchsorted(ends, block_permutation([7], epoch, index.file_sequences(), 4), side="right")
        assert max(len(set(files[i:i + 128])) for i in range(0, len(files) - 128, 16)) <= 8
    state = one.state_dict()
    assert state["shuffle"] == {"kind": "blocks", "block_files": 4}
    ahead = [next(one) for _ in range(50)]  # into the next epoch
    resumed = ResumableLoader(index, 4, 0, 1, seed=0, shuffle=blocks4)
    resumed.load_state_dict(state)
    assert all(torch.equal(a, next(resumed)) for a in ahead)
    with pytest.raises(MixtureError, match=r"follows shuffle=blocks of 4 shard\(s\) but this run asks for "
                                           r"shuffle=global; resume with the checkpoint's order") as e:
        ResumableLoader(index, 4, 0, 1, seed=7).load_state_dict(state)
    assert "\n" not in str(e.value) and isinstance(e.value, UserError)
    global_state = ResumableLoader(index, 4, 0, 1, seed=7).state_dict()
    assert "shuffle" not in global_state  # the engine's original cursor format
    with pytest.raises(MixtureError, match="follows shuffle=global but this run asks for shuffle=blocks"):
        ResumableLoader(index, 4, 0, 1, seed=7, shuffle=blocks4).load_state_dict(global_state)


def test_a_rank_s_schedule_of_a_source_is_what_its_sampler_reads(prepared):
    """source_schedule, computed in chunks, equals the sampler's batches, across a source's cap and epochs."""
    data = build.open_source(Source("data", path=prepared), request(prepared, Shuffle("blocks", 3)))[0]
    specs = [Source("a", 0.7, None, data=data), Source("b", 0.3, 1, data=data)]  # b drops out after one epoch
    for shuffle in (Shuffle(), Shuffle("blocks", 3)):
        start = (tuple([0, 0]), tuple([0, 0]), tuple([0.7, 0.3]))
        sampler = iter(MixtureBatchSampler(specs, 3, 1, 3, 5, start, shuffle))
        schedules = [source_schedule(specs, RankSlice(3, 1, 3), 5, start, shuffle, s, chunk=7) for s in (0, 1)]
        for _ in range(1200):  # b's 736 sequences run out after ~820 global batches of 9
            sources, indices, _ = next(sampler)
            for s in (0, 1):
                assert np.array_equal(next(schedules[s]), indices[sources == s])


# --------------------------------------------------------------------------------- streamed = downloaded


@pytest.mark.parametrize("order", ["global", "blocks"])
def test_a_gs_dataset_indexes_orders_and_reads_as_its_downloaded_copy(bucket, prepared, tmp_path, order,
                                                                       monkeypatch):
    log = MediaLog(monkeypatch)
    synced = []  # the files fsynced: none of the cache's shards (a torn copy fails the checks and is fetched again)
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or real_fsync(fd))
    shuffle = Shuffle(order, 2)
    bound = 0.0 if order == "global" else 45_000 / 1e9  # blocks: a third of the corpus's 53 kB, with workers
    streamed, s_val = build.open_source(Source("data", path=bucket), request(tmp_path / "cache", shuffle, bound))
    local, l_val = build.open_source(Source("data", path=prepared), request(tmp_path, shuffle))
    assert streamed.fingerprint() == local.fingerprint() and len(streamed) == len(local) == 23 * 32
    assert np.array_equal(streamed.file_sequences(), local.file_sequences())
    assert np.array_equal(s_val.get_batch(range(len(s_val))), l_val.get_batch(range(len(l_val))))
    workers = 2 if order == "blocks" else 0
    a = ResumableLoader(streamed, 4, 0, 1, seed=3, shuffle=shuffle, readers=Readers(workers, 2))
    b = ResumableLoader(local, 4, 0, 1, seed=3, shuffle=shuffle)
    try:
        for i in range(200):  # 800 sequences: past the first epoch's end
            assert torch.equal(next(a), next(b)), i
            if i % 20 == 0:
                assert a.unavailable(2) is None
        assert a.state_dict() == b.state_dict() and a.files_consumed() == b.files_consumed()
    finally:
        a.close()
        b.close()
    folder = tmp_path / "cache" / "test-bucket" / "ds"
    fetched = log.shards("ds/part-00000")
    assert not [path for path in synced if ".npz" in path], synced
    if order == "global":  # every shard once, none twice
        assert sorted(fetched) == sorted(set(fetched)) and len(fetched) == 23
    else:  # the epoch's 23 and the next epoch's first blocks; the cache held a third of them at most
        assert 23 < len(fetched) < 40
        described = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
        assert 0 < streamed._fetcher.peak_bytes <= 45_000 - described
        assert len(list((folder / "rank-0").rglob("*.npz"))) < 23


def test_refusals_are_one_line(bucket, prepared, tmp_path):
    corpus = sum(p.stat().st_size for p in (prepared / "part-00000").glob("*.npz"))
    with pytest.raises(CacheTooSmall, match=r"shuffle=global reads all 23 of its 23 shards at once") as e:
        build.open_source(Source("data", path=bucket), request(tmp_path, Shuffle(), corpus / 2 / 1e9))
    assert "\n" not in str(e.value) and "raise data_cache_gb to at least" in str(e.value)
    with pytest.raises(CacheTooSmall, match=r"shuffle=blocks of 4 shard\(s\) reads up to 9 of its 23 shards"):
        build.open_source(Source("data", path=bucket), request(tmp_path, Shuffle("blocks", 4), 15_000 / 1e9))
    build.open_source(Source("data", path=bucket), request(tmp_path, Shuffle("blocks", 2), 40_000 / 1e9))
    with pytest.raises(StreamError, match=r"gs://test-bucket/nothing/dataset.json not found: .* prepare the data"):
        build.open_source(Source("data", path="gs://test-bucket/nothing"), request(tmp_path, Shuffle()))
    with pytest.raises(UserError, match=r"data source data \(s3://b/x\): no source type reads it"):
        build.open_source(Source("data", path="s3://b/x"), request(tmp_path, Shuffle()))
    (tmp_path / "a-file").write_text("not a folder")  # data_cache_dir naming a file: was a traceback
    with pytest.raises(StreamError,
                       match=r"data_cache_dir \S+/a-file: .* cannot be made there \(a file is in the way\)"):
        build.open_source(Source("data", path=bucket), request(tmp_path / "a-file", Shuffle()))


def test_a_stale_cache_entry_is_fetched_again_and_said_once(gcs_emulator, bucket, prepared, tmp_path):
    """The dataset prepared again under the same prefix (same shard names and sizes, new contents and crc32c):
    a reader with the old cache reads the new shards, as a fresh copy does, and says once that it refetched."""
    from utils.data import stream_source
    from utils.io.storage import file_crc32c

    cache, shuffle = tmp_path / "cache", Shuffle()

    def batches(source, n=40):
        loader = ResumableLoader(source, 4, 0, 1, seed=3, shuffle=shuffle)
        try:
            return [next(loader) for _ in range(n)]
        finally:
            loader.close()

    lines = []
    said = OpenRequest(SEQ, VOCAB, log=lines.append, rank=0, shuffle=shuffle, step_sequences=8, cache_dir=str(cache),
                       cache=CacheBudget(0.0))
    batches(build.open_source(Source("data", path=bucket), said)[0])  # fills the cache with every shard
    again = tmp_path / "again"
    shutil.copytree(prepared, again)
    description = json.loads((again / DATASET_FILE).read_text())
    for shard in description["shards"]:
        path = again / shard["path"]
        ids = np.load(path)["input_ids"]
        np.savez(path, input_ids=ids[::-1].copy())  # same ids, other order: same size, other crc32c
        assert path.stat().st_size == shard["bytes"]
        shard["crc32c"] = file_crc32c(path)
    (again / DATASET_FILE).write_text(json.dumps(description))
    upload(again, bucket)
    stream_source._DESCRIBED.clear()  # a new process: dataset.json fetched again
    lines.clear()
    streamed = batches(build.open_source(Source("data", path=bucket), said)[0])
    fresh = batches(build.open_source(Source("data", path=again), request(tmp_path / "x", shuffle))[0])
    assert all(torch.equal(a, b) for a, b in zip(streamed, fresh))
    stale = [line for line in lines if "fetched again" in line]
    assert len(stale) == 1 and "crc32c" in stale[0], lines


# ------------------------------------------------------------------------------- a thread that fails, a stop


def _bounded(fn, seconds: float):
    """fn() in a thread, its result or exception; a wait that does not end within `seconds` fails the test."""
    out = {}

    def call():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still waiting after {seconds} s on a dead thread"
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_a_fetch_or_plan_thread_that_dies_reaches_the_loop_as_one_line_and_no_wait_hangs(bucket, tmp_path):
    """The plan (coordinator) thread raising while it walks the schedule (as allocating a plan of 1e15 tokens
    did), and a fetch thread dying inside its own error handler (a shard path naming the cache folder
    itself): every wait returns the thread's one line within seconds, where it waited forever."""
    from utils.data.stream_source import ShardFetcher
    from utils.errors import THREAD_FAILED, BackgroundFailure

    streamed, _ = build.open_source(Source("data", path=bucket), request(tmp_path / "cache", Shuffle()))

    def plan():
        yield np.arange(4)
        raise MemoryError("Unable to allocate 114. TiB for an array")

    streamed.read_from(plan())
    try:
        line = _bounded(lambda: streamed.wait_ready(500), 20)
        assert line.startswith(THREAD_FAILED) and "data-fetch-plan" in line and "MemoryError" in line, line
        assert "\n" not in line
        loader = ResumableLoader(streamed, 4, 0, 1, seed=3, shuffle=Shuffle())
        with pytest.raises(BackgroundFailure, match="data-fetch-plan"):
            _bounded(lambda: [next(loader) for _ in range(200)], 20)
    finally:
        streamed.stop_reading()

    folder = tmp_path / "crafted"
    folder.mkdir()
    fetcher = ShardFetcher(bucket, folder, [{"path": ".", "bytes": 100, "crc32c": "", "tokens": 64}], SEQ, VOCAB,
                           budget=lambda: None, log=lambda _line: None)
    fetcher.read_from(iter([np.arange(2)]))
    try:
        line = _bounded(lambda: fetcher.wait_ready(0), 20)
        assert line.startswith(THREAD_FAILED) and "data-fetch-" in line, line
        with pytest.raises(BackgroundFailure):
            _bounded(lambda: fetcher.wait_for([0]), 20)
    finally:
        fetcher.stop()


@pytest.mark.slow
@pytest.mark.parametrize("when", ["later step", "first step"])
def test_sigterm_while_the_loop_waits_for_data_stops_the_run_within_seconds(gcs_emulator, bucket, tmp_path,
                                                                            subprocess_env, monkeypatch, when):
    """Training shards' downloads hang (GCS answers nothing) from the first step on, or from the start: the loop
    waits for its next files, a SIGTERM then ends the run within seconds, exit 0, with a checkpoint (or, before
    the first step, nothing to save); it waited until the download ended."""
    import signal
    import subprocess

    from gcp_storage_emulator.server import RequestHandler

    gate, hanging, over = threading.Event(), threading.Event(), threading.Event()
    original = RequestHandler.do_GET

    def do_get(handler):
        name = handler.path.split("/o/", 1)[-1]
        if "alt=media" in handler.path and ".npz" in name and "val" not in name and hanging.is_set():
            gate.wait(120)
            if over.is_set():
                return  # the run is gone: answering it would print a broken pipe from the server's thread
        original(handler)

    monkeypatch.setattr(RequestHandler, "do_GET", do_get)
    env = {**subprocess_env, "STORAGE_EMULATOR_HOST": gcs_emulator.url}
    out = tmp_path / "gs"
    cmd = [sys.executable, str(REPO_ROOT / "train.py"), "--config", "demo", "--output-dir", str(out),
           "--data-dir", bucket]
    for s in [*TINY, f"seq_len={SEQ}", "sample_every=0", "max_steps=500", "shuffle=blocks", "shuffle_block_shards=2",
              "per_device_train_batch_size=32", f"data_cache_dir={tmp_path / 'cache'}",
              f"data_cache_gb={40_000 / 1e9}"]:
        cmd += ["--set", s]
    if when == "first step":
        hanging.set()
    proc = subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        rows, deadline = out / "logs" / "metrics.jsonl", time.monotonic() + 240
        while not (rows.exists() and ('"loss"' if when == "later step" else '"val_loss"') in rows.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.01)
        hanging.set()
        last, still = rows.read_text(), time.monotonic()
        while time.monotonic() - still < 3:  # the loop is waiting: no new row for 3 s
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
            if rows.read_text() != last:
                last, still = rows.read_text(), time.monotonic()
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        over.set()
        gate.set()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stderr[-3000:]
    assert "Traceback" not in stderr
    if when == "first step":
        assert "Stopped: stopped by SIGTERM during setup (waiting for the data of the first step)" in stdout, stdout
        assert not (out / "checkpoints").exists() or not list((out / "checkpoints").iterdir())
        return
    stopped = [line for line in stdout.splitlines() if line.startswith("Stopped by SIGTERM after step")]
    assert len(stopped) == 1 and "checkpoint" in stopped[0], stdout[-3000:]


def _crafted(prepared: Path, dest: Path, edit) -> Path:
    """A copy of the prepared dataset whose dataset.json `edit` changed."""
    shutil.copytree(prepared, dest)
    description = json.loads((dest / DATASET_FILE).read_text())
    edit(description)
    (dest / DATASET_FILE).write_text(json.dumps(description))
    return dest


CRAFTED = {  # field -> (edit, what the line says)
    "path .": (lambda d: d["shards"][3].update(path="."),
               r"shards\[3\]\.path is '\.', not the relative path of a file"),
    "tokens 1e15": (lambda d: d["shards"][0].update(tokens=1e15),
                    r"shards\[0\]\.tokens is 1000000000000000\.0, not a non-negative integer"),
    "tokens 10**15": (lambda d: d["shards"][0].update(tokens=10**15),
                      r"shards\[0\]\.tokens is 1,000,000,000,000,000, more uint16 tokens than its [\d,]+ bytes "
                      r"can hold"),
    "tokens -5": (lambda d: d["shards"][1].update(tokens=-5), r"shards\[1\]\.tokens is -5, not a non-negative"),
    "tokens string": (lambda d: d["validation"]["shards"][0].update(tokens="1024"),
                      r"validation\.shards\[0\]\.tokens is '1024', not a non-negative integer"),
    "eos_id string": (lambda d: d["tokenizer"].update(eos_id="0"), r"tokenizer\.eos_id is '0', not a non-negative"),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_a_crafted_dataset_json_in_the_bucket_is_refused_naming_the_field(gcs_emulator, prepared, tmp_path, case):
    edit, said = CRAFTED[case]
    url = upload(_crafted(prepared, tmp_path / "crafted", edit), f"gs://{gcs_emulator.bucket}/crafted")
    with pytest.raises(UserError) as e:
        build.open_source(Source("data", path=url), request(tmp_path / "cache", Shuffle()))
    assert ("\n" not in str(e.value) and str(e.value).startswith(f"{url}/dataset.json: ")
            and re.search(said, str(e.value))), str(e.value)


@pytest.mark.slow
def test_the_streamed_reproductions_end_in_one_line_within_seconds(gcs_emulator, prepared, tmp_path, subprocess_env):
    """train.py on a streamed dataset.json naming a shard path "." (a fetch thread died, the loop waited for
    good) and on one shard of 1e15 tokens (the plan thread died allocating 114 TiB): one line, exit 2, in
    seconds."""
    env = {**subprocess_env, "STORAGE_EMULATOR_HOST": gcs_emulator.url}
    for case in ("path .", "tokens 1e15"):
        name = case.replace(" ", "-").replace(".", "dot")
        url = upload(_crafted(prepared, tmp_path / name, CRAFTED[case][0]), f"gs://{gcs_emulator.bucket}/{name}")
        started = time.monotonic()
        proc = train(tmp_path / f"out-{name}", url, env, f"data_cache_dir={tmp_path / 'cache'}", check=False)
        assert time.monotonic() - started < 120
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and re.search(CRAFTED[case][1], errors[0]), errors


@pytest.mark.slow
def test_a_fetch_thread_that_dies_in_a_run_stops_it_in_one_line_exit_1(bucket, gcs_emulator, tmp_path, subprocess_env):
    """A folder in the cache where a shard's file goes: its fetch thread dies inside its own error handler
    (IsADirectoryError), as with a shard path "."; the run stops with that thread's one line, exit 1, within
    its time bound (the loop waited for that shard for good)."""
    env = {**subprocess_env, "STORAGE_EMULATOR_HOST": gcs_emulator.url}
    cache = tmp_path / "cache"
    (cache / "test-bucket" / "ds" / "rank-0" / "part-00000" / "shard-00005.npz").mkdir(parents=True)
    cmd = [sys.executable, str(REPO_ROOT / "train.py"), "--config", "demo", "--output-dir", str(tmp_path / "out"),
           "--data-dir", bucket]
    for s in [*TINY, f"seq_len={SEQ}", "sample_every=0", "max_steps=200", f"data_cache_dir={cache}"]:
        cmd += ["--set", s]
    proc = run(cmd, env, check=False, timeout=240)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    said = [line for line in (proc.stdout + proc.stderr).splitlines()
            if "a background thread failed: data-fetch-" in line and "IsADirectoryError" in line]
    assert len(said) == 1, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert said[0].startswith(("Stopped by a background thread failed", "error: a background thread failed")), said


# ------------------------------------------------------------------------------------------ through train.py


def train(out: Path, data: str, env: dict, *sets: str, check: bool = True, extra: tuple = ()):
    cmd = [sys.executable, str(REPO_ROOT / "train.py"), "--config", "demo", "--output-dir", str(out),
           "--data-dir", str(data)]
    for s in [*TINY, f"seq_len={SEQ}", "sample_every=0", "max_steps=30", *sets]:
        cmd += ["--set", s]
    return run(cmd + list(extra), env, check=check)


def cursor(checkpoint: Path) -> tuple[dict, dict]:
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    return torch.load(checkpoint / "data.pt", weights_only=True), state["data"]


def losses(out: Path) -> list[float]:
    rows = train_rows(out)
    return [rows[s]["loss"] for s in sorted(rows)]


@pytest.mark.slow
def test_streamed_global_run_equals_the_downloaded_run(bucket, prepared, tmp_path, subprocess_env):
    env = {**subprocess_env, "STORAGE_EMULATOR_HOST": os.environ["STORAGE_EMULATOR_HOST"]}
    train(tmp_path / "local", str(prepared), env)
    streamed = train(tmp_path / "gs", bucket, env, f"data_cache_dir={tmp_path / 'cache'}")
    assert "streaming 23 shard file(s)" in streamed.stdout
    assert len(losses(tmp_path / "gs")) == 30 and losses(tmp_path / "gs") == losses(tmp_path / "local")
    name = "checkpoint-epoch0-step30-files15"
    assert cursor(tmp_path / "gs" / "checkpoints" / name) == cursor(tmp_path / "local" / "checkpoints" / name)


@pytest.mark.slow
def test_blocks_within_a_small_cache_an_outage_stops_with_a_checkpoint_and_a_resume_continues(
        gcs_emulator, bucket, prepared, tmp_path, subprocess_env, monkeypatch):
    """shuffle=blocks, a cache bound of under half the corpus, DataLoader workers: the streamed run stays
    within the bound (measured from outside, and as it says), GCS goes away mid-run (one line, a checkpoint,
    exit 1), comes back, and the resumed run's 30 losses and cursor are the downloaded run's, an epoch on."""
    env = {**subprocess_env, "STORAGE_EMULATOR_HOST": gcs_emulator.url}
    blocks = ["shuffle=blocks", "shuffle_block_shards=2", "per_device_train_batch_size=32"]
    train(tmp_path / "local", str(prepared), env, *blocks)
    bound = 40_000  # bytes; the corpus's training shards are 53 kB
    cache = tmp_path / "cache"
    sets = [*blocks, f"data_cache_dir={cache}", f"data_cache_gb={bound / 1e9}", "dataloader_num_workers=2"]
    log = MediaLog(monkeypatch)
    log.delay_s = 0.3  # slow enough that the run is still early when GCS goes away
    peak, done, outage = [0], threading.Event(), threading.Event()

    def watch():  # the cache's bytes, every 2 ms; GCS goes away once the streamed run has trained a step
        while not done.is_set():
            peak[0] = max(peak[0], bytes_under(cache) if cache.exists() else 0)
            rows = tmp_path / "gs" / "logs" / "metrics.jsonl"
            if not outage.is_set() and rows.exists() and '"loss"' in rows.read_text():
                gcs_emulator.stop()
                outage.set()
            time.sleep(0.002)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        first = train(tmp_path / "gs", bucket, env, *sets, check=False)
    finally:
        done.set()
        watcher.join()
    assert first.returncode == 1, first.stderr[-2000:]
    stopped = [line for line in first.stdout.splitlines() if line.startswith("Stopped by")]
    assert len(stopped) == 1 and re.match(r"Stopped by unavailable data \(downloading gs://test-bucket/ds/"
                                          r"part-00000/shard-\d{5}\.npz to \S+ failed after 6 attempts: "
                                          r"ConnectionError: .*\) after step (\d+): "
                                          r"checkpoint \S*/checkpoint-epoch0-step\1-", stopped[0]), stopped
    step = int(re.search(r"after step (\d+)", stopped[0])[1])
    assert 1 <= step < 30 and len(losses(tmp_path / "gs")) == step
    gcs_emulator.restart()
    log.delay_s = 0.0
    done.clear()
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        second = train(tmp_path / "gs", bucket, env, *sets, extra=("--resume", "auto"))
    finally:
        done.set()
        watcher.join()
    assert losses(tmp_path / "gs") == losses(tmp_path / "local")  # bitwise, the 30 steps
    name = "checkpoint-epoch1-step30-files30"  # 960 sequences: an epoch (736) and a third
    assert cursor(tmp_path / "gs" / "checkpoints" / name) == cursor(tmp_path / "local" / "checkpoints" / name)
    assert 0 < peak[0] <= bound, peak
    said = [int(p.replace(",", "")) for out in (first, second) for p in PEAK_RE.findall(out.stdout)]
    assert said and max(said) <= bound


@pytest.mark.slow
def test_a_slow_gcs_leaves_the_loop_unslowed_while_the_cache_is_ahead(gcs_emulator, bucket, prepared, tmp_path,
                                                                      subprocess_env, monkeypatch):
    """From step 3 on every download takes 0.1 s (one at a time: the emulator serves serially): the fetcher,
    keeping a bounded cache a block and more ahead of the loop, fetches most of the epoch's shards in that
    time, and the loop's data-wait fraction stays near zero."""
    env = {**subprocess_env, "STORAGE_EMULATOR_HOST": gcs_emulator.url}
    log = MediaLog(monkeypatch)
    out = tmp_path / "gs"
    slowed = []

    def slow_down():
        rows = out / "logs" / "metrics.jsonl"
        while not (rows.exists() and rows.read_text().count('"loss"') >= 1):
            time.sleep(0.002)
        log.delay_s = 0.1
        slowed.append(len(log.shards("ds/part-00000")))

    threading.Thread(target=slow_down, daemon=True).start()
    train(out, bucket, env, "shuffle=blocks", "shuffle_block_shards=2", f"data_cache_dir={tmp_path / 'cache'}",
          f"data_cache_gb={40_000 / 1e9}", "per_device_train_batch_size=1", "max_steps=600", "logging_steps=50")
    fetched_slowly = len(log.shards("ds/part-00000")) - slowed[0]
    fractions = [r["data_wait_frac"] for r in metrics(out) if "data_wait_frac" in r]
    print(slowed, fetched_slowly, fractions)
    assert fetched_slowly >= 8 and len(fractions) == 12 and max(fractions[1:]) < 0.2, (fetched_slowly, fractions)


# ----------------------------------------------------------------------------------------------- two ranks


@pytest.mark.slow
def test_two_ranks_read_disjoint_sequences_and_each_fetches_only_what_it_reads(
        gcs_emulator, prepared, tmp_path, subprocess_env, monkeypatch):
    """A mixture of two gs:// datasets at equal weights, one sequence per rank: rank 0 reads only `a`, rank 1
    only `b` (the stream alternates a, b). Each rank fetched its own source's shards, once each, and never
    the other's; the sequences each rank trained on are its share of the one-process stream."""
    urls = {name: upload(prepared, f"gs://{gcs_emulator.bucket}/{name}") for name in ("a", "b")}
    log = MediaLog(monkeypatch)
    cache = tmp_path / "cache"
    env = {**subprocess_env, "STORAGE_EMULATOR_HOST": gcs_emulator.url, "NEOX_TRACE_BATCHES": "1"}
    mix = ",".join(f"{name}={url}:0.5" for name, url in urls.items())
    cmd = [str(REPO_ROOT / "start_training.sh"), "--config", "demo", "--gpus", "2", "--cpu", "--",
           "--output-dir", str(tmp_path / "out")]
    for s in [*TINY, f"seq_len={SEQ}", "sample_every=0", "max_steps=12", "per_device_train_batch_size=1",
              f"data_mix={mix}", f"data_cache_dir={cache}"]:
        cmd += ["--set", s]
    run(cmd, env, timeout=240)
    for rank, mine, other in ((0, "a", "b"), (1, "b", "a")):
        held = sorted(p.relative_to(cache / "test-bucket" / mine / f"rank-{rank}").as_posix()
                      for p in (cache / "test-bucket" / mine / f"rank-{rank}").rglob("*.npz"))
        assert held and not list((cache / "test-bucket" / other / f"rank-{rank}").rglob("*.npz"))
        assert sorted(n[len(mine) + 1:] for n in log.shards(f"{mine}/part-00000")) == held  # once each
    trace = [json.loads(line) for line in (tmp_path / "out" / "logs" / "batch_trace.jsonl").read_text().splitlines()]
    sources = [Source(name, 0.5, path=prepared) for name in urls]
    local = [build.open_source(s, request(prepared, Shuffle()))[0] for s in sources]
    one = ResumableLoader([Source(s.name, 0.5, data=d) for s, d in zip(sources, local)], 2, 0, 1, seed=42)
    for row in trace:
        batch = next(one)
        assert row["ranks"] == [[zlib.crc32(batch[0].numpy().tobytes())], [zlib.crc32(batch[1].numpy().tobytes())]]


# --------------------------------------------------------- issue 41: a cache disk full of earlier runs' shards

@pytest.mark.slow
def test_data_cache_gb_makes_room_on_a_disk_full_of_what_earlier_runs_left(gcs_emulator, prepared, tmp_path,
                                                                           subprocess_env):
    """A 100 kB disk (a tmpfs) that an earlier run's cached shards fill; a run of another dataset with the
    advice followed (data_cache_gb within the disk) trains to the end: the earlier run's shards make room first,
    its description stays (real train.py runs, the GCS emulator). It stopped for no space whatever the bound."""
    env = {**subprocess_env, "STORAGE_EMULATOR_HOST": gcs_emulator.url}
    first, second = (upload(prepared, f"gs://{gcs_emulator.bucket}/{name}") for name in ("first", "second"))
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=100k", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("needs root to mount a small tmpfs")
    try:
        blocks = ["shuffle=blocks", "shuffle_block_shards=2", f"data_cache_dir={mount}"]
        train(tmp_path / "first", first, env, *blocks, check=False)  # unbounded: stops when the disk is full
        left = mount / gcs_emulator.bucket / "first"
        assert shutil.disk_usage(mount).free < 8192 and list((left / "rank-0").rglob("*.npz"))
        proc = train(tmp_path / "second", second, env, *blocks, f"data_cache_gb={34_000 / 1e9}")
        assert (tmp_path / "second" / "final_model").is_dir() and "Traceback" not in proc.stderr
        assert not list((left / "rank-0").rglob("*.npz")) and (left / DATASET_FILE).is_file()
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_a_cache_folder_this_user_may_not_write_is_a_permissions_line(bucket, open_tmp):
    """data_cache_dir in another user's folder: one line naming it, its owner and what to do about permissions
    (a real unprivileged process, the GCS emulator); it was given the advice for a full disk."""
    from tests.e2e.test_one_line_errors import NOBODY, as_nobody_ok, run_py

    if not as_nobody_ok():
        pytest.skip("needs root and setpriv to run as an unprivileged user")
    cache = open_tmp / "cache"
    cache.mkdir()  # root's, 0755
    code = ("from utils.errors import UserError; from utils.data.source import Source\n"
            "from utils.data.stream_source import description_dir\n"
            f"try: description_dir(Source('data', path={bucket!r}), {str(cache)!r})\n"
            "except UserError as e: print('error:', e)")
    proc = run_py(["-c", code], user=NOBODY)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert f"error: cannot write {cache}/{bucket[5:].split('/')[0]} (Permission denied) ({cache} is owned by root); " \
           f"set data_cache_dir to a folder you may write" in proc.stdout, proc.stdout
    assert "free space" not in proc.stdout
