"""download_training_data.py end to end: the real CLI in a subprocess against a real GCS emulator."""
from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from utils.io.storage import file_crc32c, list_objects, local_matches, make_client

PREFIX = "datasets/tokenized"
SECRET = "SECRET-KEY-MATERIAL-d41d8cd9"
SUMMARY_RE = re.compile(r"downloaded (\d+), skipped (\d+), failed (\d+), ([\d.]+) MB in")


def shard_bytes(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    rows = int(rng.integers(4, 40))
    np.savez(buf, input_ids=rng.integers(0, 50_000, size=(rows, 64), dtype=np.uint16))
    return buf.getvalue()


@pytest.fixture
def bucket_of_shards(gcs_emulator):
    """24 small shards nested two levels deep under gs://BUCKET/PREFIX, plus files the sync must ignore."""
    bucket = make_client().bucket(gcs_emulator.bucket)
    names = [f"{PREFIX}/part-{p}/sub-{s}/shard-{i:03d}.npz" for p in range(3) for s in range(2) for i in range(4)]
    content = {}
    for seed, name in enumerate(names):
        content[name] = shard_bytes(seed)
        bucket.blob(name).upload_from_string(content[name])
    bucket.blob(f"{PREFIX}/README.txt").upload_from_string(b"not a shard")
    bucket.blob(f"{PREFIX}x/elsewhere.npz").upload_from_string(shard_bytes(99))  # a sibling prefix
    return content


def run_cli(env: dict, repo_root: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    # Run from another folder: the script must find the repo by itself.
    return subprocess.run([sys.executable, str(repo_root / "download_training_data.py"), "--no-progress", *args],
                          env=env, cwd="/", capture_output=True, text=True, timeout=timeout)


def summary(proc: subprocess.CompletedProcess) -> tuple[int, int, int]:
    m = SUMMARY_RE.search(proc.stdout)
    assert m, f"no summary line in:\n{proc.stdout}\n{proc.stderr}"
    return int(m[1]), int(m[2]), int(m[3])


def local_files(dest: Path) -> dict[str, bytes]:
    return {p.relative_to(dest).as_posix(): p.read_bytes() for p in dest.rglob("*") if p.is_file()}


@pytest.fixture
def env(gcs_emulator, subprocess_env):
    return {**subprocess_env, "STORAGE_EMULATOR_HOST": gcs_emulator.url}


def test_sync_then_skip_then_repair(gcs_emulator, bucket_of_shards, env, repo_root, tmp_path):
    dest = tmp_path / "data" / "training"
    source = f"gs://{gcs_emulator.bucket}/{PREFIX}"
    expected = {name[len(PREFIX) + 1:]: data for name, data in bucket_of_shards.items()}

    first = run_cli(env, repo_root, "--source", source, "--dest", str(dest), "--workers", "4")
    assert first.returncode == 0, first.stderr
    assert summary(first) == (24, 0, 0)
    assert local_files(dest) == expected  # same nesting, nothing else (no README, no sibling prefix)

    second = run_cli(env, repo_root, "--source", source + "/", "--dest", str(dest))
    assert second.returncode == 0, second.stderr
    assert summary(second) == (0, 24, 0)

    truncated, flipped = "part-0/sub-1/shard-002.npz", "part-2/sub-0/shard-003.npz"
    with open(dest / truncated, "r+b") as f:
        f.truncate(100)
    data = bytearray((dest / flipped).read_bytes())
    data[len(data) // 2] ^= 0x01
    (dest / flipped).write_bytes(bytes(data))  # same size, one bit differs
    assert (dest / flipped).stat().st_size == len(expected[flipped])

    third = run_cli(env, repo_root, "--source", source, "--dest", str(dest), "--workers", "2")
    assert third.returncode == 0, third.stderr
    assert summary(third) == (2, 22, 0)
    assert local_files(dest) == expected


def test_max_files_and_dry_run(gcs_emulator, bucket_of_shards, env, repo_root, tmp_path):
    source = f"gs://{gcs_emulator.bucket}/{PREFIX}"
    dry = tmp_path / "dry"
    proc = run_cli(env, repo_root, "--source", source, "--dest", str(dry), "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "dry run: would download 24" in proc.stdout
    assert proc.stdout.count("would download gs://") == 24
    assert not dry.exists()

    dest = tmp_path / "few"
    proc = run_cli(env, repo_root, "--source", source, "--dest", str(dest), "--max-files", "5")
    assert proc.returncode == 0, proc.stderr
    assert summary(proc) == (5, 0, 0)
    first_five = sorted(bucket_of_shards)[:5]
    assert sorted(local_files(dest)) == [n[len(PREFIX) + 1:] for n in first_five]

    proc = run_cli(env, repo_root, "--source", source, "--dest", str(dest), "--dry-run")
    assert "dry run: would download 19" in proc.stdout and "skip 5" in proc.stdout
    assert len(local_files(dest)) == 5


def test_bad_source_and_empty_prefix(gcs_emulator, env, repo_root, tmp_path):
    for bad in ("s3://bucket/data", "data/training", "gs://"):
        proc = run_cli(env, repo_root, "--source", bad, "--dest", str(tmp_path / "d"))
        assert proc.returncode == 2, (bad, proc.stderr)
        assert "--source" in proc.stderr and "gs://BUCKET" in proc.stderr
        assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1

    proc = run_cli(env, repo_root, "--source", f"gs://{gcs_emulator.bucket}/no/such/prefix", "--dest",
                   str(tmp_path / "d"))
    assert proc.returncode == 1
    assert "no objects ending in '.npz' under gs://" in proc.stderr and "Traceback" not in proc.stderr


def test_credentials_errors_are_one_readable_line(subprocess_env, repo_root, tmp_path):
    env = {k: v for k, v in subprocess_env.items() if k != "STORAGE_EMULATOR_HOST"}
    missing = tmp_path / "nowhere" / "key.json"
    env["GOOGLE_APPLICATION_CREDENTIALS"] = str(missing)
    proc = run_cli(env, repo_root, "--source", "gs://some-bucket/data", "--dest", str(tmp_path / "d"))
    assert proc.returncode == 1
    assert str(missing) in proc.stderr and "does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1

    for name, content in [
        ("broken.json", "{ not json at all " + SECRET),
        ("user.json", json.dumps({"type": "authorized_user", "client_secret": SECRET, "refresh_token": SECRET})),
        ("bad-sa.json", json.dumps({"type": "service_account", "project_id": "p", "private_key_id": "k",
                                    "private_key": f"-----BEGIN PRIVATE KEY-----\n{SECRET}\n"
                                                   "-----END PRIVATE KEY-----\n",
                                    "client_email": "x@p.iam.gserviceaccount.com",
                                    "token_uri": "https://oauth2.googleapis.com/token"})),
    ]:
        key = tmp_path / name
        key.write_text(content)
        env["GOOGLE_APPLICATION_CREDENTIALS"] = str(key)
        proc = run_cli(env, repo_root, "--source", "gs://some-bucket/data", "--dest", str(tmp_path / "d"))
        assert proc.returncode == 1, name
        assert str(key) in proc.stderr, name
        assert SECRET not in proc.stdout + proc.stderr, name
        assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "d").exists()


def test_interrupted_download_leaves_no_bad_final_file(gcs_emulator, env, repo_root, tmp_path):
    """kill -9 in the middle of a sync: every file at its final name is complete and verified; the next
    sync removes the dead process's temporary files and finishes."""
    bucket = make_client().bucket(gcs_emulator.bucket)
    rng = np.random.default_rng(0)
    big = 96 * 1024 * 1024
    for i in range(3):
        bucket.blob(f"big/shard-{i}.npz").upload_from_string(rng.bytes(big + i))
    for i in range(3):
        bucket.blob(f"big/small/s-{i}.npz").upload_from_string(shard_bytes(i))
    objects = list_objects(make_client(), gcs_emulator.bucket, "big")
    dest = tmp_path / "dest"

    cmd = [sys.executable, str(repo_root / "download_training_data.py"), "--no-progress",
           "--source", f"gs://{gcs_emulator.bucket}/big", "--dest", str(dest), "--workers", "1"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    caught = None
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline and caught is None:
        for p in dest.rglob(".*.partial-*") if dest.exists() else ():
            try:
                if p.stat().st_size > 1024 * 1024:  # really mid-way through a large object
                    caught = p
            except FileNotFoundError:
                pass
        time.sleep(0.002)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()
    assert caught is not None, "the sync finished before it could be interrupted; make the objects bigger"
    assert proc.returncode == -signal.SIGKILL

    finals = [o for o in objects if (dest / o.name[len("big/"):]).exists()]
    assert len(finals) < len(objects), "the process was killed before finishing"
    for obj in finals:
        assert local_matches(dest / obj.name[len("big/"):], obj), obj.name
    leftovers = list(dest.rglob(".*.partial-*"))
    assert leftovers, "the killed process left its temporary file (allowed; the next run must clean it)"

    again = run_cli(env, repo_root, "--source", f"gs://{gcs_emulator.bucket}/big", "--dest", str(dest))
    assert again.returncode == 0, again.stderr
    downloaded, skipped, failed = summary(again)
    assert (downloaded + skipped, failed) == (len(objects), 0) and downloaded >= 1
    assert skipped == len(finals)
    for obj in objects:
        path = dest / obj.name[len("big/"):]
        assert file_crc32c(path) == obj.crc32c and path.stat().st_size == obj.size
    assert list(dest.rglob(".*.partial-*")) == []


def test_a_failed_object_fails_the_run_and_names_it(gcs_emulator, bucket_of_shards, env, repo_root, tmp_path):
    dest = tmp_path / "d"
    blocked = "part-1/sub-0/shard-001.npz"
    (dest / blocked).mkdir(parents=True)  # a folder where the shard must go: that one download cannot land
    proc = run_cli(env, repo_root, "--source", f"gs://{gcs_emulator.bucket}/{PREFIX}", "--dest", str(dest))
    assert proc.returncode == 1
    assert summary(proc) == (23, 0, 1)
    url = f"gs://{gcs_emulator.bucket}/{PREFIX}/{blocked}"
    assert f"error: 1 object failed: {url}" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert (dest / blocked).is_dir() and len([p for p in dest.rglob("*.npz") if p.is_file()]) == 23
