"""What a run reports: console lines, logs/training.log, logs/metrics.jsonl, TensorBoard, MFU.

Only rank 0 writes; other ranks' RunLogger prints warnings and errors to stderr and writes nothing.
"""
from __future__ import annotations

import functools
import json
import logging
import math
import resource
import sys
import time
from pathlib import Path

import torch

# Dense bf16 tensor-core peaks (no sparsity), FLOP/s. Checked in order; first substring match wins.
PEAK_BF16_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("GH200", 989e12),
    ("A100", 312e12),
)

# The keys every training row of logs/metrics.jsonl carries (DESIGN.md "Files a run writes").
METRIC_KEYS = ("step", "tokens", "loss", "lr", "grad_norm", "tokens_per_sec", "mfu")


def peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak, or None where unknown (CPU, unlisted GPUs): MFU is then null."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in PEAK_BF16_FLOPS:
        if key in name:
            return flops
    return None


def mfu(tokens_per_sec: float, flops_per_token: float, peak_per_device: float | None, num_devices: int):
    if not peak_per_device:
        return None
    return tokens_per_sec * flops_per_token / (peak_per_device * num_devices)


def local_device_stats(device: torch.device) -> dict:
    """This process's device memory (GiB) and, where NVML is available, its GPU's utilisation (%)."""
    if device.type != "cuda":
        return {"device": "cpu", "mem_gb": None, "peak_mem_gb": None, "gpu_util": None,
                "host_peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    stats = {
        "device": f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}",
        "mem_gb": torch.cuda.memory_allocated(device) / 2**30,
        "peak_mem_gb": torch.cuda.max_memory_allocated(device) / 2**30,
        "gpu_util": None,
    }
    handle = _nvml_handle(device.index if device.index is not None else torch.cuda.current_device())
    if handle is not None:
        import pynvml

        stats["gpu_util"] = pynvml.nvmlDeviceGetUtilizationRates(handle).gpu
    return stats


@functools.lru_cache(maxsize=None)
def _nvml_handle(index: int):
    """NVML's handle for a GPU, initialised once; None where NVML is missing or not permitted."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception:
        return None


class RunLogger:
    """Console + logs/training.log + logs/metrics.jsonl + logs/tensorboard, continued across resumes."""

    def __init__(self, log_dir: Path, is_main: bool, resume_step: int | None = None):
        self.is_main = is_main
        self.log_dir = Path(log_dir)
        self._log = logging.getLogger("neox")
        self._log.handlers.clear()
        self._log.propagate = False
        self._log.setLevel(logging.INFO if is_main else logging.WARNING)
        # Info to stdout, warnings and errors to stderr (on other ranks only those reach the console).
        out = logging.StreamHandler(sys.stdout)
        out.addFilter(lambda record: record.levelno < logging.WARNING)
        err = logging.StreamHandler(sys.stderr)
        err.setLevel(logging.WARNING)
        for handler in (out, err):
            handler.setFormatter(logging.Formatter("%(message)s"))
            self._log.addHandler(handler)
        self._metrics = None
        self._tb = None
        if not is_main:
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(self.log_dir / "training.log")
        file_handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        self._log.addHandler(file_handler)
        self._metrics = open(self.log_dir / "metrics.jsonl", "a", buffering=1)
        try:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step drops events a crashed run wrote past the checkpoint we resume from.
            self._tb = SummaryWriter(str(self.log_dir / "tensorboard"),
                                     purge_step=None if resume_step is None else resume_step + 1)
        except Exception as exc:  # TensorBoard is optional at run time; say so once
            self.warning(f"TensorBoard disabled: {exc}")

    def info(self, msg: str) -> None:
        self._log.info(msg)

    def warning(self, msg: str) -> None:
        self._log.warning(msg)

    def error(self, msg: str) -> None:
        self._log.error(msg)

    def write_row(self, row: dict) -> None:
        """One JSON line in metrics.jsonl and a TensorBoard scalar per numeric field."""
        if not self.is_main:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        clean["time"] = round(time.time(), 3)
        self._metrics.write(json.dumps(clean) + "\n")
        if self._tb is not None:
            step = row["step"]
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(f"train/{key}" if key != "val_loss" else "eval/val_loss", value, step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._metrics is not None:
            self._metrics.close()
        for handler in list(self._log.handlers):
            handler.close()
            self._log.removeHandler(handler)


def format_step_line(row: dict, best: float) -> str:
    """`Step 100: loss=2.4567, lr=1.23e-04, best=2.4234 | 5.2 steps/sec | 41,000 tok/s | MFU 47.1%`."""
    line = (f"Step {row['step']}: loss={row['loss']:.4f}, lr={row['lr']:.2e}, best={best:.4f} | "
            f"{row['steps_per_sec']:.2f} steps/sec | {row['tokens_per_sec']:,.0f} tok/s")
    if row.get("mfu") is not None:
        line += f" | MFU {100 * row['mfu']:.1f}%"
    if row.get("data_wait_frac") is not None:
        line += f" | data wait {100 * row['data_wait_frac']:.1f}%"
    return line
