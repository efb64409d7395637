"""Stopping on SIGTERM/SIGINT at an optimizer-step boundary, every rank at the same step."""
from __future__ import annotations

import signal


class StopSignal:
    """SIGTERM/SIGINT set a flag; the loop stops after the current optimizer step. With several processes
    the flag is all-reduced over a CPU (gloo) group, so every rank stops at the same step and the check
    never synchronises the GPU. A second SIGINT interrupts at once."""

    def __init__(self, distributed: bool):
        import torch.distributed as dist

        self.requested = False
        self.signal_name = None
        self._group = dist.new_group(backend="gloo") if distributed else None
        signal.signal(signal.SIGTERM, self._handle)
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

    @property
    def reason(self) -> str:
        return self.signal_name or "a signal on another rank"
