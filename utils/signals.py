"""Stopping on SIGTERM/SIGINT at an optimizer-step boundary, every rank at the same step; before the first
step, between setup phases, with nothing to save."""
from __future__ import annotations

import signal

_EARLY: list[str] = []  # signals received after catch_early() and before the StopSignal existed


def catch_early() -> None:
    """From here until the StopSignal exists (it needs the process group), SIGTERM/SIGINT are remembered
    instead of killing the process mid-setup; the StopSignal then acts on them. A second SIGINT interrupts."""
    def remember(signum, frame):
        _EARLY.append(signal.Signals(signum).name)
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    signal.signal(signal.SIGTERM, remember)
    signal.signal(signal.SIGINT, remember)


class StoppedInSetup(Exception):
    """A stop signal before the first training step: the run ends at once, exit 0, nothing to save."""

    def __init__(self, reason: str, phase: str):
        super().__init__(f"stopped by {reason} during setup ({phase}) before any training step; nothing to save")
        self.reason, self.phase = reason, phase


class StopSignal:
    """SIGTERM/SIGINT set a flag; the loop stops after the current optimizer step. With several processes
    the flag is all-reduced over a CPU (gloo) group, so every rank stops at the same step and the check
    never synchronises the GPU. A second SIGINT interrupts at once."""

    def __init__(self, distributed: bool):
        import torch.distributed as dist

        self.requested = bool(_EARLY)
        self.signal_name = _EARLY[0] if _EARLY else None
        self._group = dist.new_group(backend="gloo") if distributed else None
        signal.signal(signal.SIGTERM, self._handle)
        if "SIGINT" not in _EARLY:  # after one Ctrl-C, the next one interrupts at once
            signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum, frame):
        self.requested = True
        self.signal_name = signal.Signals(signum).name
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def agreed(self) -> bool:
        if self._group is None:
            return self.requested
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1 if self.requested else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flag.item())

    def end_setup_if_asked(self, phase: str) -> None:
        """Between setup phases (every rank calls it at the same points): raises StoppedInSetup when a stop
        was asked for on any rank."""
        if self.agreed():
            raise StoppedInSetup(self.reason, phase)

    @property
    def reason(self) -> str:
        return self.signal_name or "a signal on another rank"
