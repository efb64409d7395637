"""The one base class for problems the user fixes: bad input, a missing file, a full disk, a busy output dir.

Each module raises its own subclass (ConfigError, ShardError, CheckpointError, StorageError, ...), whose
message reads as one line: what is wrong, which file or option, what to do. `train.py`'s `main()` catches
`UserError` once, prints `error: <message>` and exits 2; anything else is a bug of ours and keeps its
traceback. (The barriers that carry a UserError across ranks are in utils/runtime/distributed.py.)
"""
from __future__ import annotations


class UserError(Exception):
    """A problem the user can fix; the message says what, where and how."""


class ConfigError(UserError, ValueError):
    """A configuration problem the user can fix (a setting, a model's architecture); the message says what and
    how."""


class DiskFullError(UserError, OSError):
    """No space left (or quota exceeded) while writing; the message names the filesystem, the space
    needed and free, and what to do."""


class NotAFileError(UserError, OSError):
    """A path a reader was about to open is no regular file (a FIFO, a socket, a device, a folder): reading it
    could block for good (a FIFO with no writer) or never end (a device). The message names the path and what
    it is; utils/io/files.py's `regular_file` raises it before any open()."""


THREAD_FAILED = "a background thread failed"  # how the line of a BackgroundFailure starts


class BackgroundFailure(Exception):
    """A background thread (a data fetch or its plan, a checkpoint write, an upload) failed, or died: the run
    stops with this one line (`error: ...`, exit 1), never waiting on the thread again."""
