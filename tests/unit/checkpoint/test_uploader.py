"""BackgroundUploader against a real GCS emulator: verified uploads off the training thread, bounded waits,
failures reported (never raised), the local copy untouched."""
from __future__ import annotations

import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from utils.checkpoint.upload import BackgroundUploader
from utils.io.storage import file_crc32c, make_client


def make_checkpoint(root: Path, name: str, seed: int = 0) -> Path:
    path = root / name
    (path / "rng").mkdir(parents=True)
    rnd = random.Random(seed)
    (path / "model.safetensors").write_bytes(rnd.randbytes(2_000_000))
    (path / "optimizer.pt").write_bytes(rnd.randbytes(500_000))
    (path / "rng" / "rank0.pt").write_bytes(rnd.randbytes(100))
    (path / "trainer_state.json").write_text('{"step": 10}')
    (path / "manifest.json").write_text('{"files": 4}')
    return path


def snapshot(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in path.rglob("*") if p.is_file()}


def assert_uploaded(client, bucket: str, local: Path, prefix: str):
    blobs = {b.name: b for b in client.list_blobs(bucket, prefix=prefix + "/")}
    files = snapshot(local)
    assert sorted(blobs) == sorted(f"{prefix}/{rel}" for rel in files)
    for rel in files:
        assert blobs[f"{prefix}/{rel}"].crc32c == file_crc32c(local / rel), rel
    manifest = blobs[f"{prefix}/manifest.json"]
    assert all(manifest.generation >= b.generation for b in blobs.values())


class GatedFactory:
    """make_client, but held until `release()`: an upload that is 'still running' for as long as we like."""

    def __init__(self):
        self.gate = threading.Event()
        self.calls = 0

    def __call__(self):
        self.calls += 1
        assert self.gate.wait(30)
        return make_client()

    def release(self):
        self.gate.set()


def test_background_upload_completes_and_verifies(gcs_emulator, tmp_path):
    lines = []
    uploader = BackgroundUploader(log=lines.append)
    assert uploader.thread.daemon and uploader.thread.is_alive()
    ck1 = make_checkpoint(tmp_path / "checkpoints", "checkpoint-epoch0-step10-files0", seed=1)
    ck2 = make_checkpoint(tmp_path / "checkpoints", "checkpoint-epoch0-step20-files1", seed=2)
    before = {ck1: snapshot(ck1), ck2: snapshot(ck2)}
    base = f"gs://{gcs_emulator.bucket}/runs/demo/checkpoints"
    uploader.submit(ck1, f"{base}/{ck1.name}")
    first = uploader.drain(timeout=60)
    uploader.submit(ck2, f"{base}/{ck2.name}")  # one after the other, as checkpoints come (a newer one
    report = uploader.drain(timeout=60)          # submitted while an older one still waits supersedes it)
    report.merge(first)
    assert report.failed == []
    assert sorted(report.succeeded) == [f"{base}/{ck1.name}", f"{base}/{ck2.name}"]
    assert uploader.protected() == set()
    client = make_client()
    for ck in (ck1, ck2):
        assert_uploaded(client, gcs_emulator.bucket, ck, f"runs/demo/checkpoints/{ck.name}")
        assert snapshot(ck) == before[ck]  # the local copy is untouched
    assert len(lines) == 2 and all(line.startswith("uploaded ") for line in lines)

    assert uploader.drain(timeout=1).succeeded == []  # each result is reported once
    final = uploader.close(timeout=10)
    assert final.failed == [] and not uploader.thread.is_alive()
    with pytest.raises(RuntimeError):
        uploader.submit(ck1, f"{base}/again")


def test_submit_never_blocks_and_a_newer_checkpoint_supersedes_a_waiting_one(gcs_emulator, tmp_path):
    factory = GatedFactory()
    lines = []
    uploader = BackgroundUploader(client_factory=factory, log=lines.append)
    cks = [make_checkpoint(tmp_path, f"checkpoint-epoch0-step{i}-files0", seed=i) for i in (1, 2, 3)]
    base = f"gs://{gcs_emulator.bucket}/ck"
    uploader.submit(cks[0], f"{base}/{cks[0].name}")  # taken by the thread, which waits for its client
    deadline = time.monotonic() + 10
    while factory.calls == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    started = time.monotonic()
    uploader.submit(cks[1], f"{base}/{cks[1].name}")  # waits its turn
    uploader.submit(cks[2], f"{base}/{cks[2].name}")  # supersedes the waiting one: GCS needs the newest
    assert time.monotonic() - started < 0.5, "submit must never block the writer thread (and so training)"
    assert uploader.protected() == {cks[0].resolve(), cks[2].resolve()}
    assert any(f"upload of {cks[1].name} skipped" in line for line in lines)

    timed_out = uploader.drain(timeout=0.2)
    assert timed_out.succeeded == [] and timed_out.superseded == [f"{base}/{cks[1].name}"]
    assert sorted(url for url, _ in timed_out.failed) == [f"{base}/{cks[0].name}", f"{base}/{cks[2].name}"]
    assert all("not finished after 0.2 s" in msg for _, msg in timed_out.failed)

    factory.release()
    report = uploader.close(timeout=60)
    assert report.failed == []
    assert report.succeeded == [f"{base}/{cks[0].name}", f"{base}/{cks[2].name}"]
    assert uploader.protected() == set() and factory.calls == 1  # one client, made in the upload thread
    names = {b.name.split("/")[1] for b in make_client().list_blobs(gcs_emulator.bucket, prefix="ck/")}
    assert names == {cks[0].name, cks[2].name}


def test_other_nodes_files_of_a_superseded_checkpoint_are_removed(gcs_emulator, tmp_path):
    """Several nodes without a shared dir: node 1 uploaded its shards of every checkpoint itself. When rank
    0's upload of one is superseded, its manifest never goes up, and node 1's files there are deleted; a
    checkpoint whose manifest is in GCS is never touched."""
    from utils.checkpoint.upload import remove_incomplete_upload
    from utils.io.storage import upload_verified

    factory, lines = GatedFactory(), []
    uploader = BackgroundUploader(client_factory=factory, log=lines.append, clean_superseded=True)
    cks = [make_checkpoint(tmp_path, f"checkpoint-epoch0-step{i}-files0", seed=i) for i in (1, 2, 3)]
    base, client = f"gs://{gcs_emulator.bucket}/ck", make_client()
    shard = tmp_path / "node1-shard"
    shard.write_bytes(b"node 1's shard")
    for ck in cks:  # node 1's part of each checkpoint, uploaded by node 1
        upload_verified(client, gcs_emulator.bucket, shard, f"ck/{ck.name}/dcp/__1_0.distcp")
    uploader.submit(cks[0], f"{base}/{cks[0].name}")
    deadline = time.monotonic() + 10
    while factory.calls == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    uploader.submit(cks[1], f"{base}/{cks[1].name}")
    uploader.submit(cks[2], f"{base}/{cks[2].name}")  # supersedes cks[1]
    factory.release()
    assert uploader.close(timeout=60).succeeded == [f"{base}/{cks[0].name}", f"{base}/{cks[2].name}"]
    names = {b.name for b in client.list_blobs(gcs_emulator.bucket, prefix="ck/")}
    assert not [n for n in names if cks[1].name in n]
    for ck in (cks[0], cks[2]):
        assert f"ck/{ck.name}/dcp/__1_0.distcp" in names and f"ck/{ck.name}/manifest.json" in names
    assert any(f"removed 1 file(s) other nodes had uploaded to {base}/{cks[1].name}" in line for line in lines)
    assert remove_incomplete_upload(client, f"{base}/{cks[2].name}") == 0  # complete: left alone
    assert f"ck/{cks[2].name}/dcp/__1_0.distcp" in {b.name for b in client.list_blobs(gcs_emulator.bucket)}


def test_a_failed_upload_stays_protected_until_a_newer_one_reaches_gcs(gcs_emulator, tmp_path):
    uploader = BackgroundUploader(retries=0, log=lambda line: None)
    old, new = (make_checkpoint(tmp_path, f"checkpoint-epoch0-step{i}-files0", seed=i) for i in (1, 2))
    base = f"gs://{gcs_emulator.bucket}/ck"
    bad_url = "gs://no-such-bucket-here/ck/" + old.name
    uploader.submit(old, bad_url)
    failed = uploader.drain(timeout=60)
    assert [u for u, _ in failed.failed] == [bad_url]
    assert uploader.protected() == {old.resolve()}  # not in GCS: retention must keep it
    line = failed.summary()[0]
    assert line.startswith(f"upload of {bad_url} failed") and f"only on local disk at {old.resolve()}" in line
    assert f"python -m utils.checkpoint.upload {old.resolve()} {bad_url}" in line

    uploader.submit(new, f"{base}/{new.name}")
    report = uploader.close(timeout=60)
    assert report.succeeded == [f"{base}/{new.name}"] and report.failed == []
    assert uploader.protected() == set()  # GCS now holds a newer checkpoint: the old one may go


@pytest.mark.slow
def test_the_manual_upload_command(gcs_emulator, tmp_path, subprocess_env, repo_root):
    ck = make_checkpoint(tmp_path, "checkpoint-epoch0-step3-files0")
    url = f"gs://{gcs_emulator.bucket}/manual/{ck.name}"
    proc = subprocess.run([sys.executable, "-m", "utils.checkpoint.upload", str(ck), url], env=subprocess_env,
                          cwd=repo_root, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert_uploaded(make_client(), gcs_emulator.bucket, ck, f"manual/{ck.name}")
    (ck / "manifest.json").unlink()
    proc = subprocess.run([sys.executable, "-m", "utils.checkpoint.upload", str(ck), url], env=subprocess_env,
                          cwd=repo_root, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "not a complete checkpoint" in proc.stderr and "Traceback" not in proc.stderr


def test_unreachable_storage_is_reported_not_raised(gcs_emulator, tmp_path):
    lines = []
    uploader = BackgroundUploader(retries=1, log=lines.append)
    ck = make_checkpoint(tmp_path, "checkpoint-epoch0-step5-files0")
    before = snapshot(ck)
    url = f"gs://{gcs_emulator.bucket}/ck/{ck.name}"
    gcs_emulator.stop()

    started = time.monotonic()
    uploader.submit(ck, url)
    assert time.monotonic() - started < 1.0  # training goes on at once
    report = uploader.drain(timeout=60)
    assert time.monotonic() - started < 30  # bounded retries, not the library's 120 s default
    assert report.succeeded == []
    assert [u for u, _ in report.failed] == [url]
    assert "failed after 2 attempts" in report.failed[0][1]
    assert snapshot(ck) == before
    assert any(line.startswith("upload FAILED") and url in line for line in lines)
    assert uploader.thread.is_alive()  # one failure does not stop later uploads
    assert uploader.close(timeout=5).failed == []  # already reported by drain


def test_synchronous_mode_uploads_in_the_callers_thread(gcs_emulator, tmp_path):
    seen_threads = []

    def factory():
        seen_threads.append(threading.current_thread())
        return make_client()

    uploader = BackgroundUploader(client_factory=factory, synchronous=True, log=lambda line: None)
    assert uploader.thread is None
    ck = make_checkpoint(tmp_path, "checkpoint-epoch0-step7-files0")
    url = f"gs://{gcs_emulator.bucket}/sync/{ck.name}"
    uploader.submit(ck, url)
    assert seen_threads == [threading.main_thread()]
    assert_uploaded(make_client(), gcs_emulator.bucket, ck, f"sync/{ck.name}")  # done before submit returned
    assert uploader.protected() == set()
    assert uploader.close().succeeded == [url]

    failing = BackgroundUploader(synchronous=True, retries=0, log=lambda line: None)
    gcs_emulator.stop()
    failing.submit(ck, url)  # does not raise
    assert [u for u, _ in failing.close().failed] == [url]


def test_the_upload_thread_never_keeps_the_process_alive(gcs_emulator, subprocess_env, repo_root, tmp_path):
    ck = make_checkpoint(tmp_path, "checkpoint-epoch0-step1-files0")
    script = (
        "import threading, time\n"
        "from utils.checkpoint.upload import BackgroundUploader\n"
        "def stuck():\n"
        "    threading.Event().wait()\n"  # a client that never comes: an upload that never ends
        "u = BackgroundUploader(client_factory=stuck)\n"
        f"u.submit({str(ck)!r}, 'gs://{gcs_emulator.bucket}/x')\n"
        "print('report', u.drain(timeout=0.1).failed[0][1][:9])\n"
    )
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], env=subprocess_env, cwd=repo_root,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "report timed out" in proc.stdout
    assert time.monotonic() - started < 30
