"""utils/io/storage.py against a real in-process GCS emulator: checksums, verified transfers, listing, retries,
credentials."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from google.api_core import exceptions as api_exceptions

from utils.io import files, storage
from utils.io.storage import (
    CredentialsError,
    RemoteObject,
    StorageError,
    download_directory,
    download_verified,
    file_crc32c,
    list_objects,
    list_subdirectories,
    local_matches,
    make_client,
    object_exists,
    parse_gs_url,
    retry_call,
    upload_directory,
    upload_verified,
)

SECRET = "SECRET-KEY-MATERIAL-8f3a1c77"


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


# ------------------------------------------------------------------------------------------------ parsing


@pytest.mark.parametrize("url, expected", [
    ("gs://bucket/p/q/", ("bucket", "p/q")),
    ("gs://bucket/p/q", ("bucket", "p/q")),
    ("gs://bucket", ("bucket", "")),
    ("gs://bucket/", ("bucket", "")),
    ("gs://my-bucket.data_1/a", ("my-bucket.data_1", "a")),
])
def test_parse_gs_url(url, expected):
    assert parse_gs_url(url) == expected


@pytest.mark.parametrize("url, words", [
    ("s3://bucket/p", "gs://BUCKET"),
    ("bucket/p", "gs://BUCKET"),
    ("gs://", "no bucket"),
    ("gs:///p", "no bucket"),
    ("gs://Bad_Bucket!/p", "not a valid bucket name"),
])
def test_parse_gs_url_rejects(url, words):
    with pytest.raises(ValueError, match=words):
        parse_gs_url(url)


# ---------------------------------------------------------------------------------------------- checksums


def test_file_crc32c_matches_emulator(gcs_emulator, tmp_path):
    client = make_client()
    bucket = client.bucket(gcs_emulator.bucket)
    sizes = {"empty": 0, "one": 1, "small": 1000, "chunks": storage.CHUNK_BYTES + 12345}
    for name, size in sizes.items():
        path = write(tmp_path / name, os.urandom(size))
        bucket.blob(f"crc/{name}").upload_from_string(path.read_bytes())
        blob = bucket.get_blob(f"crc/{name}")
        assert file_crc32c(path) == blob.crc32c, name
    assert file_crc32c(tmp_path / "empty") == "AAAAAA=="  # crc32c of no bytes is 0


def test_local_matches(tmp_path):
    path = write(tmp_path / "f", b"hello world")
    obj = RemoteObject("x/f", 11, file_crc32c(path))
    assert local_matches(path, obj)
    assert not local_matches(tmp_path / "missing", obj)
    write(path, b"hello worle")  # same size, one byte differs
    assert not local_matches(path, obj)
    write(path, b"hello")
    assert not local_matches(path, obj)


# ------------------------------------------------------------------------------------------------ uploads


def test_upload_verified_and_emulator_checks_crc32c(gcs_emulator, tmp_path):
    client = make_client()
    path = write(tmp_path / "weights.bin", os.urandom(9 * 1024 * 1024 + 7))  # > 8 MiB: a resumable upload
    upload_verified(client, gcs_emulator.bucket, path, "ck/weights.bin")
    blob = client.bucket(gcs_emulator.bucket).get_blob("ck/weights.bin")
    assert blob.crc32c == file_crc32c(path) and blob.size == path.stat().st_size

    # The emulator (like GCS) refuses an upload whose declared crc32c does not match the bytes, and we
    # classify that 400 as a transient checksum error worth retrying.
    small = write(tmp_path / "small.bin", b"abc" * 100)
    with pytest.raises(api_exceptions.BadRequest) as info:
        client.bucket(gcs_emulator.bucket).blob("ck/bad.bin").upload_from_filename(
            str(path), crc32c_checksum_value=file_crc32c(small), retry=None)
    assert storage.is_transient(info.value)
    assert not object_exists(client, f"gs://{gcs_emulator.bucket}/ck/bad.bin")


def test_upload_directory_puts_manifest_last(gcs_emulator, tmp_path):
    client = make_client()
    local = tmp_path / "checkpoint-epoch0-step10-files1"
    files = {
        "manifest.json": b'{"complete": true}',
        "model.safetensors": os.urandom(300_000),
        "optimizer.pt": os.urandom(200_000),
        "rng/rank0.pt": os.urandom(100),
        "trainer_state.json": b"{}",
        "zzz.txt": b"last by name, but not by rule",
    }
    for rel, data in files.items():
        write(local / rel, data)
    url = f"gs://{gcs_emulator.bucket}/runs/demo/checkpoints/ck1"
    names = upload_directory(client, local, url)
    assert names[-1] == "runs/demo/checkpoints/ck1/manifest.json"
    assert sorted(names) == sorted(f"runs/demo/checkpoints/ck1/{rel}" for rel in files)

    blobs = {b.name: b for b in client.list_blobs(gcs_emulator.bucket, prefix="runs/demo/checkpoints/ck1/")}
    assert len(blobs) == len(files)
    for rel in files:
        assert blobs[f"runs/demo/checkpoints/ck1/{rel}"].crc32c == file_crc32c(local / rel)
    manifest = blobs.pop("runs/demo/checkpoints/ck1/manifest.json")
    # Generations are the server's creation clock: the manifest was created after every other object.
    assert all(manifest.generation > b.generation for b in blobs.values())
    assert all(manifest.time_created >= b.time_created for b in blobs.values())


def test_upload_missing_directory_is_a_storage_error(gcs_emulator, tmp_path):
    with pytest.raises(StorageError, match="not a directory"):
        upload_directory(make_client(), tmp_path / "nope", f"gs://{gcs_emulator.bucket}/x")


# ---------------------------------------------------------------------------------------------- downloads


def test_download_verified_rejects_a_checksum_mismatch(gcs_emulator, tmp_path):
    client = make_client()
    client.bucket(gcs_emulator.bucket).blob("d/a.npz").upload_from_string(b"x" * 5000)
    good = list_objects(client, gcs_emulator.bucket, "d")[0]
    dest = tmp_path / "out" / "a.npz"
    assert download_verified(client, gcs_emulator.bucket, good, dest) == 5000
    assert dest.read_bytes() == b"x" * 5000

    wrong = RemoteObject(good.name, good.size, "AAAAAA==")  # the listing says one thing, the bytes another
    dest2 = tmp_path / "out" / "b.npz"
    with pytest.raises(StorageError, match="crc32c"):
        download_verified(client, gcs_emulator.bucket, wrong, dest2, retries=1)
    assert not dest2.exists()
    assert sorted(p.name for p in dest.parent.iterdir()) == ["a.npz"]  # no temporary file left behind

    missing = RemoteObject("d/missing.npz", 1, "AAAAAA==")
    with pytest.raises(StorageError, match="not found"):
        download_verified(client, gcs_emulator.bucket, missing, tmp_path / "out" / "m.npz")


def test_a_download_is_fsynced_unless_its_copy_is_checked_again_before_reuse(gcs_emulator, tmp_path, monkeypatch):
    """The default (a synced dataset, a checkpoint) waits for the disk before the rename; the stream cache's
    copies (durable=False) do not, so its fetcher never queues behind another writer's flush."""
    import utils.io.storage as storage

    client = make_client()
    client.bucket(gcs_emulator.bucket).blob("f/a.npz").upload_from_string(b"y" * 3000)
    [obj] = list_objects(client, gcs_emulator.bucket, "f")
    synced = []
    real_fsync = storage.os.fsync
    monkeypatch.setattr(storage.os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or
                        real_fsync(fd))
    assert download_verified(client, gcs_emulator.bucket, obj, tmp_path / "durable" / "a.npz") == 3000
    assert len(synced) == 1 and "durable" in synced[0]
    assert download_verified(client, gcs_emulator.bucket, obj, tmp_path / "cache" / "a.npz", durable=False) == 3000
    assert len(synced) == 1 and (tmp_path / "cache" / "a.npz").read_bytes() == b"y" * 3000


def test_empty_object_round_trip(gcs_emulator, tmp_path):
    client = make_client()
    empty = write(tmp_path / "empty.npz", b"")
    upload_verified(client, gcs_emulator.bucket, empty, "e/empty.npz")
    [obj] = list_objects(client, gcs_emulator.bucket, "e")
    assert (obj.size, obj.crc32c) == (0, file_crc32c(empty))
    assert download_verified(client, gcs_emulator.bucket, obj, tmp_path / "back" / "empty.npz") == 0
    assert (tmp_path / "back" / "empty.npz").read_bytes() == b""


def test_clean_stale_partials(tmp_path):
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        host = files.host_tag()
        root = tmp_path / "data"
        dead_ours = write(root / "a" / f".x.npz.partial-{host}-{dead_pid}-ab12", b"1")
        live_ours = write(root / "a" / f".y.npz.partial-{host}-{live.pid}-cd34", b"1")
        being_written = files.temp_path(root / "a" / "v.npz")  # this process is writing it right now
        write(being_written, b"1")
        other_fresh = write(root / f".z.npz.partial-otherhost-{dead_pid}-ef56", b"1")
        other_old = write(root / "b" / f".w.npz.partial-otherhost-{dead_pid}-0a0b", b"1")
        os.utime(other_old, (1, 1))
        dead_dir = root / f".checkpoint-x.partial-{host}-{dead_pid}-99"
        write(dead_dir / "model.bin", b"1")
        keep = write(root / "a" / "x.npz", b"real shard")
        assert storage.clean_stale_partials(root) == 3
        assert not dead_ours.exists() and not other_old.exists() and not dead_dir.exists()
        assert live_ours.exists() and other_fresh.exists() and keep.exists() and being_written.exists()
        files.release_temp(being_written)
    finally:
        live.kill()
        live.wait()


def test_list_objects_is_recursive_sorted_and_folder_scoped(gcs_emulator):
    client = make_client()
    bucket = client.bucket(gcs_emulator.bucket)
    for name in ["data/b/2.npz", "data/a/1.npz", "data/a/readme.txt", "data/0.npz", "datax/3.npz", "other/4.npz"]:
        bucket.blob(name).upload_from_string(name.encode())
    names = [o.name for o in list_objects(client, gcs_emulator.bucket, "data")]
    assert names == ["data/0.npz", "data/a/1.npz", "data/b/2.npz"]  # not datax/
    assert [o.name for o in list_objects(client, gcs_emulator.bucket, "data/", suffix=None)] == [
        "data/0.npz", "data/a/1.npz", "data/a/readme.txt", "data/b/2.npz"]
    obj = list_objects(client, gcs_emulator.bucket, "data/a")[0]
    assert obj.size == len(b"data/a/1.npz") and obj.crc32c == bucket.get_blob("data/a/1.npz").crc32c
    assert list_objects(client, gcs_emulator.bucket, "nothing-here") == []


def test_download_directory_is_verified_and_atomic(gcs_emulator, tmp_path, monkeypatch):
    client = make_client()
    local = tmp_path / "src"
    payload = {"model.bin": os.urandom(50_000), "sub/state.json": b"{}", "manifest.json": b"{}"}
    for rel, data in payload.items():
        write(local / rel, data)
    url = f"gs://{gcs_emulator.bucket}/ckpts/run/c1"
    upload_directory(client, local, url)

    dest = tmp_path / "restore" / "c1"
    assert download_directory(client, url + "/", dest) == sum(len(d) for d in payload.values())
    for rel, data in payload.items():
        assert (dest / rel).read_bytes() == data
    assert sorted(p.name for p in dest.parent.iterdir()) == ["c1"]  # the temporary folder was renamed

    with pytest.raises(StorageError, match="already exists"):
        download_directory(client, url, dest)
    with pytest.raises(StorageError, match="no objects under"):
        download_directory(client, f"gs://{gcs_emulator.bucket}/ckpts/run/none", tmp_path / "restore" / "none")
    assert not (tmp_path / "restore" / "none").exists()

    # A failure after some files arrived leaves nothing at dest and no temporary folder.
    real = storage.download_verified
    calls = []

    def fail_second(*args, **kwargs):
        calls.append(args[2].name)
        if len(calls) == 2:
            raise StorageError("injected failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(storage, "download_verified", fail_second)
    dest2 = tmp_path / "restore" / "c1-again"
    with pytest.raises(StorageError, match="injected"):
        download_directory(client, url, dest2)
    assert len(calls) == 2
    assert sorted(p.name for p in dest2.parent.iterdir()) == ["c1"]


def test_list_subdirectories_and_object_exists(gcs_emulator):
    client = make_client()
    bucket = client.bucket(gcs_emulator.bucket)
    for name in ["ck/run/checkpoint-b/manifest.json", "ck/run/checkpoint-a/model.bin",
                 "ck/run/checkpoint-a/sub/x", "ck/run/loose-file.txt", "ck/runx/checkpoint-z/m"]:
        bucket.blob(name).upload_from_string(b"1")
    base = f"gs://{gcs_emulator.bucket}"
    assert list_subdirectories(client, f"{base}/ck/run") == ["checkpoint-a", "checkpoint-b"]
    assert list_subdirectories(client, f"{base}/ck/run/") == ["checkpoint-a", "checkpoint-b"]
    assert list_subdirectories(client, f"{base}/ck") == ["run", "runx"]
    assert list_subdirectories(client, base) == ["ck"]
    assert list_subdirectories(client, f"{base}/nothing") == []
    assert object_exists(client, f"{base}/ck/run/checkpoint-b/manifest.json")
    assert not object_exists(client, f"{base}/ck/run/checkpoint-a/manifest.json")
    assert not object_exists(client, f"{base}/ck/run/checkpoint-a")  # a "folder" is not an object


# ------------------------------------------------------------------------------------------------ retries


def test_retry_call_retries_transient_errors_then_succeeds():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise api_exceptions.ServiceUnavailable("try later")
        return "ok"

    assert retry_call(flaky, what="flaky call", retries=5, base_delay=0.01) == "ok"
    assert len(calls) == 3


def test_retry_call_does_not_retry_404_or_403():
    for exc in (api_exceptions.NotFound("gone"), api_exceptions.Forbidden("no")):
        calls = []

        def failing(exc=exc, calls=calls):
            calls.append(1)
            raise exc

        with pytest.raises(type(exc)):
            retry_call(failing, what="x", retries=5, base_delay=0.01)
        assert len(calls) == 1


def test_retry_call_gives_up_with_a_storage_error():
    calls = []

    def always_429():
        calls.append(1)
        raise api_exceptions.TooManyRequests("slow down")

    with pytest.raises(StorageError, match="listing gs://b/p failed after 3 attempts") as info:
        retry_call(always_429, what="listing gs://b/p", retries=2, base_delay=0.01)
    assert len(calls) == 3
    assert isinstance(info.value.__cause__, api_exceptions.TooManyRequests)


def test_unreachable_server_is_transient_and_bounded(gcs_emulator):
    client = make_client()
    gcs_emulator.stop()
    calls = []

    def list_all():
        calls.append(1)
        return list(client.list_blobs(gcs_emulator.bucket, retry=None))

    with pytest.raises(StorageError, match="failed after 2 attempts"):
        retry_call(list_all, what="listing", retries=1, base_delay=0.01)
    assert len(calls) == 2


# -------------------------------------------------------------------------------------------- credentials


@pytest.fixture
def no_emulator(monkeypatch, tmp_path):
    """No emulator, no GOOGLE_APPLICATION_CREDENTIALS, an empty credentials/ folder."""
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    creds = tmp_path / "credentials"
    creds.mkdir()
    monkeypatch.setattr(storage, "CREDENTIALS_DIR", creds)
    return creds


def fake_service_account(path: Path, project: str = "proj-123") -> Path:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption()).decode()
    path.write_text(json.dumps({
        "type": "service_account", "project_id": project, "private_key_id": "k1", "private_key": pem,
        "client_email": f"trainer@{project}.iam.gserviceaccount.com", "client_id": "1",
        "token_uri": "https://oauth2.googleapis.com/token",
    }))
    return path


def test_make_client_uses_the_emulator(gcs_emulator, monkeypatch):
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", "/nonexistent/key.json")  # ignored with an emulator
    client = make_client()
    assert client.project == "test"
    assert [b.name for b in client.list_buckets()] == [gcs_emulator.bucket]


def test_make_client_missing_key_file_names_the_path(no_emulator, monkeypatch):
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", "/nonexistent/dir/key.json")
    with pytest.raises(CredentialsError, match="/nonexistent/dir/key.json.*does not exist"):
        make_client()


@pytest.mark.parametrize("content, words", [
    ("not json " + SECRET, "not valid JSON"),
    (json.dumps({"type": "authorized_user", "refresh_token": SECRET}), "not a service-account key"),
    (json.dumps({"type": "service_account", "private_key": SECRET, "client_email": "a@b.c",
                 "token_uri": "https://oauth2.googleapis.com/token"}), "not a usable service-account key"),
])
def test_make_client_bad_key_never_shows_its_contents(no_emulator, monkeypatch, tmp_path, content, words):
    key = tmp_path / "key.json"
    key.write_text(content)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(key))
    with pytest.raises(CredentialsError, match=words) as info:
        make_client()
    assert str(key) in str(info.value)
    assert info.value.__cause__ is None  # no chained library error that could quote the key
    assert info.value.__context__ is None or info.value.__suppress_context__
    assert SECRET not in str(info.value)


def test_make_client_reads_the_single_key_in_credentials_dir(no_emulator):
    fake_service_account(no_emulator / "trainer.json", project="proj-abc")
    client = make_client()
    assert client.project == "proj-abc"
    assert client._credentials.service_account_email == "trainer@proj-abc.iam.gserviceaccount.com"


def test_make_client_refuses_to_guess_between_keys(no_emulator):
    (no_emulator / "a.json").write_text("{}")
    (no_emulator / "b.json").write_text("{}")
    with pytest.raises(CredentialsError, match=r"several key files \(a.json, b.json\).*GOOGLE_APPLICATION_CREDENTIALS"):
        make_client()


def test_make_client_env_key_wins_over_credentials_dir(no_emulator, monkeypatch, tmp_path):
    (no_emulator / "a.json").write_text("{}")
    (no_emulator / "b.json").write_text("{}")
    key = fake_service_account(tmp_path / "explicit.json", project="proj-env")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(key))
    assert make_client().project == "proj-env"


def test_an_outage_line_names_the_host_and_the_reason_not_a_cut_off_client_message():
    """A refused connection (a real request to a port nothing listens on): the line names the host, port and
    reason, without urllib3's object reprs or a message cut mid-word; a long other message is cut at a word."""
    import requests

    from utils.io.storage import short_error

    with pytest.raises(requests.exceptions.ConnectionError) as refused:
        requests.get("http://127.0.0.1:9/storage/v1/b/bucket/o/shard?alt=media", timeout=5)
    line = short_error(refused.value)
    assert re.fullmatch(r"ConnectionError: no answer from 127\.0\.0\.1:9 "
                        r"\(\[Errno \d+\] Connection refused\)", line), line
    long = short_error(ValueError("alpha " * 100), limit=100)
    assert len(long) <= 100 and long.endswith("alpha ...") and "alph ..." not in long
