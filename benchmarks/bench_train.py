"""Training speed, side by side: this engine (the real train.py), transformers' Trainer and a bare loop.

    python benchmarks/bench_train.py                   # CPU: micro model, fp32, 3 time-sliced rounds (~3 min)
    python benchmarks/bench_train.py --json bench.json # CUDA: gpt-neox-1.2b, bf16, compile, the engine's profile

Every contender trains the same model on the same synthetic shards (uint16 token streams in the production
.npz format) with the same precision and batch, in its own process: `--warmup` optimizer steps, then
`--steps` timed ones, cut into windows of `gcd(warmup, steps)` steps. Per run the median window gives
tokens/s and step time; per contender the median over `--repeats` rounds is printed, with ratios.

- engine:  `train.py --config production --set ...`; its windows are the wall-clock gaps between the
           rows of logs/metrics.jsonl (its own logging is inside them; the final eval, checkpoint and
           export come after the last one).
- trainer: transformers.Trainer on the same GPTNeoXForCausalLM with its documented fast settings (bf16,
           SDPA, adamw_torch_fused, torch_compile on CUDA), fed through utils.data.dataset.TokenSequenceDataset.
- naive:   transformers.Trainer with its default arguments (fp32, no compile, its default optimizer and
           loader settings), same model, batch and schedule: the "standard configuration" the seed documents
           claim a 5-10x speed-up over. Only `--only` with it, or the default on CUDA, runs it.
- fsdp:    the engine with `strategy=fsdp` in the same single process (FSDP2 over a world of one): what
           sharding's hooks cost on one GPU, `fsdp/engine` (the FSDP issue asks for >= 0.95). Only with `--only`.
- document: the engine with `attention=document` (each token attends within its own document; the shards'
           documents end with id 0 after ~DOC_TOKENS tokens on average): what document masking costs,
           `document/engine` (FlexAttention's block mask on CUDA, SDPA with a dense mask on the CPU). Only
           with `--only`, e.g. `--only engine,document`.
- bare:    utils.model.build_model + utils.training.optim.build_optimizer, lr_scheduler.build_scheduler, batches already
           in device memory, forward/backward/clip/step/zero_grad, one `.item()` at the end: the ceiling.

Schedules. `rounds` (default on CUDA) runs the contenders one after another, order rotated each round.
`slices` (default on CPU) starts a round's contenders together and lets one run at a time, round-robin
in `--slice-s` slices (SIGSTOP/SIGCONT to each process group): on a shared CPU every contender then meets
the same background load, and each window's time excludes the slices its process spent stopped.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path

import numpy as np

from utils.runtime.threads import settle_wait

WORKER_STARTED = time.perf_counter()  # a worker's time to first step counts from its start
REPO_ROOT = Path(__file__).resolve().parent.parent

CONTENDERS = ("engine", "trainer", "naive", "bare", "fsdp", "document")
ENGINES = ("engine", "fsdp", "candidate", "document")  # train.py processes
BIG = 10**9  # eval_interval / save_steps that never fire inside the timed span
# A gated child stops itself before exec, so the scheduler decides when it first runs.
STOP_THEN_EXEC = "import os, signal, sys; os.kill(os.getpid(), signal.SIGSTOP); os.execv(sys.argv[1], sys.argv[1:])"
# Runs train.py unchanged, adding to each training row of metrics.jsonl the process's CPU seconds, the wall and CPU
# seconds spent in the optimizer's step so far, and (Muon) each rank's Newton-Schulz FLOPs per step. Every rank
# of a launch runs it (benchmarks/bench_muon_ranks.py); rank 0 writes the rows.
ENGINE_SHIM = """
import os, runpy, sys, time, types
path = sys.argv[1]
sys.argv = sys.argv[1:]
import utils.observe.metrics
import utils.training.optim
timed = {"s": 0.0, "cpu_s": 0.0, "optimizer": None}
build_optimizer = utils.training.optim.build_optimizer
def build_timed(*args, **kwargs):
    optimizer = build_optimizer(*args, **kwargs)
    step = optimizer.step
    def timed_step(self, *a, **k):
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            return step(*a, **k)
        finally:
            timed["s"] += time.perf_counter() - wall
            timed["cpu_s"] += time.process_time() - cpu
    optimizer.step = types.MethodType(timed_step, optimizer)
    timed["optimizer"] = optimizer
    return optimizer
utils.training.optim.build_optimizer = build_timed
write_row = utils.observe.metrics.RunLogger.write_row
def write_row_with_cpu(self, row):
    if "loss" in row:
        ns = getattr(timed["optimizer"], "newton_schulz_flops", None)
        row = dict(row, bench_cpu_s=time.process_time(), bench_opt_s=timed["s"], bench_opt_cpu_s=timed["cpu_s"],
                   bench_ns_flops=ns() if ns else None)
    write_row(self, row)
utils.observe.metrics.RunLogger.write_row = write_row_with_cpu
runpy.run_path(path, run_name="__main__")
"""


# ------------------------------------------------------------------------------------------ settings


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="micro | tiny | demo | gpt-neox-1.2b (default: micro on CPU, gpt-neox-1.2b on CUDA)")
    p.add_argument("--steps", type=int, help="timed optimizer steps per run (default: 600 CPU, 30 CUDA)")
    p.add_argument("--warmup", type=int, help="untimed optimizer steps first (default: 50 CPU, 10 CUDA)")
    p.add_argument("--micro-batch", type=int, help="sequences per forward pass (default: 16 CPU, the preset's CUDA)")
    p.add_argument("--accum", type=int, help="gradient accumulation steps (default: 1 CPU, the preset's CUDA)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: the model's context)")
    p.add_argument("--precision", choices=("no", "bf16", "fp8"), help="default: no on CPU, bf16 on CUDA; fp8: the "
                   "engine and bare loop use torchao float8 Linears (Hopper/Ada), the Trainer stays bf16")
    p.add_argument("--optimizer", choices=("adamw", "muon"), help="the engine's and bare loop's optimizer (default: "
                   "the production preset's; the Trainer keeps AdamW: it has no Muon)")
    p.add_argument("--impl", choices=("native", "hf"), default="native",
                   help="the model implementation engine and bare loop train (model_impl)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the model (default: on with CUDA, off on CPU)")
    p.add_argument("--workers", type=int, help="DataLoader workers for engine and trainer "
                   "(default: the production preset's on CUDA, 0 on CPU)")
    p.add_argument("--profile", default="auto", help="the engine's memory profile (utils/profiles.py): auto picks "
                   "by GPU memory and changes micro-batch/accumulation/checkpointing; the others get what it chose")
    p.add_argument("--threads", type=int, help="torch threads per process (default: 1 on CPU, torch's own on "
                   "CUDA); on a shared CPU, OpenMP spinning over busy cores makes figures swing 10x")
    p.add_argument("--only", help="comma-separated subset of engine,trainer,naive,bare,fsdp (default: all but "
                   "fsdp on CUDA; engine,trainer,bare on CPU, where every contender is fp32 anyway)")
    p.add_argument("--repeats", type=int, help="rounds (default: 3 on CPU, 1 on CUDA)")
    p.add_argument("--schedule", choices=("slices", "rounds"), help="default: slices on CPU, rounds on CUDA")
    p.add_argument("--slice-s", type=float, default=1.0, help="run time per turn with --schedule slices")
    p.add_argument("--data-dir", help="shard folder to fill (if it holds no .npz) and use; default: a temp dir")
    p.add_argument("--candidate-repo", help="also run DIR/train.py (another checkout, e.g. with a proposed change) "
                   "as contender 'candidate' and print candidate/engine")
    p.add_argument("--json", dest="json_out", help="also write every figure to this JSON file")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per round before its processes are killed")
    p.add_argument("--_worker", choices=("trainer", "naive", "bare"), help=argparse.SUPPRESS)
    p.add_argument("--_spec", help=argparse.SUPPRESS)
    p.add_argument("--_result", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def resolve_settings(args, cuda: bool) -> dict:
    from configs import get_model_spec, get_training_config

    model = args.model or ("gpt-neox-1.2b" if cuda else "micro")
    spec = get_model_spec(model)
    production = get_training_config("production")
    schedule = args.schedule or ("rounds" if cuda or not hasattr(signal, "SIGSTOP") else "slices")
    if schedule == "slices" and not hasattr(signal, "SIGSTOP"):
        raise SystemExit("error: --schedule slices needs POSIX signals; use --schedule rounds")

    def pick(given, on_cuda, on_cpu):
        return given if given is not None else (on_cuda if cuda else on_cpu)

    s = {
        "model": model,
        "steps": pick(args.steps, 30, 600),
        "warmup": pick(args.warmup, 10, 50),
        "micro_batch": pick(args.micro_batch, production.per_device_train_batch_size, 16),
        "accum": pick(args.accum, production.gradient_accumulation_steps, 1),
        "seq_len": pick(args.seq_len, spec.max_position_embeddings, spec.max_position_embeddings),
        "precision": pick(args.precision, "bf16", "no"),
        "compile": pick(args.compile, True, False),
        "impl": args.impl,
        "optimizer": args.optimizer or production.optimizer,
        "workers": pick(args.workers, production.dataloader_num_workers, 0),
        "prefetch": production.prefetch_factor,
        "threads": pick(args.threads, 0, 1),
        "repeats": pick(args.repeats, 1, 3),
        "profile": args.profile,
        "schedule": schedule,
        "slice_s": args.slice_s,
        "device": "cuda" if cuda else "cpu",
    }
    if min(s["steps"], s["warmup"], s["micro_batch"], s["accum"], s["seq_len"], s["repeats"]) < 1:
        raise SystemExit("error: --steps, --warmup, --micro-batch, --accum, --seq-len and --repeats must be >= 1")
    if s["seq_len"] > spec.max_position_embeddings:
        raise SystemExit(f"error: --seq-len {s['seq_len']} exceeds {model}'s context {spec.max_position_embeddings}")
    if s["slice_s"] <= 0:
        raise SystemExit("error: --slice-s must be positive")
    # Rows land every `log_every` steps; a divisor of both puts one exactly at the end of warm-up and one
    # at the end of the timed span.
    s["log_every"] = math.gcd(s["warmup"], s["steps"])
    s["max_steps"] = s["warmup"] + s["steps"]
    return s


def engine_overrides(s: dict) -> dict:
    """The training-config fields every contender shares (engine: --set; the others read the config)."""
    return {
        "model": s["model"], "seq_len": s["seq_len"], "max_steps": s["max_steps"],
        "per_device_train_batch_size": s["micro_batch"], "gradient_accumulation_steps": s["accum"],
        "mixed_precision": s["precision"], "compile_model": s["compile"], "model_impl": s["impl"],
        "optimizer": s["optimizer"],
        "dataloader_num_workers": s["workers"], "prefetch_factor": s["prefetch"],
        "logging_steps": s["log_every"], "eval_interval": BIG, "save_steps": BIG, "eval_batches": 1,
        "val_files": 1, "profile": s["profile"],
    }


def apply_engine_profile(s: dict, device_gib: float | None) -> None:
    """Resolve the memory profile as train.py will, so every contender trains the batch layout, activation
    checkpointing and optimizer-state precision the engine chose (train.py resolving it again is a no-op)."""
    from configs import get_training_config
    from configs.profiles import resolve_profile
    from utils.model.activation_checkpointing import CheckpointingSettings

    cfg, profile = resolve_profile(get_training_config("production", engine_overrides(s)), s["device"], device_gib)
    s.update(micro_batch=cfg.per_device_train_batch_size, accum=cfg.gradient_accumulation_steps,
             activation_checkpointing=CheckpointingSettings.of(cfg).policy[0],
             optimizer_state_dtype=cfg.optimizer_state_dtype,
             profile_used=profile.name if profile else "none")


def training_config(s: dict):
    """The config the engine trains with, after its profile: what the trainer and bare loop copy."""
    from dataclasses import replace

    from configs import get_training_config

    return replace(get_training_config("production", engine_overrides(s)),
                   activation_checkpointing=s["activation_checkpointing"], gradient_checkpointing=False,
                   optimizer_state_dtype=s["optimizer_state_dtype"])


def child_env(s: dict, repo: Path = REPO_ROOT) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(repo) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env["TOKENIZERS_PARALLELISM"] = "false"
    env.pop("NEOX_TRACE_BATCHES", None)
    if s["threads"]:
        for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            env[key] = str(s["threads"])
    return env


# ------------------------------------------------------------------------------------------ data


EOS_ID = 0  # the synthetic documents' end (attention=document reads it as eos_id)
DOC_TOKENS = 1024  # their mean length: exponentially distributed, as web text's are roughly


def write_stream_shard(path: Path, tokens: int, vocab: int, seed: int) -> None:
    """An uncompressed .npz of random uint16 ids (a 1-D token stream of documents ending with EOS_ID, ~DOC_TOKENS
    long on average), written atomically."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, vocab, tokens, dtype=np.uint16)
    ends = np.cumsum(1 + rng.exponential(DOC_TOKENS - 1, tokens // DOC_TOKENS * 2 + 16).astype(np.int64)) - 1
    ids[ends[ends < tokens]] = EOS_ID
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, input_ids=ids)
    os.replace(tmp, path)


def ensure_data(data_dir: Path, s: dict, vocab: int, train_files: int = 3) -> None:
    """`train_files` training shards that together hold one epoch of the whole run (so no contender
    restarts an epoch inside the timed span), plus one validation shard."""
    if any(data_dir.rglob("*.npz")):
        return
    data_dir.mkdir(parents=True, exist_ok=True)
    need = int(1.25 * s["max_steps"] * s["micro_batch"] * s["accum"] * s["seq_len"]) + s["seq_len"]
    per_file = -(-need // train_files)
    for i in range(train_files):
        write_stream_shard(data_dir / f"train-{i:03d}.npz", per_file, vocab, seed=i)
    write_stream_shard(data_dir / "val-999.npz", 8 * s["micro_batch"] * s["seq_len"], vocab, seed=999)


def train_split(data_dir: str, s: dict):
    from configs import get_model_spec
    from utils.data.dataset import TokenSequenceDataset
    from utils.data.index import ShardIndex

    spec = get_model_spec(s["model"])
    index = ShardIndex.build(data_dir, seq_len=s["seq_len"], vocab_size=spec.vocab_size, log=lambda *_: None)
    return TokenSequenceDataset(index.split(1)[0])


# ------------------------------------------------------------------------------------------ processes


@dataclass
class Job:
    """One contender's process in one round, and how to read its result afterwards."""

    name: str
    cmd: list
    env: dict
    cwd: Path
    log: Path
    read_result: object  # () -> raw result dict
    running: list = field(default_factory=list)  # [(mono_start, mono_end, real_start, real_end)] it was let run


def engine_job(name: str, repo: Path, s: dict, data_dir: Path, work: Path) -> Job:
    out = work / name
    cmd = [sys.executable, "-c", ENGINE_SHIM, str(repo / "train.py"), "--config", "production",
           "--output-dir", str(out), "--data-dir", str(data_dir), "--no-background-upload"]
    overrides = engine_overrides(s) | ({"strategy": "fsdp"} if name == "fsdp" else {}) | (
        {"attention": "document", "eos_id": EOS_ID} if name == "document" else {})
    if name == "candidate":  # another checkout may predate model_impl (it trains its own default model) and optimizer
        overrides.pop("model_impl")
        if overrides["optimizer"] == "adamw":
            overrides.pop("optimizer")
    for key, value in overrides.items():
        cmd += ["--set", f"{key}={str(value).lower() if isinstance(value, bool) else value}"]

    def read_result() -> dict:
        lines = (out / "logs" / "metrics.jsonl").read_text().splitlines()
        rows = {r["step"]: r for r in map(json.loads, filter(str.strip, lines)) if "loss" in r}
        marks = list(range(s["warmup"], s["max_steps"] + 1, s["log_every"]))
        if any(k not in rows for k in marks):
            raise RuntimeError(f"{name}: metrics.jsonl lacks rows at steps {marks}: has {sorted(rows)}")
        timed = [rows[k] for k in marks[1:]]
        last = rows[marks[-1]]
        return {"clock": "realtime", "marks": [rows[k]["time"] for k in marks],
                "cpu_marks": [rows[k]["bench_cpu_s"] for k in marks],
                "opt_cpu_marks": [rows[k]["bench_opt_cpu_s"] for k in marks],
                "ns_flops": last.get("bench_ns_flops"),
                # data_wait_frac is a share of the row's own loop time, log_every / steps_per_sec
                "waits": [r["data_wait_frac"] * s["log_every"] / r["steps_per_sec"] for r in timed],
                "peak_mem_gb": last.get("peak_mem_gb") if s["device"] == "cuda" else last.get("host_peak_rss_gb"),
                "final_loss": last["loss"],
                "first_step_s": next((r["first_step_s"] for r in rows.values() if "first_step_s" in r), None)}

    return Job(name, cmd, child_env(s, repo), repo, work / f"{name}.log", read_result)


def worker_job(kind: str, s: dict, data_dir: Path, work: Path) -> Job:
    spec_path, result_path = work / f"{kind}-spec.json", work / f"{kind}-result.json"
    spec_path.write_text(json.dumps(s | {"data_dir": str(data_dir), "work": str(work / kind)}))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_worker", kind, "--_spec", str(spec_path),
           "--_result", str(result_path)]
    return Job(kind, cmd, child_env(s), REPO_ROOT, work / f"{kind}.log", lambda: json.loads(result_path.read_text()))


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def run_jobs(jobs: list[Job], gated: bool, slice_s: float, timeout: float) -> None:
    """Run `jobs` to completion. Gated: all start stopped, then one process group at a time runs for
    `slice_s`, round-robin; each job's running intervals are recorded in both clocks."""
    procs = {}
    try:
        for job in jobs:
            cmd = [sys.executable, "-c", STOP_THEN_EXEC, *job.cmd] if gated else job.cmd
            with open(job.log, "w") as log:
                procs[job.name] = subprocess.Popen(cmd, env=job.env, cwd=job.cwd, stdout=log,
                                                   stderr=subprocess.STDOUT, start_new_session=True)
            if gated:  # wait until it has stopped itself
                _, status = os.waitpid(procs[job.name].pid, os.WUNTRACED)
                if not os.WIFSTOPPED(status):
                    raise RuntimeError(f"{job.name} ended before it started: {job.log.read_text()[-2000:]}")
        deadline = time.monotonic() + timeout
        alive = list(jobs)
        while alive:
            for job in list(alive):
                proc = procs[job.name]
                start = (time.perf_counter(), time.time())
                if gated:
                    _signal_group(proc.pid, signal.SIGCONT)
                alone = len(alive) == 1
                try:
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()) if alone or not gated else slice_s)
                    finished = True
                except subprocess.TimeoutExpired:
                    finished = False
                    if gated and not alone:
                        _signal_group(proc.pid, signal.SIGSTOP)
                end = (time.perf_counter(), time.time())
                job.running.append((start[0], end[0], start[1], end[1]))
                if finished:
                    alive.remove(job)
                    if proc.returncode != 0:
                        raise RuntimeError(f"{job.name} exited {proc.returncode}; its output ends:\n"
                                           f"{job.log.read_text()[-4000:]}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the round ran past --timeout {timeout:.0f} s")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                _signal_group(proc.pid, signal.SIGKILL)
                _signal_group(proc.pid, signal.SIGCONT)
                proc.wait()


def window_figures(raw: dict, running: list, s: dict) -> dict:
    """Each window's time counts only while its process was let run. A window that no stop interrupted
    is `clean`; data wait is taken from clean windows, since a stop during a data fetch counts as wait."""
    lo, hi = (0, 1) if raw["clock"] == "monotonic" else (2, 3)
    spans = [(r[lo], r[hi]) for r in running]
    windows, clean = [], []
    for a, b in zip(raw["marks"], raw["marks"][1:]):
        windows.append(sum(max(0.0, min(b, y) - max(a, x)) for x, y in spans))
        clean.append(any(x <= a + 1e-3 and b <= y + 1e-3 for x, y in spans))  # engine stamps are rounded to 1 ms
    use = [i for i, c in enumerate(clean) if c] or list(range(len(windows)))
    step_s = statistics.median(windows) / s["log_every"]
    step_tokens = s["micro_batch"] * s["accum"] * s["seq_len"]
    cpu = [b - a for a, b in zip(raw["cpu_marks"], raw["cpu_marks"][1:])]
    cpu_step_s = statistics.median(cpu) / s["log_every"]
    opt = raw.get("opt_cpu_marks")  # the optimizer step's share of the timed span's CPU time (engine, bare)
    opt_cpu_frac = (opt[-1] - opt[0]) / (raw["cpu_marks"][-1] - raw["cpu_marks"][0]) if opt else None
    return {"windows": windows, "clean": clean, "cpu_windows": cpu, "step_s": step_s, "cpu_step_s": cpu_step_s,
            "tokens_per_sec": step_tokens / step_s, "cpu_tokens_per_sec": step_tokens / cpu_step_s,
            "mean_tokens_per_sec": s["steps"] * step_tokens / sum(windows), "opt_cpu_frac": opt_cpu_frac,
            "ns_gflop": None if raw.get("ns_flops") is None else max(raw["ns_flops"]) / 1e9,
            "data_wait_frac": sum(raw["waits"][i] for i in use) / sum(windows[i] for i in use)}


# ------------------------------------------------------------------------------------------ workers


def _sync(torch, device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_mem_gb(torch, device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _is_mark(step: int, s: dict) -> bool:
    return step >= s["warmup"] and (step - s["warmup"]) % s["log_every"] == 0


def worker_bare(s: dict) -> dict:
    """The same math as train.py with nothing around it: batches already on the device, no loader."""
    import torch

    from configs import get_model_spec
    from utils.model import build_model
    from utils.model.activation_checkpointing import apply_activation_checkpointing
    from utils.training.lr_scheduler import build_scheduler
    from utils.training.optim import OptimizerSettings, build_optimizer
    from utils.training.schedules import ScheduleSettings

    cfg = training_config(s)
    device = torch.device(s["device"])
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    dataset = train_split(s["data_dir"], s)
    count, b = min(64, s["max_steps"] * s["accum"]), s["micro_batch"]
    batches = [torch.from_numpy(dataset.get_batch(range(i * b, (i + 1) * b))).to(device) for i in range(count)]
    model = build_model(get_model_spec(s["model"]), seed=cfg.seed, impl=s["impl"])
    apply_activation_checkpointing(model, cfg.activation_checkpointing, cfg.activation_checkpointing_every)
    model = model.to(device)
    if s["precision"] == "fp8":
        from utils.model.fp8 import enable_fp8

        enable_fp8(model)
    optimizer = build_optimizer(model, OptimizerSettings.of(cfg), fused=device.type == "cuda")
    scheduler = build_scheduler(optimizer, ScheduleSettings.of(cfg))
    if s["compile"]:
        model.compile_blocks()  # as the engine does: regional compile
    forward = model
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=s["precision"] in ("bf16", "fp8"))
    losses, k, marks, cpu_marks, opt_cpu_marks, opt_cpu_s, first_step_s = [], 0, [], [], [], 0.0, None
    for step in range(1, s["max_steps"] + 1):
        step_loss = torch.zeros((), device=device)
        for _ in range(s["accum"]):
            with autocast:
                loss = forward(batches[k % count])
            (loss / s["accum"]).backward()
            step_loss += loss.detach() / s["accum"]
            k += 1
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        cpu = time.process_time()
        optimizer.step()
        opt_cpu_s += time.process_time() - cpu
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(step_loss)
        if step == 1:
            _sync(torch, device)
            first_step_s = time.perf_counter() - WORKER_STARTED
        if _is_mark(step, s):
            _sync(torch, device)
            marks.append(time.perf_counter())
            cpu_marks.append(time.process_time())
            opt_cpu_marks.append(opt_cpu_s)
    final = torch.stack(losses[-s["log_every"]:]).mean().item()
    ns = getattr(optimizer, "newton_schulz_flops", None)
    return {"clock": "monotonic", "marks": marks, "cpu_marks": cpu_marks, "opt_cpu_marks": opt_cpu_marks,
            "ns_flops": ns() if ns else None, "waits": [0.0] * (len(marks) - 1),
            "peak_mem_gb": _peak_mem_gb(torch, device), "final_loss": final, "first_step_s": first_step_s}


def worker_trainer(s: dict, naive: bool = False) -> dict:
    """transformers.Trainer with its documented fast settings (or, `naive`, its defaults), timed by a
    callback after warm-up."""
    import torch
    from torch.utils.data import Dataset
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from configs import get_model_spec
    from utils.model import build_model
    from utils.model.hf import to_transformers

    cfg = training_config(s)
    device = torch.device(s["device"])
    cuda = device.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    sequences = train_split(s["data_dir"], s)

    class CausalLMDataset(Dataset):
        def __len__(self):
            return len(sequences)

        def __getitem__(self, i):
            ids = sequences[i]
            return {"input_ids": ids, "labels": ids}

    timing = {"marks": [], "cpu_marks": [], "waits": [], "loss": None, "first_step_s": None}

    class StepTimer(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                _sync(torch, device)
                timing["first_step_s"] = time.perf_counter() - WORKER_STARTED
            if _is_mark(state.global_step, s):
                _sync(torch, device)
                timing["marks"].append(time.perf_counter())
                timing["cpu_marks"].append(time.process_time())
                if state.global_step < s["max_steps"]:
                    timing["waits"].append(0.0)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                timing["loss"] = logs["loss"]

    class TimedIterator:
        """Times the Trainer's own `next(epoch_iterator)` calls: its wait on data."""

        def __init__(self, it, trainer):
            self.it, self.trainer = it, trainer

        def __iter__(self):
            return self

        def __next__(self):
            t = time.perf_counter()
            try:
                return next(self.it)
            finally:
                if timing["waits"] and self.trainer.state.global_step < s["max_steps"]:
                    timing["waits"][-1] += time.perf_counter() - t

    class TimedTrainer(Trainer):
        def get_batch_samples(self, epoch_iterator, num_batches, device):
            return super().get_batch_samples(TimedIterator(epoch_iterator, self), num_batches, device)

    workers = s["workers"]
    common = dict(
        output_dir=str(Path(s["work"])), max_steps=s["max_steps"],
        per_device_train_batch_size=s["micro_batch"], gradient_accumulation_steps=s["accum"],
        learning_rate=cfg.learning_rate, weight_decay=cfg.weight_decay, adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2, adam_epsilon=cfg.adam_eps, max_grad_norm=cfg.max_grad_norm,
        lr_scheduler_type="cosine", warmup_steps=cfg.warmup_steps, seed=cfg.seed, use_cpu=not cuda,
        logging_strategy="steps", logging_steps=s["log_every"], save_strategy="no", eval_strategy="no",
        report_to="none", disable_tqdm=True, dataloader_drop_last=True,
    )
    if naive:  # everything else at the Trainer's defaults: fp32, eager, its default optimizer and loader
        args = TrainingArguments(**common)
    else:
        args = TrainingArguments(
            **common, bf16=s["precision"] in ("bf16", "fp8"), torch_compile=s["compile"],
            # Fused AdamW on CUDA (the documented fast choice); on the CPU the same foreach AdamW as the engine.
            # The Trainer has no bf16-moment AdamW: under the `conservative` profile it keeps fp32 moments.
            optim="adamw_torch_fused" if cuda else "adamw_torch",
            # the Trainer knows whole-layer checkpointing only: any policy but none is `full` there
            gradient_checkpointing=cfg.activation_checkpointing != "none",
            gradient_checkpointing_kwargs={"use_reentrant": False} if cfg.activation_checkpointing != "none" else None,
            dataloader_num_workers=workers, dataloader_prefetch_factor=s["prefetch"] if workers else None,
            dataloader_pin_memory=cuda,
            # The NaN filter only changes the logged loss and costs a host sync per micro-batch.
            logging_nan_inf_filter=False,
        )
    spec = get_model_spec(s["model"])
    # transformers' own class, SDPA attention, holding the same initial weights as the engine's model
    model = to_transformers(build_model(spec, seed=cfg.seed).state_dict(), spec)
    trainer = TimedTrainer(model=model, args=args, train_dataset=CausalLMDataset(), callbacks=[StepTimer()])
    trainer.train()
    if len(timing["marks"]) != s["steps"] // s["log_every"] + 1:
        raise RuntimeError(f"the Trainer stopped early: {len(timing['marks'])} timing marks")
    return {"clock": "monotonic", "marks": timing["marks"], "cpu_marks": timing["cpu_marks"], "waits": timing["waits"],
            "peak_mem_gb": _peak_mem_gb(torch, device), "final_loss": timing["loss"],
            "first_step_s": timing["first_step_s"]}


def worker_main(args) -> int:
    s = json.loads(Path(args._spec).read_text())
    Path(s["work"]).mkdir(parents=True, exist_ok=True)
    if args._worker == "bare":
        result = worker_bare(s)
    else:
        result = worker_trainer(s, naive=args._worker == "naive")
    Path(args._result).write_text(json.dumps(result))
    return 0


# ------------------------------------------------------------------------------------------ report


def render(summary: dict) -> str:

    def fmt(v, f):
        return "null" if v is None else format(v, f)

    lines = ["| contender | tokens/s | step ms | MFU | peak mem GiB | data wait % | CPU ms/step | optimizer CPU % | "
             "Newton-Schulz GFLOP/step/rank | first step s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, m in summary["median"].items():
        mfu = None if m["mfu"] is None else f"{100 * m['mfu']:.1f}%"
        lines.append(f"| {name} | {fmt(m['tokens_per_sec'], ',.0f')} | {fmt(m['step_ms'], '.2f')} | "
                     f"{mfu or 'null'} | {fmt(m['peak_mem_gb'], '.2f')} | {fmt(100 * m['data_wait_frac'], '.1f')} | "
                     f"{fmt(m['cpu_step_ms'], '.2f')} | {fmt(m['opt_cpu_frac'] and 100 * m['opt_cpu_frac'], '.1f')} | "
                     f"{fmt(m['ns_gflop'], '.4g')} | {fmt(m['first_step_s'], '.1f')} |")
    lines.append("")
    for name, r in summary["ratios"].items():
        rounds = ", ".join(f"{x:.3f}" for x in r["rounds"])
        lines.append(f"{name}: {r['paired']:.3f} tokens/s (median of the per-round ratios: {rounds}; "
                     f"ratio of the medians: {r['of_medians']:.3f})")
    meta, s = summary["meta"], summary["settings"]
    lines += [
        "",
        f"model {s['model']} ({meta['params_m']:.2f}M params), micro-batch {s['micro_batch']} x accum {s['accum']} x "
        f"seq {s['seq_len']} = {s['micro_batch'] * s['accum'] * s['seq_len']:,} tokens/step, "
        f"precision {s['precision']}, optimizer {s['optimizer']}, "
        f"model_impl {s['impl']}, compile {'on' if s['compile'] else 'off'}, workers {s['workers']}, "
        f"threads {s['threads'] or 'default'}, "
        f"memory profile {s['profile']} -> {s['profile_used']} (activation checkpointing "
        f"{s['activation_checkpointing']}, AdamW moments {s['optimizer_state_dtype']})",
        f"timing: {s['warmup']} warm-up + {s['steps']} timed steps in windows of {s['log_every']}, median window "
        f"per run, median of {s['repeats']} round(s), schedule {s['schedule']}"
        + (f" ({s['slice_s']:g} s slices)" if s["schedule"] == "slices" else ""),
        *([f"candidate: {meta['candidate_repo']}/train.py"] if meta.get("candidate_repo") else []),
        f"device: {meta['device']}",
        f"torch {meta['torch']}, transformers {meta['transformers']}, accelerate {meta['accelerate']}, "
        f"python {meta['python']}",
        f"date: {meta['date']}",
        f"command: {meta['command']}",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    settle_wait()  # how CPU threads wait (the contenders in this process; train.py does its own)
    args = parse_args(argv)
    if args._worker:
        return worker_main(args)
    import torch

    from configs import ConfigError, get_model_spec
    from utils.model import build_model
    from utils.observe.metrics import mfu, peak_flops

    cuda = torch.cuda.is_available()
    s = resolve_settings(args, cuda)
    default = ("engine", "trainer", "naive", "bare") if cuda else ("engine", "trainer", "bare")
    only = [c.strip() for c in (args.only or ",".join(default)).split(",") if c.strip()]
    if set(only) - set(CONTENDERS) or not only or len(set(only)) != len(only):
        raise SystemExit(f"error: --only takes a subset of {','.join(CONTENDERS)} (got {args.only!r})")
    candidate = Path(args.candidate_repo).resolve() if args.candidate_repo else None
    if candidate is not None:
        if not (candidate / "train.py").is_file():
            raise SystemExit(f"error: --candidate-repo {candidate} holds no train.py")
        only.append("candidate")
    try:
        apply_engine_profile(s, torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else None)
    except ConfigError as exc:
        raise SystemExit(f"error: {exc}") from None
    spec = get_model_spec(s["model"])
    with torch.device("meta"):
        probe = build_model(spec, seed=0, impl=s["impl"])
    n_params, fpt = probe.parameter_counts()[0], probe.flops_per_token(s["seq_len"])
    peak = peak_flops(torch.device("cuda", 0)) if cuda else None
    device_name = (f"cuda: {torch.cuda.get_device_name(0)}" if cuda
                   else f"cpu: {os.cpu_count()} cores, {s['threads'] or torch.get_num_threads()} thread(s) per process")

    runs: dict[str, list[dict]] = {c: [] for c in only}
    with tempfile.TemporaryDirectory(prefix="bench_train_") as tmp:
        work = Path(tmp)
        data_dir = Path(args.data_dir).resolve() if args.data_dir else work / "data"
        t0 = time.perf_counter()
        ensure_data(data_dir, s, spec.vocab_size)
        train_split(str(data_dir), s)  # validates once and fills the index cache every contender reuses
        print(f"data: {data_dir} ready in {time.perf_counter() - t0:.1f} s; {','.join(only)} x {s['repeats']} "
              f"round(s), schedule {s['schedule']}, on {device_name}", flush=True)
        for r in range(s["repeats"]):
            round_dir = work / f"round{r}"
            round_dir.mkdir()
            order = only[r % len(only):] + only[:r % len(only)]
            jobs = [engine_job(name, candidate if name == "candidate" else REPO_ROOT, s, data_dir, round_dir)
                    if name in ENGINES else worker_job(name, s, data_dir, round_dir)
                    for name in order]
            t = time.perf_counter()
            if s["schedule"] == "slices":
                run_jobs(jobs, gated=True, slice_s=s["slice_s"], timeout=args.timeout)
            else:
                for job in jobs:
                    run_jobs([job], gated=False, slice_s=s["slice_s"], timeout=args.timeout)
            for job in jobs:
                raw = job.read_result()
                fig = raw | window_figures(raw, job.running, s) | {"round": r}
                fig["step_ms"], fig["cpu_step_ms"] = 1e3 * fig["step_s"], 1e3 * fig["cpu_step_s"]
                fig["mfu"] = mfu(fig["tokens_per_sec"], fpt, peak, 1)
                runs[job.name].append(fig)
            print(f"round {r + 1}/{s['repeats']} ({time.perf_counter() - t:.0f} s): " + ", ".join(
                f"{name} {runs[name][-1]['tokens_per_sec']:,.0f} tok/s" for name in only), flush=True)

    def median_of(name: str, key: str):
        values = [run[key] for run in runs[name] if run.get(key) is not None]
        return statistics.median(values) if values else None

    keys = ("tokens_per_sec", "step_ms", "mfu", "peak_mem_gb", "data_wait_frac", "cpu_tokens_per_sec", "cpu_step_ms",
            "opt_cpu_frac", "ns_gflop", "first_step_s")
    median = {name: {k: median_of(name, k) for k in keys} for name in only}
    ratios = {}
    for a, b in (("engine", "bare"), ("engine", "trainer"), ("engine", "naive"), ("fsdp", "engine"),
                 ("document", "engine"), ("candidate", "engine"), ("candidate", "bare")):
        if a in only and b in only:
            # A round's contenders met the same machine, so its own ratio is the paired, steadier figure.
            per_round = [x["tokens_per_sec"] / y["tokens_per_sec"] for x, y in zip(runs[a], runs[b])]
            cpu_rounds = [x["cpu_tokens_per_sec"] / y["cpu_tokens_per_sec"] for x, y in zip(runs[a], runs[b])]
            ratios[f"{a}/{b}"] = {
                "paired": statistics.median(per_round), "rounds": per_round,
                "of_medians": median[a]["tokens_per_sec"] / median[b]["tokens_per_sec"],
                "cpu_paired": statistics.median(cpu_rounds), "cpu_rounds": cpu_rounds,
            }
    summary = {
        "settings": s, "median": median, "ratios": ratios, "runs": runs,
        "meta": {"device": device_name, "params_m": n_params / 1e6, "flops_per_token": fpt, "peak_flops": peak,
                 "torch": torch.__version__, "transformers": version("transformers"),
                 "accelerate": version("accelerate"), "python": sys.version.split()[0],
                 "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                 "command": shlex.join(["python", *sys.argv]),
                 "candidate_repo": str(candidate) if candidate else None},
    }
    print()
    print(render(summary))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
