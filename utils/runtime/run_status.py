"""How a run ended, as its ranks tell the launcher: the one definition both sides import.

The launcher (utils/runtime/launch.py) names a file in `NEOX_STATUS_FILE`; each node's first process of train.py
(rank 0, and local rank 0 of every other node, whose launcher has a file of its own) writes a RunStatus there as
it exits (how it ended, what stopped it, the step, the last checkpoint, rank 0's exported model, or the error it
said), and the launcher's last line reads it back. It is also how the launcher knows the run ended as it should:
a launch whose processes exit 0 without a record saying exit 0 ended before its run finished (a process that
exited halfway), which the launcher reports as a failure. Beside it, any rank marks that this launch
trained a step (`mark_trained`: a failure from then on may be restarted), that the hang watchdog ended a
rank (`mark_hung`: the launcher exits 3), and that a stop signal ended the run before it finished
(`STOPPED_SUFFIX`, every rank: for `--stop-exit-code`). Standard library only: the launcher imports it without
site-packages (`python -S`)."""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

STATUS_FILE_ENV = "NEOX_STATUS_FILE"
RESTARTS_ENV = "NEOX_RESTART_COUNT"  # set by the launcher: how many times it has restarted the ranks (--max-restarts)
TRAINED_SUFFIX = ".trained"  # beside the status file: a rank finished a training step in this launch
HANG_EXIT = 3  # the hang watchdog's exit status, and the launcher's after it (docs/contracts.md)
HUNG_SUFFIX = ".hung"  # beside the status file: the hang watchdog ended a rank (its number) in this launch
STOPPED_SUFFIX = ".stopped"  # beside the status file: a stop signal (on any rank) ended this launch unfinished
PLANNED_STOP = "stop_at_step"  # RunStatus.stopped_by of a run that stopped where its config said
_trained_marked: list[bool] = []


def restarts_so_far() -> int:
    value = os.environ.get(RESTARTS_ENV, "0")
    return int(value) if value.isdigit() else 0


def mark_trained() -> None:
    """After a training step (any rank, once per process): tells the launcher that this launch trained, so a
    failure after it may be restarted (--max-restarts), while one before the first step (a setting, a missing
    file) is not. An empty file beside the status file; nothing without the launcher."""
    if _trained_marked:
        return
    _trained_marked.append(True)
    path = os.environ.get(STATUS_FILE_ENV)
    if path:
        try:
            open(path + TRAINED_SUFFIX, "a").close()
        except OSError:
            pass


def mark_hung(rank: int) -> None:
    """The hang watchdog of `rank` is ending its process (exit 3): tells the launcher, which then exits 3
    whichever rank fired and whatever accelerate or torchrun exit with (their status is 1). Any rank writes it;
    nothing without the launcher."""
    path = os.environ.get(STATUS_FILE_ENV)
    if path:
        try:
            with open(path + HUNG_SUFFIX, "a") as f:
                f.write(f"{rank}\n")
        except OSError:
            pass


def hung_ranks(status_path) -> list[int]:
    """The ranks `mark_hung` recorded beside `status_path`, in the order they fired."""
    try:
        return [int(line) for line in Path(str(status_path) + HUNG_SUFFIX).read_text().split() if line.isdigit()]
    except OSError:
        return []


def rank_zero() -> bool:
    """Whether this process is rank 0 (or the only one), as the launcher's environment says."""
    return os.environ.get("RANK", "0") == "0"


def node_first() -> bool:
    """Whether this process is its node's first (local rank 0, or the only one): the one that answers its node's
    launcher."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


@dataclass(frozen=True)
class RunStatus:
    exit_code: int
    stopped_by: str | None = None  # a signal's name or PLANNED_STOP; None for a finished run or an error
    step: int | None = None  # the last optimizer step done (None: stopped during setup)
    checkpoint: str | None = None  # the last checkpoint written
    final_model: str | None = None  # where the exported model is
    error: str | None = None  # the one line a user error said
    restarts: int = field(default_factory=restarts_so_far)  # the launcher's restarts before this launch

    def write(self) -> None:
        """Each node's first process, where the launcher asks for it: the record, atomically; every rank: the mark
        of a stop that left the run unfinished. The run's own output says the same, so a failure to write either
        is ignored (the launcher then reports a run that exits 0 without a record as ended early)."""
        path = os.environ.get(STATUS_FILE_ENV)
        if path and self.stopped_by is not None and self.stopped_by != PLANNED_STOP and not self.exit_code:
            try:
                open(path + STOPPED_SUFFIX, "a").close()
            except OSError:
                pass
        if not path or not node_first():
            return
        try:
            from utils.io.files import write_text

            write_text(path, json.dumps(asdict(self)))
        except OSError:
            pass

    @classmethod
    def read(cls, path) -> "RunStatus | None":
        """The record at `path`, or None when there is none (the run died before writing it)."""
        try:
            raw = json.loads(Path(path).read_text())
            return cls(**{f.name: raw[f.name] for f in fields(cls) if f.name in raw})
        except (OSError, ValueError, TypeError, KeyError):
            return None
