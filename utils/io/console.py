"""A console that may go away while the run goes on.

`train.py ... | tee log` and a Ctrl-C: the terminal's SIGINT reaches `tee` too, and the run's next line to
stdout fails (EPIPE). A closed terminal (EIO) and a launcher killed with SIGKILL (whose pipe carried the
ranks' stderr) do the same. Python raises on such a write, and a `print` deep in the loop would end the run
with a traceback and without the stop checkpoint it was about to write. So `survive_lost_console()` wraps
stdout and stderr: the first write or flush that fails points the stream's file descriptor at /dev/null
(so that write, every later one, C code's, child processes' and Python's own flush at exit all succeed and
are dropped) and tells the `on_lost` listeners once; the run's file logs go on.
"""
from __future__ import annotations

import os
import sys

_LISTENERS: list = []


class SurvivingStream:
    """A text stream whose failed writes drop the console instead of raising."""

    def __init__(self, stream, name: str):
        self._stream, self.name = stream, name
        self.lost: str | None = None  # why the console went, once it has

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as exc:
            self._lose(exc)
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as exc:
            self._lose(exc)

    def __getattr__(self, name):
        return getattr(self._stream, name)

    def _lose(self, exc: OSError) -> None:
        if self.lost is not None:
            return
        self.lost = exc.strerror or str(exc)
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self._stream.fileno())
            os.close(null)
            self._stream.flush()  # what was buffered goes to /dev/null with the rest
        except (OSError, ValueError):
            self._stream = open(os.devnull, "w")
        for listener in list(_LISTENERS):
            listener(self.name, self.lost)


def survive_lost_console() -> None:
    """Wraps sys.stdout and sys.stderr (once per process)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, SurvivingStream):
            setattr(sys, name, SurvivingStream(stream, name))


def on_lost(listener) -> None:
    """`listener(stream_name, why)` is called once for each stream that goes away; it must not raise."""
    _LISTENERS.append(listener)


def progress_bar(total: int, initial: int, is_main: bool):
    """A tqdm bar on an interactive terminal (rank 0); none when output goes to a file (SLURM, nohup, CI),
    where the step lines already show progress and bar fragments would glue onto them."""
    from tqdm import tqdm

    interactive = sys.stderr.isatty()
    if not interactive:  # nor transformers' own bars (an export, an evaluation), nor huggingface_hub's
        if "transformers" in sys.modules:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        else:  # transformers takes this state when a later step imports it: importing it now would cost 0.5 s
            from huggingface_hub.utils import disable_progress_bars

            disable_progress_bars()
    return tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True,
                disable=not (is_main and interactive))
