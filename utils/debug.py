"""Debugging and fault-injection switches, read from the environment in one place (never set in a normal run).

    NEOX_TRACE_BATCHES=1            rank 0 records a checksum of every sequence each rank trained on, per step,
                                    in logs/batch_trace.jsonl (slow: one gather per micro-batch; for checking
                                    data sharding)
    NEOX_FP8_EMULATE=1              torchao's float8 emulation: fp8 runs in plain PyTorch on any device, slowly
                                    (tests of the fp8 path on a CPU)
    NEOX_DEBUG_CHECKPOINT_DELAY_S=S each checkpoint write sleeps S seconds before its manifest: a slow disk, for
                                    the preemption tests
    NEOX_DEBUG_STEP_DELAY_S=S       every optimizer step sleeps S seconds after it: a slow step, so that a test can
                                    act (kill, stop a rank) between two steps of a toy run
    NEOX_DEBUG_POISON_SEQUENCES=A-B[,C-D...]
                                    the sequences at global stream positions [A, B) (the data cursor's count)
                                    reach the model as their first token repeated: a loss spike on demand, for
                                    the spike guard's tests (position p is read by step p // G + 1 of a run
                                    that skips nothing, G = micro-batch x accumulation x processes)
    NEOX_DEBUG_PARTITION_DELAY_S=S  each prepare partition sleeps S seconds before its completion record: a slow
                                    worker, so that a test can kill one mid-partition
    NEOX_PROFILE_STEPS=A-B          torch.profiler over optimizer steps A to B on every rank: a Chrome trace per rank
                                    in logs/profile-rank{R}.json and the operators that took the most time in the
                                    log (utils/run/callbacks.py StepProfiler; the profiled steps run slower)

Production modules ask these functions rather than reading the variables themselves, so every switch that
changes behaviour for a test is listed here.
"""
from __future__ import annotations

import json
import os
import time
import zlib
from pathlib import Path

from utils import layout


def fp8_emulated() -> bool:
    return os.environ.get("NEOX_FP8_EMULATE") == "1"


def checkpoint_write_delay_s() -> float:
    return float(os.environ.get("NEOX_DEBUG_CHECKPOINT_DELAY_S", "0") or 0)


def partition_delay_s() -> float:
    return float(os.environ.get("NEOX_DEBUG_PARTITION_DELAY_S", "0") or 0)


def step_delay_s() -> float:
    return float(os.environ.get("NEOX_DEBUG_STEP_DELAY_S", "0") or 0)


def profiled_steps() -> tuple[int, int] | None:
    """NEOX_PROFILE_STEPS=A-B: (A, B), the first and last optimizer step profiled; None when unset."""
    raw = os.environ.get("NEOX_PROFILE_STEPS", "").strip()
    if not raw:
        return None
    first, _, last = raw.partition("-")
    try:
        span = int(first), int(last or first)
    except ValueError:
        span = (0, -1)
    if not 1 <= span[0] <= span[1]:
        from utils.errors import UserError

        raise UserError(f"NEOX_PROFILE_STEPS={raw!r}: expected A-B, the first and last optimizer step to profile "
                        f"(1 <= A <= B), e.g. 10-12")
    return span


def poisoned_sequences() -> list[range]:
    """`NEOX_DEBUG_POISON_SEQUENCES` as ranges of global stream positions (empty when unset)."""
    spec = os.environ.get("NEOX_DEBUG_POISON_SEQUENCES", "")
    return [range(int(a), int(b)) for a, b in (part.split("-") for part in spec.split(",") if part.strip())]


def poison(batch, first_position: int, poisoned: list[range]):
    """`batch` (a [rows, seq_len] numpy array whose row k is global stream position first_position + k) with its
    poisoned rows each made of its first token: a copy where any row is poisoned (the batch may be a view of a
    shard)."""
    rows = [k for k in range(len(batch)) if any(first_position + k in r for r in poisoned)]
    if not rows:
        return batch
    batch = batch.copy()
    batch[rows] = batch[rows, :1]
    return batch


class BatchTrace:
    """`NEOX_TRACE_BATCHES=1` (see the module docstring)."""

    def __init__(self, output_dir: Path, accelerator):
        self.path, self.accelerator = Path(output_dir) / layout.LOGS / layout.BATCH_TRACE, accelerator
        self.enabled = os.environ.get("NEOX_TRACE_BATCHES") == "1"
        self.step_delay = step_delay_s()

    def after_step(self) -> None:
        """`NEOX_DEBUG_STEP_DELAY_S`: a pause after each step (tests act between two steps); nothing unless set."""
        if self.step_delay:
            time.sleep(self.step_delay)

    def record(self, step: int, input_ids) -> None:
        """Every rank calls it for every micro-batch; it does nothing unless NEOX_TRACE_BATCHES=1."""
        if not self.enabled:
            return
        from accelerate.utils import gather_object

        rows = [zlib.crc32(r.numpy().tobytes()) for r in input_ids.cpu()]
        traced = gather_object([rows]) if self.accelerator.num_processes > 1 else [rows]
        if self.accelerator.is_main_process:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": step, "ranks": traced}) + "\n")
