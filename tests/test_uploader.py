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

from utils.storage import file_crc32c, make_client
from utils.checkpoint.upload import BackgroundUploader


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
    uploader.submit(ck2, f"{base}/{ck2.name}")

    report = uploader.drain(timeout=60)
    assert report.failed == []
    assert report.succeeded == [f"{base}/{ck1.name}", f"{base}/{ck2.name}"]
    assert uploader.in_flight() == set()
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


def test_in_flight_protects_queued_and_running_uploads(gcs_emulator, tmp_path):
    factory = GatedFactory()
    uploader = BackgroundUploader(client_factory=factory, max_queue=1, log=lambda line: None)
    cks = [make_checkpoint(tmp_path, f"checkpoint-epoch0-step{i}-files0", seed=i) for i in (1, 2, 3)]
    base = f"gs://{gcs_emulator.bucket}/ck"
    uploader.submit(cks[0], f"{base}/{cks[0].name}")  # taken by the thread, which waits for its client
    deadline = time.monotonic() + 10
    while factory.calls == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    uploader.submit(cks[1], f"{base}/{cks[1].name}")  # fills the queue (max_queue=1)
    assert uploader.in_flight() == {cks[0].resolve(), cks[1].resolve()}

    # A third submit blocks while the queue is full, and returns once there is room.
    third = threading.Thread(target=uploader.submit, args=(cks[2], f"{base}/{cks[2].name}"))
    third.start()
    third.join(0.3)
    assert third.is_alive(), "submit should block while the bounded queue is full"
    assert cks[2].resolve() in uploader.in_flight()  # protected even while waiting for room

    timed_out = uploader.drain(timeout=0.2)
    assert timed_out.succeeded == []
    assert sorted(url for url, _ in timed_out.failed) == sorted(f"{base}/{c.name}" for c in cks)
    assert all("timed out" in msg for _, msg in timed_out.failed)

    factory.release()
    third.join(10)
    assert not third.is_alive()
    report = uploader.close(timeout=60)
    assert report.failed == []
    assert report.succeeded == [f"{base}/{c.name}" for c in cks]
    assert uploader.in_flight() == set() and factory.calls == 1  # one client, made in the upload thread


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
    assert uploader.in_flight() == set()
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
