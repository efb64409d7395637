"""prepare_data.py at scale: the partition plan (big files cut anywhere, each document read once), the merge
refusing a missing completion record by name, the output written straight to a bucket (the GCS emulator)
and inputs read from one, and Ray tasks (a local Ray, 2 CPUs) writing the local pool's bytes even when a
worker is killed under a task."""
from __future__ import annotations

import gzip
import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.e2e.test_prepare_data import PREPARE, corpus, prepare, text, tokenizer, tree  # noqa: F401 (fixtures)
from tests.trainkit import REPO_ROOT
from utils.data.corpus import list_inputs, read_documents
from utils.data.partition import cut


def test_a_plan_cuts_jsonl_and_parquet_anywhere_reads_each_document_once_and_keeps_txt_and_gz_whole(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path / "c"
    root.mkdir()
    rng = random.Random(5)
    lines = [json.dumps({"text": text(rng, 5 + i % 40)}, ensure_ascii=i % 2 == 0) for i in range(400)]
    body = ("\n".join(lines[:200]) + "\n\n" + "\r\n".join(lines[200:]) + "\r\n").encode()  # a blank line, CRLF
    (root / "big.jsonl").write_bytes(body)
    rows = [text(rng, 3 + i % 30) for i in range(500)]
    pq.write_table(pa.table({"text": rows}), root / "rows.parquet", row_group_size=50)
    (root / "one.txt").write_text(text(rng, 900))
    with gzip.open(root / "packed.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": text(rng, 50)}) + "\n" for _ in range(60))
    inputs = list_inputs([str(root)])
    assert [f.key for f in inputs] == ["big.jsonl", "one.txt", "packed.jsonl.gz", "rows.parquet"]
    whole = [(f.key, position, doc) for f in inputs for position, doc in read_documents(f, "text")]
    assert len(whole) == 400 + 1 + 60 + 500
    assert [doc for key, _, doc in whole if key == "rows.parquet"] == rows
    assert [p for key, p, _ in whole if key == "rows.parquet"] == list(range(500))  # a row's position: its number
    offsets = [p for key, p, _ in whole if key == "big.jsonl"]  # a line's position: its first byte
    assert [body[p:].split(b"\n")[0].rstrip(b"\r").decode() for p in offsets] == lines
    for partition_bytes in (997, 4000, 1 << 30):
        partitions = cut(inputs, partition_bytes)
        for index, source in enumerate(inputs):  # each file's ranges tile it, in order
            spans = [(start, end) for pieces in partitions for i, start, end in pieces if i == index]
            assert spans[0][0] == 0 and spans[-1][1] == source.bytes
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
            assert len(spans) == 1 or source.splittable  # .txt and .gz whole
        sizes = [sum(end - start for _, start, end in pieces) for pieces in partitions]
        assert all(size >= partition_bytes for size in sizes[:-1])  # P from the bytes, the last not a sliver
        assert len(sizes) == 1 or sizes[-1] >= partition_bytes // 2
        read = [(inputs[i].key, position, doc) for pieces in partitions for i, start, end in pieces
                for position, doc in read_documents(inputs[i], "text", start, end)]
        assert read == whole  # every document once, in order, whatever the cut
    spread = cut(inputs, 4000)
    total = sum(f.bytes for f in inputs)
    assert total // 4000 - 3 <= len(spread) <= total // 4000  # two whole files and the remainder may shorten it
    assert sum(any(inputs[i].key == "big.jsonl" for i, _, _ in pieces) for pieces in spread) >= 4
    assert sum(any(inputs[i].key == "rows.parquet" for i, _, _ in pieces) for pieces in spread) >= 2


def test_merge_refuses_a_missing_completion_record_naming_it_and_a_rerun_redoes_only_that_partition(
        corpus, tokenizer, tmp_path, monkeypatch, subprocess_env):  # noqa: F811 - pytest fixtures imported above
    from utils.data import prepare as prep
    from utils.data.prepare import PrepareOptions

    root, _, _ = corpus
    settings = dict(shard_tokens=1024, partition_bytes=4000)
    prep.prepare([str(root)], str(tokenizer), tmp_path / "reference", PrepareOptions(**settings))
    out = tmp_path / "out"
    def killed(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(prep, "_merge", killed)  # every partition done, then killed before the merge
    with pytest.raises(KeyboardInterrupt):
        prep.prepare([str(root)], str(tokenizer), out, PrepareOptions(**settings))
    monkeypatch.undo()
    staging = tmp_path / ".out.staging"
    assert len(list(staging.glob("p*/done.json"))) == 4 and not out.exists()
    (staging / "p00002" / "done.json").unlink()
    args = ["--input", root, "--tokenizer", tokenizer, "--output", out, "--shard-tokens", 1024, "--partition-mb", 0.004,
            "--workers", 1]
    proc = prepare(args + ["--merge-only"], subprocess_env, check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(errors) == 1, proc.stderr
    assert errors[0].startswith(f"error: partition 2 of 4 has no completion record ({staging}/p00002/done.json)")
    assert not out.exists() and (staging / "p00001" / "done.json").is_file()  # refused, nothing lost
    proc = prepare(args, subprocess_env)
    assert ("; 3 of 4 partitions already done" in proc.stdout
            and "4 partition(s), 3 done by an earlier run" in proc.stdout)
    assert tree(out) == tree(tmp_path / "reference") and not staging.exists()


def test_output_straight_to_a_bucket_holds_the_same_bytes_and_inputs_can_come_from_one(
        corpus, tokenizer, tmp_path, subprocess_env, gcs_emulator):  # noqa: F811 - pytest fixtures imported above
    from utils.data.prepare import PrepareOptions
    from utils.data.prepare import prepare as prepare_in_process
    from utils.io.storage import upload_directory

    root, _, _ = corpus
    settings = dict(shard_tokens=1024, partition_bytes=4000)
    prepare_in_process([str(root)], str(tokenizer), tmp_path / "reference", PrepareOptions(**settings))
    reference = tree(tmp_path / "reference")
    url = f"gs://{gcs_emulator.bucket}/datasets/mine"
    subprocess_env["STORAGE_EMULATOR_HOST"] = gcs_emulator.url
    proc = prepare(["--input", root, "--output", url, "--tokenizer", tokenizer, "--shard-tokens", 1024,
                    "--partition-mb", 0.004, "--workers", 2], subprocess_env)  # two processes write to the bucket
    assert f"in {url}; validation:" in proc.stdout
    client = gcs_emulator.client()
    bucket = {b.name: b.download_as_bytes() for b in client.list_blobs(gcs_emulator.bucket)}
    assert {name.removeprefix("datasets/mine/"): data for name, data in bucket.items()} == reference  # no staging left
    assert prepare_in_process([str(root)], str(tokenizer), url, PrepareOptions(**settings)).reused
    # the corpus read from a bucket: the same shards, the same split (a file's key is its path below the prefix)
    upload_directory(client, root, f"gs://{gcs_emulator.bucket}/corpus", last=())
    prepare_in_process([f"gs://{gcs_emulator.bucket}/corpus"], str(tokenizer), tmp_path / "from-bucket",
                       PrepareOptions(**settings))

    def shards(files):
        return {name: data for name, data in files.items() if name.endswith(".npz")}

    assert shards(tree(tmp_path / "from-bucket")) == shards(reference) and len(shards(reference)) >= 5


def cmdline(process) -> list[str]:
    """A psutil process's command line; none for one that has ended or is a zombie by now (a Ray process may end
    between being listed and being read)."""
    import psutil

    try:
        return process.cmdline()
    except psutil.Error:
        return []


def running(process) -> bool:
    """Whether a psutil process still runs (not ended, not a zombie waiting for its parent)."""
    import psutil

    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def ray_task_workers(root_pid: int) -> list[int]:
    """Processes under `root_pid` running a Ray partition task right now (Ray titles them by the task)."""
    parents, titles = {}, {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                titles[int(entry.name)] = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            except (OSError, IndexError, ValueError):
                continue

    def under(pid: int) -> bool:
        while pid > 1:
            pid = parents.get(pid, 0)
            if pid == root_pid:
                return True
        return False

    return [pid for pid, title in titles.items() if title.startswith("ray::_ray_task") and under(pid)]


@pytest.mark.slow
def test_ray_writes_the_local_pools_bytes_and_retries_a_task_whose_worker_is_killed(
        tokenizer, tmp_path, subprocess_env):  # noqa: F811 - a pytest fixture imported above
    from utils.data.prepare import PrepareOptions
    from utils.data.prepare import prepare as prepare_in_process

    big = tmp_path / "big"
    big.mkdir()
    rng = random.Random(4)
    with open(big / "many.jsonl", "w") as f:
        for _ in range(5_000):
            f.write(json.dumps({"text": text(rng, 60)}) + "\n")
    (big / "short.txt").write_text(text(rng, 200))
    settings = dict(shard_tokens=4096, partition_bytes=500_000)
    local = prepare_in_process([str(big)], str(tokenizer), tmp_path / "local", PrepareOptions(workers=1, **settings))
    out = tmp_path / "ray"
    proc = subprocess.Popen(PREPARE + ["--input", str(big), "--tokenizer", str(tokenizer), "--output", str(out),
                                       "--shard-tokens", "4096", "--partition-mb", "0.5", "--executor", "ray",
                                       "--workers", "2", "--no-progress"],
                            env=subprocess_env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    killed, deadline = None, time.time() + 300
    while killed is None and proc.poll() is None and time.time() < deadline:
        busy = ray_task_workers(proc.pid)
        if busy:
            killed = busy[0]
            os.kill(killed, signal.SIGKILL)  # a worker lost mid-task, as on a preempted node
        time.sleep(0.01)
    stdout, stderr = proc.communicate(timeout=300)
    assert killed is not None, "no Ray task was seen running"
    assert proc.returncode == 0, stderr
    assert local.partitions == 5 and "; 0 of 5 partitions already done" in stdout and "5 partition(s):" in stdout
    assert tree(out) == tree(tmp_path / "local")  # every shard, dataset.json and plan.json, byte for byte


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_killed_ray_driver_leaves_no_ray_process(
        tokenizer, tmp_path, subprocess_env, sig):  # noqa: F811 - a pytest fixture imported above
    """prepare with a local Ray, SIGKILLed mid-partition (the OOM killer): within 30 s nothing of its Ray
    session runs any more (GCS server, raylet, agents, log monitor, workers), and its temp dir is gone.
    SIGTERM: the same, and prepare itself ends within seconds with its interrupted line (exit 130)."""
    import psutil

    big = tmp_path / "big"
    big.mkdir()
    rng = random.Random(6)
    for i in range(3):
        (big / f"d{i}.txt").write_text(text(rng, 30_000))
    env = {**subprocess_env, "NEOX_DEBUG_PARTITION_DELAY_S": "120"}  # every partition stays in flight
    proc = subprocess.Popen(PREPARE + ["--input", str(big), "--tokenizer", str(tokenizer), "--output",
                                       str(tmp_path / "out"), "--partition-mb", "0.15", "--executor", "ray",
                                       "--workers", "2", "--no-progress"],
                            env=env, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while not ray_task_workers(proc.pid):
            assert proc.poll() is None and time.time() < deadline, "no Ray task was seen running"
            time.sleep(0.2)
        started = psutil.Process(proc.pid).children(recursive=True)
        sessions = {arg.split("/session_")[0].split("=")[-1] for p in started for arg in cmdline(p)
                    if "/session_" in arg}
        assert len(sessions) == 1 and len(started) >= 4, (sessions, [cmdline(p)[:2] for p in started])
        (session,) = sessions
        proc.send_signal(sig)
        signalled = time.time()
        _, err = proc.communicate(timeout=60)
        if sig == signal.SIGTERM:
            assert proc.returncode == 130 and time.time() - signalled < 20, (proc.returncode, err[-2000:])
            assert "Traceback" not in err and "interrupted: nothing was published" in err, err[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()

    def left() -> list:
        named = [p for p in psutil.process_iter(["cmdline"]) if session in " ".join(p.info["cmdline"] or ())]
        return [p for p in started + named if running(p)]

    deadline = time.time() + 30
    while left() and time.time() < deadline:
        time.sleep(0.5)
    still = left()
    try:
        assert not still, [(p.pid, " ".join(cmdline(p))[:120]) for p in still]
        assert not Path(session).exists(), f"{session} was left"
    finally:
        for p in still:  # never leave a stray Ray for the tests after this one
            try:
                p.kill()
            except psutil.Error:
                pass
