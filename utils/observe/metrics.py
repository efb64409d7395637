"""What a run reports: console lines, logs/training.log, logs/metrics.jsonl, accelerate's trackers, MFU.

`RunLogger` owns the outputs. Only rank 0 writes; other ranks print warnings and errors to stderr. The
trackers (`report_to`: tensorboard, wandb, mlflow, several, or none) are accelerate's, initialised with the
full resolved config as hyperparameters; every numeric field of a row is logged against the optimizer step,
and TensorBoard also gets each training scalar against tokens seen (`by_tokens/...`).

`MetricsWindow` owns the per-step losses and gradient norms since the last log line, the non-finite check
(a loss or a gradient norm that is not finite stops the run, in one line naming the step; fp16's gradient
norms are its grad scaler's to judge), the time they took (minus eval and checkpoint time, which are reported
on their own rows) and the row they become. A step the spike guard skipped (utils/training/spike_guard.py) counts for
time and tokens, but its loss is left out of the row's mean and of the non-finite check (its own spike row
has it), and the row says how many were skipped.

A full disk while writing logs is one line (DiskFullError) naming the file, not a chain of tracebacks.
"""
from __future__ import annotations

import functools
import json
import math
import resource
import sys
import time
from pathlib import Path

import torch

from utils import layout
from utils.errors import DiskFullError, UserError
from utils.io.files import disk_full_guard, owner_of

# Dense bf16 tensor-core peaks (no sparsity), FLOP/s. Checked in order; first substring match wins.
PEAK_BF16_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("GH200", 989e12),
    ("A100", 312e12),
)

# The keys every training row of logs/metrics.jsonl carries (docs/contracts.md "Metrics keys").
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
    index = device.index if device.index is not None else torch.cuda.current_device()
    stats = {"device": f"cuda:{index}", "mem_gb": torch.cuda.memory_allocated(device) / 2**30,
             "peak_mem_gb": torch.cuda.max_memory_allocated(device) / 2**30, "gpu_util": None}
    handle = _nvml_handle(index)
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
    except Exception:  # noqa: BLE001 - a probe: any NVML failure means no GPU stats
        return None


class RunLogger:
    """Console + logs/training.log + logs/metrics.jsonl + trackers, continued across resumes."""

    def __init__(self, log_dir: Path, is_main: bool):
        self.is_main = is_main
        self.log_dir = Path(log_dir)
        self._files: dict[str, object] = {}
        self._accelerator = None
        self._tensorboard = None  # its SummaryWriter, for the tokens-seen axis
        if is_main:
            path = self.log_dir
            try:
                self.log_dir.mkdir(parents=True, exist_ok=True)
                for name in (layout.TRAINING_LOG, layout.METRICS):
                    path = self.log_dir / name
                    self._files[name] = open(path, "a", buffering=1)
            except OSError as exc:  # e.g. logs/ or a log file left by another user
                self._drop_files()
                raise UserError(f"cannot write {path} ({exc.strerror}){owner_of(path)}; use an --output-dir you "
                                f"may write, or fix its permissions") from None
            from utils.io.console import on_lost

            on_lost(self._console_lost)

    def _console_lost(self, stream: str, why: str) -> None:
        """utils/io/console.py dropped the console: the log files say so, and go on."""
        try:
            self._append(layout.TRAINING_LOG, f"{time.strftime('%Y-%m-%d %H:%M:%S')} console: {stream} went away "
                                         f"({why}); the run goes on, its lines continue in this file only\n")
        except UserError:
            pass  # the log file's own failure is said by the next line that fails the same way

    def start_trackers(self, accelerator, run_name: str, config: dict, resume_step: int | None) -> None:
        """accelerate's trackers, with the resolved config as hyperparameters. On a resume, TensorBoard
        drops events a crashed run wrote past the checkpoint (purge_step)."""
        if not accelerator.log_with:
            return
        init_kwargs = {"tensorboard": {"purge_step": None if resume_step is None else resume_step + 1}}
        # hyperparameters are scalars or strings to TensorBoard: a mapping (data_mix) goes as its JSON
        config = {k: json.dumps(v) if isinstance(v, (dict, list)) else v for k, v in config.items()}
        try:
            accelerator.init_trackers(run_name, config=config, init_kwargs=init_kwargs)
        except Exception as exc:  # noqa: BLE001 - any tracker failure is a warning
            # a tracker that cannot start (no login, no server) must not stop training
            names = ", ".join(getattr(t, "name", str(t)) for t in accelerator.log_with)
            self.warning(f"warning: trackers {names} disabled: {type(exc).__name__}: {exc}")
            return
        self._accelerator = accelerator
        if any(t.name == "tensorboard" for t in accelerator.trackers):
            self._tensorboard = accelerator.get_tracker("tensorboard", unwrap=True)

    def _append(self, name: str, text: str) -> None:
        f = self._files.get(name)
        if f is None:
            return
        try:
            with disk_full_guard(self.log_dir / name):
                f.write(text)
        except (DiskFullError, OSError) as exc:
            self._drop_files()  # the lines that report this one must not fail the same way
            if isinstance(exc, DiskFullError):
                raise
            raise UserError(f"cannot write {self.log_dir / name}: {exc}") from None

    def info(self, msg: str) -> None:
        if self.is_main:
            from tqdm import tqdm

            with tqdm.external_write_mode():  # a progress bar on the terminal is cleared, then redrawn below
                print(msg, flush=True)
            self._append(layout.TRAINING_LOG, f"{time.strftime('%Y-%m-%d %H:%M:%S')} {msg}\n")

    def warning(self, msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)
        self._append(layout.TRAINING_LOG, f"{time.strftime('%Y-%m-%d %H:%M:%S')} {msg}\n")

    error = warning

    def write_row(self, row: dict) -> None:
        """One JSON line in metrics.jsonl, and every numeric field to the trackers."""
        if not self.is_main:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        clean["time"] = round(time.time(), 3)
        self._append(layout.METRICS, json.dumps(clean) + "\n")
        if self._accelerator is None:
            return
        group = ("eval" if "val_loss" in row or "eval_tasks_s" in row else "checkpoint" if "checkpoint" in row
                 else "spike" if any(k.startswith("spike/") for k in row) else "train")
        scalars = {k if k.startswith(f"{group}/") else f"{group}/{k}": v for k, v in row.items()  # eval/<task>/acc
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        try:
            with disk_full_guard(self._tracker_dir()):
                self._accelerator.log(scalars, step=row["step"])
                tokens = row.get("tokens")
                if group != "checkpoint" and tokens is not None and self._tensorboard is not None:  # step 0 too
                    for key, value in scalars.items():
                        self._tensorboard.add_scalar(f"by_tokens/{key}", value, tokens)
        except DiskFullError:
            self._accelerator, self._tensorboard = None, None  # closing them would fail the same way
            self._drop_files()
            raise

    def _tracker_dir(self) -> Path:
        return Path(getattr(self._tensorboard, "log_dir", None) or self.log_dir)

    def write_samples(self, step: int, tokens: int, samples: list[tuple[str, str]]) -> None:
        """Samples of the model's text (utils/evals/sampling.py): logs/samples.jsonl, the log, TensorBoard's text
        tab."""
        if not self.is_main:
            return
        if layout.SAMPLES not in self._files:
            self._files[layout.SAMPLES] = open(self.log_dir / layout.SAMPLES, "a", buffering=1)
        for prompt, text in samples:
            self._append(layout.SAMPLES, json.dumps({"step": step, "tokens": tokens, "prompt": prompt,
                                                      "continuation": text, "time": round(time.time(), 3)}) + "\n")
            self.info(f"Sample at step {step}: {prompt!r} -> {text!r}")
        if self._tensorboard is not None:
            table = "\n\n".join(f"**{prompt}**{text}" for prompt, text in samples)
            self._tensorboard.add_text("samples", table, step)

    def _drop_files(self) -> None:
        for f in self._files.values():
            try:
                f.close()
            except OSError:
                pass
        self._files.clear()

    def close(self) -> None:
        if self._accelerator is not None:
            try:
                self._accelerator.end_training()
            except Exception as exc:  # noqa: BLE001 - flushing a tracker must not hide the run's result
                print(f"warning: closing trackers: {exc}", file=sys.stderr)
            self._accelerator = None
        self._drop_files()


class NonFiniteLoss(UserError):
    pass


# The parts of a run's start, in the order a run passes them, and how the first step's line names them.
STARTUP_PHASES = {"imports": "imports", "setup": "setup", "data_index": "data index", "model_build": "model build",
                  "restore": "checkpoint restore", "trackers": "trackers", "compile_cache": "compile cache load",
                  "compile": "compile (preflight)", "preflight": "preflight", "evaluation": "step-0 evaluation",
                  "first_step": "first step"}


class StartupClock:
    """Where the time to the first step goes: `mark(phase)` at the end of each part of the start (STARTUP_PHASES)
    adds the time since the previous mark (the first one: since the process started) to it. The first metrics row
    carries each as `start/<phase>_s` beside `first_step_s`, their sum; a phase the run skips (a fresh run's
    restore) has none."""

    def __init__(self, started: float | None = None):
        self.started = started if started is not None else time.perf_counter()
        self._last = self.started
        self.seconds: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        if phase not in STARTUP_PHASES:
            raise ValueError(f"unknown startup phase {phase!r}")
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + (now - self._last)
        self._last = now

    @property
    def total_s(self) -> float:
        return self._last - self.started

    def row(self) -> dict:
        return {f"start/{phase}_s": round(self.seconds[phase], 3) for phase in STARTUP_PHASES if phase in self.seconds}


def startup_line(row: dict) -> str:
    """"time to first step: 21.4 s from the process start: imports 3.1 s, ..." from a row's first_step_s and
    start/<phase>_s."""
    parts = [f"{label} {row[f'start/{phase}_s']:.1f} s" for phase, label in STARTUP_PHASES.items()
             if f"start/{phase}_s" in row]
    return f"time to first step: {row['first_step_s']:.1f} s from the process start" + (
        f": {', '.join(parts)}" if parts else "")


class MetricsWindow:
    """The steps since the last log line: their losses (device tensors, no host sync until `row`), the time
    they took, and the time spent waiting for data. It also counts the session's training steps and their time
    over every window (`session`), for the closing summary.

    Training time is measured by the window itself: a step's time runs from `begin_step()` to `add()`, plus
    the host sync that ends a window in `row()` (the device finishing the window's queued work) and the loop's
    waits for data between steps; whatever the loop does between steps otherwise (validation, downstream
    evals, samples, checkpoints) is never counted, so tokens/s and MFU leave it out without being told.
    `data_wait()` is the loader's own count of the seconds the loop waited for data (ResumableLoader.wait_s)."""

    def __init__(self, accelerator, tokens_per_step: int, flops_per_token: float, peak: float | None,
                 precision: str, startup: StartupClock | None = None, data_wait=None, z_loss_heads=()):
        self.accelerator = accelerator
        # z_loss > 0: the LM heads (utils/model/lm_loss.py) whose z term is taken out of each step's loss
        # (the row's `loss` is the cross-entropy) and logged as `z_loss`
        self.z_loss_heads = list(z_loss_heads)
        self._data_wait = data_wait or (lambda: 0.0)
        self.tokens_per_step, self.flops_per_token, self.peak = tokens_per_step, flops_per_token, peak
        self.precision = precision
        self.per_device: list[dict] = []
        self.startup = startup  # the start's clock: the first step ends its last phase (time to first step)
        self.first_step_s: float | None = None
        self._first_step_reported = False
        self.trained_steps, self.trained_s = 0, 0.0  # this session's, over every window
        self.restart(first_step=1)

    def restart(self, first_step: int) -> None:
        """A new window from `first_step`, its clock starting now."""
        self._new_window(first_step)
        for head in self.z_loss_heads:
            head.pop_z_loss()  # preflight's forwards, a rolled-back window's: not this window's
        self._clock, self._waited = time.perf_counter(), self._data_wait()

    def begin_step(self) -> None:
        """A step starts: the time since the last step is not training, but its waits for data are (the loop
        waited for the files of this step)."""
        waited = self._data_wait() - self._waited
        self._waited += waited
        self.data_wait_s += waited
        self._count(waited)
        self._clock = time.perf_counter()

    def _new_window(self, first_step: int) -> None:
        self.losses: list[torch.Tensor] = []
        self.grad_norms: list[torch.Tensor] = []  # each step's, when add() is given it
        self.z_losses: list[torch.Tensor] = []
        self.skipped: list[int] = []  # indices into losses of the steps whose update was skipped
        self.first_step = first_step
        self.data_wait_s = self.window_s = 0.0

    def add(self, step_loss: torch.Tensor, grad_norm: torch.Tensor | None = None, skipped: bool = False) -> None:
        if self.first_step_s is None and self.startup is not None:  # once: imports, setup, compile, step 1
            if self.accelerator.device.type == "cuda":
                torch.cuda.synchronize(self.accelerator.device)
            self.startup.mark("first_step")
            self.first_step_s = self.startup.total_s
        if skipped:
            self.skipped.append(len(self.losses))
        z_terms = [z for z in (head.pop_z_loss() for head in self.z_loss_heads) if z is not None]
        if z_terms:
            z = sum(z_terms)
            self.z_losses.append(z)
            step_loss = step_loss - z
        self.losses.append(step_loss)
        if grad_norm is not None:
            self.grad_norms.append(grad_norm.detach().float().reshape(()))
        self.trained_steps += 1
        waited = self._data_wait() - self._waited
        self._waited += waited
        self.data_wait_s += waited
        self._charge()

    def _charge(self) -> None:
        """The time since the clock last started is training time."""
        now = time.perf_counter()
        self._count(now - self._clock)
        self._clock = now

    def _count(self, seconds: float) -> None:
        self.window_s += max(0.0, seconds)
        self.trained_s += max(0.0, seconds)

    def session(self) -> tuple[int, float, float | None, float | None]:
        """(tokens, seconds, tokens/s, MFU) of this session's training steps (tokens of every rank): eval,
        samples and checkpoints are left out, as in each window's row."""
        tokens = self.trained_steps * self.tokens_per_step
        if not self.trained_s:
            return tokens, 0.0, None, None
        tps = tokens / self.trained_s
        return tokens, self.trained_s, tps, mfu(tps, self.flops_per_token, self.peak, self.accelerator.num_processes)

    def checked_losses(self) -> torch.Tensor:
        """Per-step losses averaged over ranks (one host sync); stops the run at the first step not skipped
        whose loss, or gradient norm (the same on every rank: taken after the all-reduce), is not finite, on
        every rank alike. Under fp16 a non-finite norm is the grad scaler's: it skips that step itself."""
        if not self.losses:
            return torch.zeros(0)
        checks_norms = self.precision != "fp16" and len(self.grad_norms) == len(self.losses)
        rows = [torch.stack(self.losses).float()] + ([torch.stack(self.grad_norms)] if checks_norms else [])
        values = self.accelerator.reduce(torch.stack(rows), reduction="mean").cpu()
        losses = values[0]
        bad = ~torch.isfinite(values).all(dim=0)
        bad[self.skipped] = False
        bad = bad.nonzero()
        if bad.numel():
            k = int(bad[0])
            what = "loss" if not math.isfinite(losses[k]) else f"gradient norm (its loss {float(losses[k]):.4g})"
            fp32 = "" if self.precision == "fp32" else " with --mixed-precision no"
            raise NonFiniteLoss(f"non-finite {what} at step {self.first_step + k} ({self.precision} precision); no "
                                f"checkpoint was written for it. Lower learning_rate{fp32} and start again, or "
                                f"resume (--resume auto) if this run saved a checkpoint before it")
        return losses

    def row(self, step: int, tokens: int, lr: float, grad_norm: torch.Tensor) -> dict:
        """The logging row for the window ending at `step`; the window starts again after it."""
        losses = self.checked_losses()
        self._charge()  # since the last step's add(): the host sync just now finished the window's device work
        elapsed = max(1e-9, self.window_s)
        n = len(self.losses)
        tps = n * self.tokens_per_step / elapsed
        applied = torch.ones(n, dtype=torch.bool)
        applied[self.skipped] = False
        row = {"step": step, "tokens": tokens, "loss": float(losses[applied].mean()), "lr": lr,
               "grad_norm": float(grad_norm),  # the same on every rank: taken after the all-reduce
               "tokens_per_sec": tps, "mfu": mfu(tps, self.flops_per_token, self.peak, self.accelerator.num_processes),
               "steps_per_sec": n / elapsed, "data_wait_frac": self.data_wait_s / elapsed,
               "window_steps": n}  # the steps the row's averages cover: fewer than logging_steps after a resume
        if self.skipped:
            row["skipped_steps"] = len(self.skipped)
        if self.z_losses:
            row["z_loss"] = float(self.accelerator.reduce(torch.stack(self.z_losses), reduction="mean").mean())
        row |= self._device_stats()
        if self.first_step_s is not None and not self._first_step_reported:
            row["first_step_s"] = self.first_step_s
            row |= self.startup.row()
            self._first_step_reported = True
        self._new_window(step + 1)
        return row

    def _device_stats(self) -> dict:
        """Memory (max over ranks) and mean GPU utilisation; each device's own figures in `per_device`."""
        from accelerate.utils import gather_object

        stats = local_device_stats(self.accelerator.device)
        if self.accelerator.device.type != "cuda":
            return {"host_peak_rss_gb": stats["host_peak_rss_gb"]}
        self.per_device = gather_object([stats]) if self.accelerator.num_processes > 1 else [stats]
        busy = [s["gpu_util"] for s in self.per_device if s["gpu_util"] is not None]
        return {"mem_gb": max(s["mem_gb"] for s in self.per_device),
                "peak_mem_gb": max(s["peak_mem_gb"] for s in self.per_device),
                "gpu_util": sum(busy) / len(busy) if busy else None}


def format_step_line(row: dict, best: float) -> str:
    """`Step 100: loss=2.4567, lr=1.23e-04, best=2.4234 | 5.2 steps/sec | 41,000 tok/s | MFU 47.1%`; with
    steps the spike guard skipped, `| 1 skipped` (and `loss=-` when it skipped them all)."""
    loss = f"{row['loss']:.4f}" if math.isfinite(row["loss"]) else "-"
    line = (f"Step {row['step']}: loss={loss}, lr={row['lr']:.2e}, best={best:.4f} | "
            f"{row['steps_per_sec']:.2f} steps/sec | {row['tokens_per_sec']:,.0f} tok/s")
    if row.get("skipped_steps"):
        line += f" | {row['skipped_steps']} skipped"
    if row.get("mfu") is not None:
        line += f" | MFU {100 * row['mfu']:.1f}%"
    if row.get("data_wait_frac") is not None:
        line += f" | data wait {100 * row['data_wait_frac']:.1f}%"
    return line


def read_metrics(path) -> list[dict]:
    """logs/metrics.jsonl's rows; a torn last line (a killed run) is skipped."""
    rows = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return rows
    for line in lines:
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def rows_with(rows: list[dict], key: str) -> list[dict]:
    """The rows carrying `key` (not null), one per step (the last written wins, as after a resume that
    rewrote steps a crashed session had logged), in step order."""
    return sorted({r["step"]: r for r in rows if r.get(key) is not None}.values(), key=lambda r: r["step"])


def closing_summary(metrics_path, *, step: int, tokens: int, session_s: float, window: MetricsWindow,
                    checkpoint: Path | None, final_model: Path | None, spikes: str | None = None) -> str:
    """The lines that end a run: the step and tokens reached, this session's training throughput (from
    the window's counters: the tokens it trained over the time of its training steps, eval, samples and
    checkpoints left out), the first and last validation loss up to `step` from the run's whole
    metrics.jsonl (every resumed session), the spike guard's line (`spikes`) if it met any, and where the
    checkpoint and the model are. A mixture's sources are compared each on its own validation loss: their
    weighted mean changes meaning when a resume changes the weights, so it is given at the end only."""
    trained, trained_s, tps, util = window.session()
    head = f"Summary: {step:,} steps, {tokens:,} tokens; this session {session_s:,.0f} s"
    if tps is None:
        head += ", no training step"
    else:
        head += (f", {trained:,} tokens trained in {trained_s:,.1f} s of training steps (eval, samples and "
                 f"checkpoints left out): {tps:,.0f} tok/s" + (f", MFU {100 * util:.1f}%" if util is not None else ""))
    lines = [head]
    evals = [r for r in rows_with(read_metrics(metrics_path), "val_loss") if r["step"] <= step]
    sources = sorted({k for r in evals for k in r if k.startswith("val_loss/") and r[k] is not None})
    for key in sources or ["val_loss"]:
        points = [(r["step"], r[key]) for r in evals if r.get(key) is not None]
        if not points:
            continue
        (first_step, first), (last_step, final) = points[0], points[-1]
        if last_step == first_step:
            lines.append(f"  {key} {first:.4f} at step {first_step}")
            continue
        change = f" ({100 * (final - first) / first:+.1f}%)" if first else ""
        lines.append(f"  {key} {first:.4f} at step {first_step} -> {final:.4f} at step {last_step}{change}")
    if sources and evals:
        lines.append(f"  val_loss (the sources' weighted mean) {evals[-1]['val_loss']:.4f} at step {evals[-1]['step']}")
    if spikes:
        lines.append(spikes)
    lines.append(f"  checkpoint: {checkpoint or 'none'}")
    if final_model is not None:
        lines.append(f"  model: {final_model} (python generate.py {final_model} --prompt \"...\")")
    return "\n".join(lines)
