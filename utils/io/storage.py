"""Google Cloud Storage: the one module that talks to GCS.

Every transfer is verified: downloads land under a temporary name and are renamed into place only after their
size and crc32c match the object's; uploads are checked against the local file's crc32c. Transient errors
(HTTP 408/429/5xx, dropped connections, checksum mismatches) are retried here, by `retry_call`, with
exponential backoff and jitter; the library's own retries are switched off so that `retries` bounds the
time a call can take. `STORAGE_EMULATOR_HOST` (e.g. `http://127.0.0.1:9023`) points every call at an emulator.
"""
from __future__ import annotations

import base64
import json
import os
import random
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import google_crc32c

from utils.errors import DiskFullError, UserError
from utils.io import files

REPO_ROOT = Path(__file__).resolve().parents[2]
CREDENTIALS_DIR = REPO_ROOT / "credentials"
CHUNK_BYTES = 8 * 1024 * 1024
MAX_BACKOFF_S = 30.0
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$")


class StorageError(UserError, RuntimeError):
    """A GCS operation failed; the message names the object or file and what to do."""


class CredentialsError(StorageError):
    """No usable credentials; the message names the key file (never its contents) and what to do."""


class ChecksumMismatch(StorageError):
    """A transfer's size or crc32c disagreed with the other side. Transient: `retry_call` retries it."""


# ---------------------------------------------------------------------------------------------- URLs, client


def parse_gs_url(url: str) -> tuple[str, str]:
    """`gs://bucket/a/b/` -> ("bucket", "a/b"); `gs://bucket` -> ("bucket", "")."""
    if not isinstance(url, str) or not url.startswith("gs://"):
        raise ValueError(f"expected a GCS url like gs://BUCKET/PREFIX, got {url!r}")
    bucket, _, prefix = url[len("gs://"):].partition("/")
    if not bucket:
        raise ValueError(f"no bucket name in {url!r}: expected gs://BUCKET/PREFIX")
    if not _BUCKET_RE.match(bucket):
        raise ValueError(
            f"{bucket!r} in {url!r} is not a valid bucket name "
            "(3-222 characters: lowercase letters, digits, '-', '_', '.')"
        )
    return bucket, prefix.strip("/")


def gs_url(bucket: str, name: str = "") -> str:
    return f"gs://{bucket}/{name}" if name else f"gs://{bucket}"


def join_name(prefix: str, rel: str) -> str:
    return f"{prefix}/{rel}" if prefix else rel


def folder_prefix(prefix: str) -> str:
    """A prefix as a folder: "a/b" -> "a/b/" so that "a/bc/..." is not listed; "" stays ""."""
    return f"{prefix}/" if prefix else ""


_THREAD_CLIENTS = threading.local()


def thread_client(factory=None):
    """This thread's GCS client from `factory` (default `make_client`), made on the thread's first call: a
    client holds a connection pool that threads should not share, and making one per call costs a
    credentials read. The threads that fetch, upload and download each keep theirs."""
    factory = factory or make_client
    clients = _THREAD_CLIENTS.__dict__.setdefault("by_factory", {})
    if factory not in clients:
        clients[factory] = factory()
    return clients[factory]


def make_client():
    """A `google.cloud.storage.Client`. Credentials, first match wins:
    STORAGE_EMULATOR_HOST (anonymous), GOOGLE_APPLICATION_CREDENTIALS (a service-account key file),
    the single `*.json` key in `credentials/`, the machine's default credentials."""
    from google.cloud import storage

    emulator = os.environ.get("STORAGE_EMULATOR_HOST", "").strip()
    if emulator:
        from google.auth.credentials import AnonymousCredentials

        options = None if "://" in emulator else {"api_endpoint": f"http://{emulator}"}
        project = os.environ.get("GOOGLE_CLOUD_PROJECT") or "test"
        return storage.Client(project=project, credentials=AnonymousCredentials(), client_options=options)

    env_key = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS", "").strip()
    if env_key:
        credentials, project = _load_service_account(Path(env_key).expanduser(), "GOOGLE_APPLICATION_CREDENTIALS")
        return storage.Client(project=project, credentials=credentials)

    keys = sorted(CREDENTIALS_DIR.glob("*.json")) if CREDENTIALS_DIR.is_dir() else []
    if len(keys) > 1:
        names = ", ".join(k.name for k in keys)
        raise CredentialsError(
            f"{CREDENTIALS_DIR} holds several key files ({names}); "
            "set GOOGLE_APPLICATION_CREDENTIALS to the one to use, or keep only one there"
        )
    if keys:
        credentials, project = _load_service_account(keys[0], f"the key in {CREDENTIALS_DIR}")
        return storage.Client(project=project, credentials=credentials)

    import google.auth
    from google.auth.exceptions import DefaultCredentialsError

    try:
        credentials, project = google.auth.default()
    except DefaultCredentialsError:
        raise CredentialsError(
            "no GCS credentials found: put a service-account key (JSON) in "
            f"{CREDENTIALS_DIR}/, or set GOOGLE_APPLICATION_CREDENTIALS to its path, or run "
            "`gcloud auth application-default login`; to use an emulator set STORAGE_EMULATOR_HOST"
        ) from None
    return storage.Client(project=project, credentials=credentials)


def _load_service_account(path: Path, source: str):
    """(credentials, project_id) from a service-account key. Errors name the path, never the contents."""
    from google.oauth2 import service_account

    fix = "point GOOGLE_APPLICATION_CREDENTIALS at a service-account key (JSON) downloaded from the GCP console"
    if not path.exists():
        raise CredentialsError(f"credentials file {path} (from {source}) does not exist; {fix}")
    if not path.is_file():
        raise CredentialsError(f"credentials path {path} (from {source}) is not a file; {fix}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CredentialsError(
            f"cannot read credentials file {path} (from {source}): {type(exc).__name__}; check its permissions"
        ) from None
    try:
        info = json.loads(text)
    except ValueError:
        raise CredentialsError(f"credentials file {path} (from {source}) is not valid JSON; {fix}") from None
    if not isinstance(info, dict) or info.get("type") != "service_account":
        kind = info.get("type") if isinstance(info, dict) else None
        kind = kind if isinstance(kind, str) and len(kind) < 40 else "missing"
        raise CredentialsError(
            f"credentials file {path} (from {source}) is not a service-account key (its type is {kind}); {fix}"
        )
    try:
        credentials = service_account.Credentials.from_service_account_info(info)
    except Exception as exc:  # noqa: BLE001 - google-auth / cryptography raise many types
        # a malformed key: never echo the library's message, it may quote the key
        raise CredentialsError(
            f"credentials file {path} (from {source}) is not a usable service-account key "
            f"({type(exc).__name__}: missing fields or an unparsable private key); {fix}"
        ) from None
    _warn_if_readable_by_others(path)
    return credentials, info.get("project_id")


_WARNED_KEYS: set[Path] = set()


def _warn_if_readable_by_others(path: Path) -> None:
    """A key other users may read is someone else's key too: said once per file and process (the key is
    used all the same: refusing would stop a run over a file mode)."""
    mode = path.stat().st_mode
    real = path.resolve()
    if not mode & 0o044 or real in _WARNED_KEYS:
        return
    _WARNED_KEYS.add(real)
    print(f"warning: credentials file {path} is readable by other users (mode {mode & 0o777:03o}); run "
          f"`chmod 600 {path}` so that only you can read it", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------- retries


def _transient_types() -> tuple[type, ...]:
    import http.client

    import requests
    import urllib3
    from google.api_core import exceptions as api

    types = [
        api.TooManyRequests, api.InternalServerError, api.BadGateway, api.ServiceUnavailable,
        api.GatewayTimeout, ConnectionError, TimeoutError, requests.ConnectionError, requests.Timeout,
        requests.exceptions.ChunkedEncodingError, http.client.IncompleteRead, http.client.BadStatusLine,
        http.client.ResponseNotReady, urllib3.exceptions.ProtocolError, urllib3.exceptions.TimeoutError,
        urllib3.exceptions.PoolError, ChecksumMismatch,
    ]
    try:
        from google.cloud.storage.exceptions import DataCorruption

        types.append(DataCorruption)
    except ImportError:
        pass
    try:
        from google.resumable_media.common import DataCorruption as ResumableDataCorruption

        types.append(ResumableDataCorruption)
    except ImportError:
        pass
    return tuple(types)


_TRANSIENT_STATUS = (408, 429, 500, 502, 503, 504)
_transient_cache: tuple[type, ...] | None = None


def is_transient(exc: BaseException) -> bool:
    """True for errors worth retrying: HTTP 408/429/5xx, dropped or refused connections, timeouts,
    checksum mismatches (also a 400 that reports one). 401/403/404 and other 4xx are not."""
    global _transient_cache
    if _transient_cache is None:
        _transient_cache = _transient_types()
    if isinstance(exc, _transient_cache):
        return True
    from google.api_core import exceptions as api
    from google.auth import exceptions as auth_exceptions

    if isinstance(exc, api.GoogleAPICallError):
        if exc.code in _TRANSIENT_STATUS:
            return True
        # GCS answers 400 when the crc32c/md5 sent with an upload does not match what arrived.
        return exc.code == 400 and bool(re.search(r"crc32c|md5", str(exc), re.IGNORECASE))
    if isinstance(exc, auth_exceptions.TransportError):
        return bool(exc.args) and isinstance(exc.args[0], BaseException) and is_transient(exc.args[0])
    response = getattr(exc, "response", None)  # google.resumable_media InvalidResponse
    status = getattr(response, "status_code", None)
    return type(exc).__name__ == "InvalidResponse" and status in _TRANSIENT_STATUS


def _backoff(attempt: int, base_delay: float) -> float:
    return min(MAX_BACKOFF_S, base_delay * 2**attempt) * random.uniform(0.5, 1.0)


# The google-cloud-storage client waits up to this long for each answer (its default), and retry_call retries
# transient failures: a GCS (or proxy) that accepts connections and never answers costs minutes. After
# SLOW_NOTICE_S without an answer, one line says what is being waited for and for at most how long.
REQUEST_TIMEOUT_S = 60.0
SLOW_NOTICE_S = 15.0


def _slow_notice(what: str, retries: int) -> threading.Timer:
    most = (retries + 1) * REQUEST_TIMEOUT_S + sum(min(MAX_BACKOFF_S, 0.5 * 2**a) for a in range(retries))
    timer = threading.Timer(SLOW_NOTICE_S, lambda: print(
        f"GCS: {what}: no answer after {SLOW_NOTICE_S:.0f} s; waiting up to {REQUEST_TIMEOUT_S:.0f} s per attempt, "
        f"{retries + 1} attempts (at most about {most / 60:.0f} min) before giving up; check the network, "
        f"STORAGE_EMULATOR_HOST, or GCS status", file=sys.stderr, flush=True))
    timer.daemon = True
    timer.start()
    return timer


def retry_call(fn: Callable, *, what: str, retries: int = 5, base_delay: float = 0.5):
    """`fn()`, retried up to `retries` more times with exponential backoff and jitter on transient errors.
    A non-transient error (e.g. 403, 404) is raised at once, unchanged; running out of retries raises
    StorageError naming `what` and chained to the last error. A call slower than SLOW_NOTICE_S says so."""
    notice = _slow_notice(what, retries)
    try:
        return _retry_call(fn, what, retries, base_delay)
    finally:
        notice.cancel()


def _retry_call(fn: Callable, what: str, retries: int, base_delay: float):
    attempt = 0
    while True:
        try:
            return fn()
        except Exception as exc:
            if not is_transient(exc):
                raise
            if attempt >= retries:
                tries = f"{attempt + 1} attempt" + ("s" if attempt else "")
                raise StorageError(
                    f"{what} failed after {tries}: {short_error(exc)}; "
                    "check the network / GCS status and run again"
                ) from exc
            time.sleep(_backoff(attempt, base_delay))
            attempt += 1


_OBJECT_REPR = re.compile(r"<[\w.]+ object at 0x[0-9a-f]+>:?\s*")
_HOST = re.compile(r"host='([^']+)', port=(\d+)")
_REASON = re.compile(r"\[Errno -?\d+\] [^'\")]+|Read timed out[^'\")]*|timed out|Connection (?:refused|reset by peer|"
                     r"aborted)[^'\")]*|Name or service not known|Temporary failure in name resolution|"
                     r"Remote end closed connection without response")


def short_error(exc: BaseException, limit: int = 300) -> str:
    """One readable line for a library error: an HTTP client's retries-exceeded message becomes
    "no answer from HOST:PORT (REASON)"; anything else loses object reprs and is cut at a word."""
    text = _OBJECT_REPR.sub("", f"{type(exc).__name__}: {exc}".replace("\n", " "))
    if "Max retries exceeded" in text or "Caused by" in text:
        host, reasons = _HOST.search(text), _REASON.findall(text)
        if host and reasons:
            return f"{type(exc).__name__}: no answer from {host.group(1)}:{host.group(2)} ({reasons[-1].strip()})"
    if len(text) <= limit:
        return text
    cut = text.rfind(" ", 0, limit - 4)
    return text[: cut if cut > limit // 2 else limit - 4] + " ..."


def _explain(exc: BaseException, url: str) -> StorageError:
    """A StorageError a user can act on, for a non-transient library error about `url`."""
    from google.api_core import exceptions as api

    if isinstance(exc, StorageError):
        return exc
    if isinstance(exc, api.NotFound):
        return StorageError(f"{url} not found (HTTP 404): check the bucket and path")
    if isinstance(exc, (api.Forbidden, api.Unauthorized)):
        return StorageError(
            f"access denied to {url} (HTTP {exc.code}): the credentials in use lack permission on this "
            "bucket; grant the service account Storage Object Admin (or Viewer for reads) on it"
        )
    return StorageError(f"{url}: {short_error(exc)}")


# ---------------------------------------------------------------------------------------------- checksums


def file_crc32c(path) -> str:
    """The file's crc32c as GCS reports it (`blob.crc32c`): base64 of the 4 big-endian bytes. A FIFO or a device
    is refused (files.NotAFileError), never read."""
    checksum = google_crc32c.Checksum()
    files.regular_file(path)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK_BYTES), b""):
            checksum.update(chunk)
    return base64.b64encode(checksum.digest()).decode("ascii")


def bytes_crc32c(data: bytes) -> str:
    """`file_crc32c` of bytes in memory."""
    return base64.b64encode(google_crc32c.Checksum(data).digest()).decode("ascii")


@dataclass(frozen=True)
class RemoteObject:
    name: str
    size: int
    crc32c: str


def local_matches(path, obj: RemoteObject) -> bool:
    """True when `path` is a file with the object's size and crc32c."""
    path = Path(path)
    try:
        if not path.is_file() or path.stat().st_size != obj.size:
            return False
        return file_crc32c(path) == obj.crc32c
    except OSError:
        return False


def bytes_match(data: bytes | None, size: int, crc32c: str) -> bool:
    """True when `data` (None: the object was missing) has this size and, where one is given, this crc32c."""
    return data is not None and len(data) == size and (not crc32c or bytes_crc32c(data) == crc32c)


class _HashingWriter:
    """A write-only file wrapper that counts bytes and computes crc32c on the way to disk."""

    def __init__(self, f, on_bytes: Callable[[int], None] | None = None):
        self._f = f
        self._crc = google_crc32c.Checksum()
        self._on_bytes = on_bytes
        self.size = 0

    def write(self, data) -> int:
        self._f.write(data)
        self._crc.update(bytes(data))
        self.size += len(data)
        if self._on_bytes is not None:
            self._on_bytes(len(data))
        return len(data)

    def flush(self):
        self._f.flush()

    @property
    def crc32c(self) -> str:
        return base64.b64encode(self._crc.digest()).decode("ascii")


# ------------------------------------------------------------------------------------------------ listing


def list_objects(client, bucket: str, prefix: str, suffix: str | None = ".npz") -> list[RemoteObject]:
    """Every object under the folder `prefix` (recursive) whose name ends in `suffix` (None: all), by name."""

    def fetch():
        blobs = client.list_blobs(bucket, prefix=folder_prefix(prefix.strip("/")), retry=None)
        return [
            RemoteObject(b.name, int(b.size or 0), b.crc32c or "")
            for b in blobs
            if not b.name.endswith("/") and (suffix is None or b.name.endswith(suffix))
        ]

    url = gs_url(bucket, prefix)
    try:
        objects = retry_call(fetch, what=f"listing {url}")
    except Exception as exc:
        raise _explain(exc, url) from exc
    return sorted(objects, key=lambda o: o.name)


def list_subdirectories(client, gs_url_: str) -> list[str]:
    """Immediate "folder" names under a prefix (e.g. checkpoint names under .../checkpoints/RUN), sorted."""
    bucket, prefix = parse_gs_url(gs_url_)
    folder = folder_prefix(prefix)

    def fetch():
        iterator = client.list_blobs(bucket, prefix=folder, delimiter="/", retry=None)
        for _ in iterator:  # prefixes are collected page by page while iterating
            pass
        return sorted(p[len(folder):].strip("/") for p in iterator.prefixes)

    try:
        return [n for n in retry_call(fetch, what=f"listing {gs_url_}") if n]
    except Exception as exc:
        raise _explain(exc, gs_url_) from exc


def bucket_exists(client, bucket: str) -> bool:
    """False when the bucket does not exist; a bucket these credentials may not read counts as existing."""
    from google.api_core import exceptions as api

    try:
        return retry_call(lambda: client.bucket(bucket).exists(retry=None), what=f"checking gs://{bucket}")
    except api.Forbidden:
        return True
    except Exception as exc:
        raise _explain(exc, gs_url(bucket)) from exc


def object_exists(client, gs_url_: str) -> bool:
    bucket, name = parse_gs_url(gs_url_)
    if not name:
        raise ValueError(f"{gs_url_!r} names a bucket, not an object")
    try:
        return retry_call(lambda: client.bucket(bucket).blob(name).exists(retry=None), what=f"checking {gs_url_}")
    except Exception as exc:
        raise _explain(exc, gs_url_) from exc


# ---------------------------------------------------------------------------------------------- downloads


def clean_stale_partials(root) -> int:
    """Remove temporary files/folders left under `root` by killed downloads (see utils/io/files.py).
    Returns how many were removed."""
    return len(files.remove_stale_temps(root, recursive=True))


def download_verified(client, bucket: str, obj: RemoteObject, dest, retries: int = 5,
                      on_bytes: Callable[[int], None] | None = None, durable: bool = True) -> int:
    """Download `obj` to `dest` through a temporary file in the same folder; rename it into place only when
    its size and crc32c match the object's. Returns the bytes written. `on_bytes(n)` is told of progress
    (negative when a failed attempt's bytes are discarded). `durable=False` skips the fsync before the rename:
    for a copy that is checked again before any later use (the stream cache's shards), where waiting on the
    disk for every file would hold the download behind whatever else the machine writes."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    url = gs_url(bucket, obj.name)

    def attempt() -> int:
        temp = files.temp_path(dest)
        writer = None
        try:
            with open(temp, "wb") as f:
                writer = _HashingWriter(f, on_bytes)
                blob = client.bucket(bucket).blob(obj.name)
                # raw_download: the stored bytes, which the listed size and crc32c describe (no gzip transcoding)
                blob.download_to_file(writer, raw_download=True, checksum="crc32c", retry=None)
                f.flush()
                if durable:
                    os.fsync(f.fileno())
            if writer.size != obj.size or (obj.crc32c and writer.crc32c != obj.crc32c):
                raise ChecksumMismatch(
                    f"{url}: got {writer.size} bytes with crc32c {writer.crc32c}, "
                    f"expected {obj.size} bytes with crc32c {obj.crc32c}"
                )
            os.replace(temp, dest)
            return writer.size
        except BaseException:
            if writer is not None and on_bytes is not None and writer.size:
                on_bytes(-writer.size)
            raise
        finally:
            temp.unlink(missing_ok=True)
            files.release_temp(temp)

    try:
        with files.disk_full_guard(dest, advice=DOWNLOAD_DISK_FULL_ADVICE):
            return retry_call(attempt, what=f"downloading {url} to {dest}", retries=retries)
    except DiskFullError:
        raise
    except Exception as exc:
        raise _explain(exc, url) from exc


DOWNLOAD_DISK_FULL_ADVICE = ("free space there, then run the same command again: completed files are kept and "
                             "not downloaded again")


def download_directory(client, gs_url_: str, dest_dir, retries: int = 5) -> int:
    """Download every object under `gs_url_` (e.g. a checkpoint) into a temporary sibling of `dest_dir`,
    verified, then rename it to `dest_dir` in one step. `dest_dir` must not exist yet. Returns bytes."""
    bucket, prefix = parse_gs_url(gs_url_)
    dest_dir = Path(dest_dir)
    if dest_dir.exists():
        raise StorageError(f"cannot download {gs_url_} to {dest_dir}: it already exists; remove it or pick another")
    objects = list_objects(client, bucket, prefix, suffix=None)
    if not objects:
        raise StorageError(f"nothing to download: no objects under {gs_url_}; check the url")
    dest_dir.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_partials(dest_dir.parent)
    folder = folder_prefix(prefix)
    total = 0
    with files.atomic_directory(dest_dir, replace=False) as temp:
        for obj in objects:
            target = (temp / obj.name[len(folder):]).resolve()
            if temp.resolve() not in target.parents:
                raise StorageError(f"refusing {gs_url(bucket, obj.name)}: its name leaves {dest_dir}")
            total += download_verified(client, bucket, obj, target, retries=retries)
    return total


# ------------------------------------------------------------------------------------------------ uploads


def upload_verified(client, bucket: str, local_path, object_name: str, retries: int = 5) -> str:
    """Upload a file, then check the object's crc32c (and size) against the local file's; retry on a
    mismatch or transient error, finally StorageError. Returns that crc32c (base64, as GCS gives it)."""
    local_path = Path(local_path)
    url = gs_url(bucket, object_name)
    try:
        expected = file_crc32c(local_path)
        size = local_path.stat().st_size
    except OSError as exc:
        raise StorageError(f"cannot read {local_path} for upload to {url}: {exc}") from exc

    def send(blob):
        return blob.upload_from_filename(str(local_path), checksum="crc32c", retry=None,
                                         crc32c_checksum_value=expected)

    _upload_checked(client, bucket, object_name, send, expected, size, str(local_path), retries)
    return expected


def upload_bytes(client, gs_url_: str, data: bytes, retries: int = 5) -> str:
    """`upload_verified` for bytes in memory (a small record, a JSON file). Returns the crc32c."""
    bucket, name = parse_gs_url(gs_url_)
    expected = bytes_crc32c(data)

    def send(blob):
        return blob.upload_from_string(data, checksum="crc32c", retry=None)

    _upload_checked(client, bucket, name, send, expected, len(data), f"{len(data)} bytes", retries)
    return expected


def _upload_checked(client, bucket: str, object_name: str, send: Callable, expected: str, size: int, source: str,
                    retries: int) -> None:
    url = gs_url(bucket, object_name)

    def attempt():
        blob = client.bucket(bucket).blob(object_name)
        send(blob)
        # the upload sets blob's properties from the server's answer; reload if it did not.
        if blob.crc32c is None or blob.size is None:
            blob.reload(retry=None)
        if blob.crc32c != expected or int(blob.size) != size:
            raise ChecksumMismatch(
                f"{url}: stored {blob.size} bytes with crc32c {blob.crc32c}, "
                f"but {source} has {size} bytes with crc32c {expected}"
            )

    try:
        retry_call(attempt, what=f"uploading {source} to {url}", retries=retries)
    except Exception as exc:
        raise _explain(exc, url) from exc


def read_object(client, gs_url_: str, retries: int = 5) -> bytes | None:
    """An object's bytes (a small one: a record, a JSON file), or None when there is no such object."""
    from google.api_core import exceptions as api

    bucket, name = parse_gs_url(gs_url_)

    def fetch():
        try:
            return client.bucket(bucket).blob(name).download_as_bytes(checksum="crc32c", retry=None)
        except api.NotFound:
            return None

    try:
        return retry_call(fetch, what=f"reading {gs_url_}", retries=retries)
    except Exception as exc:
        raise _explain(exc, gs_url_) from exc


def stat_object(client, gs_url_: str) -> RemoteObject | None:
    """The object's name, size and crc32c, or None when there is none."""
    bucket, name = parse_gs_url(gs_url_)
    try:
        blob = retry_call(lambda: client.bucket(bucket).get_blob(name, retry=None), what=f"checking {gs_url_}")
    except Exception as exc:
        raise _explain(exc, gs_url_) from exc
    return None if blob is None else RemoteObject(blob.name, int(blob.size or 0), blob.crc32c or "")


def move_object(client, source_url: str, dest_url: str) -> None:
    """Renames an object within its bucket: a server-side copy (no bytes through this machine), then the
    source is deleted. Retried; a source already gone after a retried delete is fine."""
    from google.api_core import exceptions as api

    bucket, source = parse_gs_url(source_url)
    dest_bucket, dest = parse_gs_url(dest_url)
    if dest_bucket != bucket:
        raise ValueError(f"move_object stays within a bucket: {source_url} -> {dest_url}")

    def attempt():
        handle = client.bucket(bucket)
        handle.copy_blob(handle.blob(source), handle, dest, retry=None)
        try:
            handle.blob(source).delete(retry=None)
        except api.NotFound:
            pass

    try:
        retry_call(attempt, what=f"moving {source_url} to {dest_url}")
    except Exception as exc:
        raise _explain(exc, source_url) from exc


def delete_prefix(client, gs_url_: str, workers: int = 16) -> int:
    """Deletes every object under the folder `gs_url_`; returns how many there were."""
    from google.api_core import exceptions as api

    bucket, prefix = parse_gs_url(gs_url_)
    objects = list_objects(client, bucket, prefix, suffix=None)

    def delete(obj: RemoteObject):
        def attempt():
            try:
                client.bucket(bucket).blob(obj.name).delete(retry=None)
            except api.NotFound:
                pass
        try:
            retry_call(attempt, what=f"deleting {gs_url(bucket, obj.name)}")
        except Exception as exc:
            raise _explain(exc, gs_url(bucket, obj.name)) from exc

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="gcs-delete") as pool:
        list(pool.map(delete, objects))
    return len(objects)


def open_object(client, gs_url_: str):
    """A seekable binary reader of an object (google-cloud-storage's BlobReader: ranged reads of
    CHUNK_BYTES). A long stream cannot be wrapped in `retry_call`, so its reads keep the library's own
    retry policy for transient errors."""
    from google.cloud.storage.retry import DEFAULT_RETRY

    bucket, name = parse_gs_url(gs_url_)
    return client.bucket(bucket).blob(name).open("rb", chunk_size=CHUNK_BYTES, retry=DEFAULT_RETRY)


def check_writable(client, gs_url_: str, timeout: float = 10.0) -> str | None:
    """At the start of a run that uploads: one StorageError when the bucket is missing or the prefix is
    not writable (instead of finding out at the first upload, after the first checkpoint). Writes and
    deletes one small object, `PREFIX/.write-check-HOST-PID`, trying once for at most `timeout` s. GCS
    unreachable is not an error here (uploads retry later, training goes on): returns a warning then."""
    from google.api_core import exceptions as api

    bucket, prefix = parse_gs_url(gs_url_)
    name = join_name(prefix, f".write-check-{files.host_tag()}-{os.getpid()}")
    blob = client.bucket(bucket).blob(name)
    try:
        blob.upload_from_string(b"", retry=None, timeout=timeout)
    except api.NotFound:
        raise StorageError(f"gs://{bucket} does not exist (or these credentials cannot see it): checkpoints could "
                           f"not be uploaded to {gs_url_}; check gcs_bucket, or leave it empty to keep "
                           f"checkpoints local") from None
    except (api.Forbidden, api.Unauthorized) as exc:
        raise StorageError(f"cannot write to {gs_url_} (HTTP {exc.code}): the credentials in use may not create "
                           f"objects there; grant them Storage Object Admin on gs://{bucket}, or fix "
                           f"gcs_bucket/gcs_prefix") from None
    except Exception as exc:
        if not is_transient(exc):
            raise _explain(exc, gs_url_) from exc
        return (f"warning: could not reach GCS within {timeout:.0f} s to check {gs_url_} ({short_error(exc, 200)}); "
                f"training goes on and each checkpoint's upload retries")
    try:
        blob.delete(retry=None, timeout=timeout)
    except Exception:  # noqa: BLE001 - a write-only role may not delete; the probe is tiny and hidden
        pass
    return None


def _upload_order(local_dir: Path, last: Iterable[str]) -> list[Path]:
    last = tuple(last)
    files = sorted(p for p in local_dir.rglob("*") if p.is_file())
    rank = {name: i for i, name in enumerate(last)}
    first = [p for p in files if p.name not in rank]
    final = sorted((p for p in files if p.name in rank), key=lambda p: (rank[p.name], str(p)))
    return first + final


def upload_directory(client, local_dir, gs_url_: str, last: tuple[str, ...] = ("manifest.json",),
                     retries: int = 5) -> list[str]:
    """Upload every file under `local_dir` to `gs_url_/<relative path>`, verified; files named in `last`
    go after all the others, so a remote folder without its manifest is known to be incomplete.
    Returns the object names in upload order."""
    local_dir = Path(local_dir)
    bucket, prefix = parse_gs_url(gs_url_)
    if not local_dir.is_dir():
        raise StorageError(f"cannot upload {local_dir} to {gs_url_}: not a directory")
    names = []
    for path in _upload_order(local_dir, last):
        name = join_name(prefix, path.relative_to(local_dir).as_posix())
        upload_verified(client, bucket, path, name, retries=retries)
        names.append(name)
    return names
