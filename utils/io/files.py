"""The one way this project writes a file or directory atomically, and cleans up after writers that died.

Every temporary name is `.NAME.partial-HOST-PID-RAND` beside its final path: hidden, never ending in a
suffix anything scans for (`.npz`, a checkpoint name), and saying who wrote it. A writer fills the temporary
file or directory, fsyncs it, and renames it into place; a reader never sees a half-written final name.
`remove_stale_temps` deletes what killed writers left: this host's temporaries whose process is gone, and
any untouched for an hour (a live writer keeps touching its file; hostnames change when a container
restarts). Temporaries this process is writing are registered, so a cleanup pass in another thread, or in
a later process that reuses this pid (PID 1 in a container, every time), never deletes a live one.

Also the one walk over a directory tree (`walk_once`), the one test that a path a file names (a
checkpoint's manifest, a dataset.json) stays inside its folder (`inside`), the one parse of a JSON file
that may be crafted (`parse_json`: too deep a nesting is a ValueError like any other malformed text), and the
one check that a file found in a folder (a shard, a checkpoint's file, a dataset.json, a tokenizer) is a
regular file before anything opens it (`regular_file`, `read_bytes`, `read_text`): a FIFO named like a shard
blocked its reader's open() for good, before the first step, where no watchdog looks.
"""
from __future__ import annotations

import errno
import os
import re
import secrets
import shutil
import socket
import stat
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

STALE_AGE_S = 3600.0
_TEMP_RE = re.compile(r"^\.(?P<name>.+)\.partial-(?P<host>[^/]*)-(?P<pid>\d+)-(?P<rand>[0-9a-f]+)$")

_UMASK = os.umask(0o022)  # read once, at import (os.umask can only be read by setting it)
os.umask(_UMASK)
_LIVE: set[Path] = set()  # temporaries this process is writing right now
_LIVE_LOCK = threading.Lock()


def pid_alive(pid: int) -> bool:
    """True if a process with this pid exists on this host (one we may not signal counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def host_tag() -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname())[:40]


def temp_path(final) -> Path:
    """A fresh temporary name beside `final`, registered as live until `release_temp`."""
    final = Path(final)
    path = final.with_name(f".{final.name}.partial-{host_tag()}-{os.getpid()}-{secrets.token_hex(4)}")
    with _LIVE_LOCK:
        _LIVE.add(path)
    return path


def release_temp(path: Path) -> None:
    with _LIVE_LOCK:
        _LIVE.discard(path)


def is_temp_name(name: str) -> bool:
    return _TEMP_RE.match(name) is not None


def set_default_mode(path) -> None:
    """Gives a file the mode `open()` would have (0644 under the usual umask). Some writers, safetensors'
    among them, create files 0600, which another user (a non-root resume, a serving process) cannot read."""
    os.chmod(path, 0o666 & ~_UMASK)


def fsync_file(path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on a directory; the rename is still atomic
    finally:
        os.close(fd)


def remove_tree(path: Path) -> None:
    """Deletes a directory so that it vanishes from its name at once: rename aside, then delete."""
    aside = temp_path(path)
    try:
        os.rename(path, aside)
        shutil.rmtree(aside, ignore_errors=True)
    finally:
        release_temp(aside)


def _discard(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


@contextmanager
def atomic_file(final, mode: str = "wb") -> Iterator:
    """`with atomic_file(path) as f: f.write(...)`: the content appears at `path` whole, or not at all."""
    final = Path(final)
    tmp = temp_path(final)
    try:
        with open(tmp, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        fsync_dir(final.parent)
    finally:
        if tmp.exists():
            _discard(tmp)
        release_temp(tmp)


def write_bytes(final, data: bytes) -> None:
    with atomic_file(final, "wb") as f:
        f.write(data)


def write_text(final, text: str) -> None:
    with atomic_file(final, "w") as f:
        f.write(text)


@contextmanager
def atomic_directory(final, replace: bool = True, tmp: Path | None = None) -> Iterator[Path]:
    """`with atomic_directory(dest) as tmp:` fill `tmp`; on success it is fsynced and renamed to `dest`.

    An existing `dest` is replaced (renamed aside, the new one renamed in, the old one deleted) when
    `replace`; otherwise FileExistsError is raised and the new content discarded (e.g. a concurrent build
    won the race). On any error the temporary directory is removed. `tmp`: a temporary name from
    `temp_path(final)` that others (e.g. the ranks of a sharded checkpoint) are already filling."""
    final = Path(final)
    tmp = tmp or temp_path(final)
    try:
        tmp.mkdir(exist_ok=True)
        yield tmp
        fsync_dir(tmp)
        publish_directory(tmp, final, replace=replace)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        release_temp(tmp)


def publish_directory(tmp: Path, final: Path, replace: bool = True) -> None:
    """Renames a finished directory into place (see `atomic_directory`)."""
    if final.is_dir() and not any(final.iterdir()):
        final.rmdir()  # an empty placeholder (e.g. made by mkdir -p) is not worth keeping
    try:
        os.rename(tmp, final)
    except OSError as e:
        if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
            raise
        if not replace:
            raise FileExistsError(errno.EEXIST, f"{final} already exists") from None
        old = temp_path(final)
        try:
            os.rename(final, old)
            try:
                os.rename(tmp, final)
            except OSError:
                os.rename(old, final)
                raise
            shutil.rmtree(old, ignore_errors=True)
        finally:
            release_temp(old)
    fsync_dir(final.parent)


def remove_stale_temps(root, recursive: bool = False, max_age_s: float = STALE_AGE_S) -> list[Path]:
    """Deletes temporaries under `root` left by dead writers (see the module docstring); returns them."""
    root = Path(root)
    if not root.is_dir():
        return []
    host, me, now = host_tag(), os.getpid(), time.time()
    with _LIVE_LOCK:
        live = set(_LIVE)
    removed = []
    for dirpath, dirnames, filenames in os.walk(root):
        for entry in filenames + dirnames:
            m = _TEMP_RE.match(entry)
            path = Path(dirpath, entry)
            if not m or path in live:
                continue
            try:
                age = now - path.lstat().st_mtime
            except OSError:
                continue
            pid = int(m["pid"])
            # Our own pid but not one of our live temporaries: left by an earlier process with this pid.
            dead = m["host"] == host and (pid == me or not pid_alive(pid))
            if dead or age >= max_age_s:
                _discard(path)
                removed.append(path)
        if not recursive:
            break
        dirnames[:] = [d for d in dirnames if not _TEMP_RE.match(d)]
    return removed


def free_bytes(path) -> int:
    """Free space for an unprivileged writer on the filesystem holding `path` (or its nearest parent)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def owner_of(path) -> str:
    """`" (owned by NAME)"` for the path or its nearest existing parent; empty where unknown."""
    import pwd

    path = Path(path)
    try:
        while not path.exists() and path != path.parent:
            path = path.parent
        uid = path.stat().st_uid
    except OSError:
        return ""
    try:
        return f" ({path} is owned by {pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f" ({path} is owned by uid {uid})"


def mount_point(path) -> Path:
    path = Path(path).resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    while not os.path.ismount(path):
        path = path.parent
    return path


RESUME_ADVICE = ("free space there (or lower save_total_limit), then resume with --resume auto: the checkpoints "
                 "written before are intact")


def disk_full_error(path, needed_bytes: int | None = None, advice: str = RESUME_ADVICE,
                    cause: BaseException | None = None):
    """The one-line DiskFullError for a write to `path` that ran out of room: where, how much, what to do. With
    a `cause` that is a file past the size limit (EFBIG: `ulimit -f`, or the filesystem's largest file), it says
    that, not "no space left"."""
    from utils.errors import DiskFullError

    if cause is not None and _no_room_errno(cause) == errno.EFBIG:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if soft == resource.RLIM_INFINITY:
            limit, remedy = "past the largest file its filesystem holds", "write to a filesystem that holds it"
        else:
            limit, remedy = f"past this process's file-size limit of {soft:,} bytes (ulimit -f)", "raise that limit"
        # the writer's advice begins with what frees room on a full disk; here the remedy is the limit
        advice = re.sub(r"^free space there( \([^)]*\))?", remedy, advice)
        return DiskFullError(f"file too large writing {path}: {limit}; {advice}")
    need = f"about {needed_bytes / 1e9:.2f} GB needed, " if needed_bytes else ""
    try:
        where, free = mount_point(path), f"{free_bytes(path) / 1e9:.2f} GB free"
    except OSError:
        where, free = Path(path).parent, "free space unknown"
    return DiskFullError(f"no space left on {where} writing {path} ({need}{free}); {advice}")


@contextmanager
def disk_full_guard(path, needed_bytes: int | None = None, advice: str = RESUME_ADVICE) -> Iterator[None]:
    """`with disk_full_guard(path): write...` turns "no space left" (however wrapped) into the one-line
    DiskFullError naming `path`; every other error passes through unchanged. The one mechanism every
    writer (logs, metrics, checkpoints, prepare_data, download) uses for a full disk."""
    from utils.errors import DiskFullError

    try:
        yield
    except DiskFullError:
        raise
    except Exception as exc:
        if is_disk_full(exc):
            raise disk_full_error(path, needed_bytes, advice, exc) from None
        raise


@contextmanager
def write_guard(path, advice: str, needed_bytes: int | None = None, denied_advice: str | None = None) -> Iterator[None]:
    """`disk_full_guard`, and a write this user may not make (another user's folder or file) as one
    UserError naming the path, its owner and `denied_advice` (default: `advice`, where one piece of advice
    fits both), instead of a PermissionError traceback."""
    from utils.errors import UserError

    try:
        with disk_full_guard(path, needed_bytes, advice):
            yield
    except PermissionError as exc:
        where = exc.filename or path
        raise UserError(f"cannot write {where} ({exc.strerror}){owner_of(where)}; {denied_advice or advice}") from None


# A write that found no room, by errno and by the words of its strerror (for writers that wrap the OSError in an
# error of their own: safetensors' SafetensorError chains nothing, torch's writer says it in its message).
NO_ROOM = {errno.ENOSPC: "No space left on device", errno.EDQUOT: "Disk quota exceeded",
           errno.EFBIG: "File too large"}


def _no_room_errno(exc: BaseException) -> int | None:
    """The NO_ROOM errno `exc` or an exception it was raised from says, or None. The walk over `__cause__` /
    `__context__` visits each exception once and at most 64 (a chain may be cyclic)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen and len(seen) < 64:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in NO_ROOM:
            return exc.errno
        text = str(exc)
        for number, words in NO_ROOM.items():
            if words in text:
                return number
        exc = exc.__cause__ or exc.__context__
    return None


def is_disk_full(exc: BaseException) -> bool:
    """True for a write that found no room: no space left, a quota exceeded, or a file past the size limit
    (EFBIG: `ulimit -f`, RLIMIT_FSIZE; Python ignores SIGXFSZ, so the write fails instead of killing it),
    including writers' wrapped errors."""
    return _no_room_errno(exc) is not None


# ------------------------------------------------------------------------------------------------- paths

_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a folder"))


def regular_file(path) -> os.stat_result:
    """`os.stat(path)` (through symlinks) when `path` is a regular file; NotAFileError (a UserError and an
    OSError, one line naming the path and what it is) when it is a FIFO, a socket, a device or a folder: never
    opened, since opening a FIFO waits for a writer for good and a device never ends. A missing path raises
    FileNotFoundError as open() would."""
    from utils.errors import NotAFileError

    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        kind = next((words for test, words in _KINDS if test(st.st_mode)), "not a regular file")
        raise NotAFileError(f"{path} is {kind}, not a regular file; remove it or put the file there")
    return st


def read_bytes(path) -> bytes:
    """`Path(path).read_bytes()` of a regular file (`regular_file` first: a FIFO is refused, not waited on)."""
    regular_file(path)
    return Path(path).read_bytes()


def read_text(path, encoding: str | None = None, errors: str | None = None) -> str:
    """`Path(path).read_text()` of a regular file (see read_bytes)."""
    regular_file(path)
    return Path(path).read_text(encoding=encoding, errors=errors)


def inside(root, rel) -> bool:
    """Whether `rel`, a path a file in `root` names (a manifest entry, dataset.json's tokenizer), stays in
    `root`: relative, no `..`, and no symlink on the way that leads out."""
    if not isinstance(rel, str) or not rel or "\0" in rel or Path(rel).is_absolute() or ".." in Path(rel).parts:
        return False
    real_root = Path(root).resolve()
    return (real_root / rel).resolve().is_relative_to(real_root)


def parse_json(text: str | bytes):
    """JSON text (from a file that may come from a bucket, or be crafted) -> its value. Every malformed text is
    a ValueError, one nested past the parser's depth too (json raises RecursionError there, which no handler
    of ValueError catches)."""
    import json

    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply to parse") from None


def walk_once(root) -> Iterator[tuple[str, list[str], list[str]]]:
    """`os.walk(root)`, top-down and sorted, following symlinked folders but walking each real directory
    once, under its own name: a link to a folder inside `root` (a symlink loop, a second name for a folder)
    is left out, since the folder is walked where it is (followed blindly, a loop repeats every file 40
    levels deep); a link to a folder outside is walked, once. Prune `dirnames` in place to skip folders."""
    real_root = Path(root).resolve()
    seen: set[tuple[int, int]] = set()
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        try:
            st = os.stat(dirpath)
        except OSError:
            dirnames[:] = []
            continue
        if (st.st_dev, st.st_ino) in seen:
            dirnames[:] = []
            continue
        seen.add((st.st_dev, st.st_ino))
        dirnames[:] = sorted(d for d in dirnames if not (os.path.islink(os.path.join(dirpath, d)) and
                                                         Path(dirpath, d).resolve().is_relative_to(real_root)))
        filenames.sort()
        yield dirpath, dirnames, filenames
