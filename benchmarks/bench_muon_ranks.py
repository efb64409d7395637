"""Muon across ranks: the CPU time a step costs a whole launch, this engine against an earlier one, side by side.

    python benchmarks/bench_muon_ranks.py          # 2 FSDP ranks, demo model, micro-batch 1 x 16 tokens (~10 min)
    python benchmarks/bench_muon_ranks.py --strategy ddp --ranks 4 --steps 100 --rounds 1

Each round launches both engines one after the other (the order alternating between rounds) with the same
command: `start_training.sh --config demo --cpu --gpus RANKS --strategy S --set optimizer=muon` on the same
synthetic shards, micro-batch 1 x `--seq-len` tokens, `--steps` optimizer steps, no evaluation or checkpoint
on the way (the run's final evaluation and export come at the end, alike for both). The figure is the launch's
CPU time (user + system of every process it started: the launcher, accelerate, the ranks; the kernel's
account of the reaped children) divided by the steps, start-up and the final export included. CPU time is
what a step costs the machine, and moves less than wall time when others load it; the load average is printed.

The earlier engine (`--baseline`, default the commit before each rank orthogonalised only its share of
Muon's matrices: every rank gathered every matrix and ran Newton-Schulz on all of them) is extracted with
`git archive`. Both train the same numbers: their final losses are printed (equal to fp32 rounding). Also
printed from rank 0's metrics rows (benchmarks/bench_train.py's shim on every rank): the optimizer step's
share of that rank's CPU time over the steps, and each rank's Newton-Schulz GFLOP per step.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from bench_train import ENGINE_SHIM, write_stream_shard

REPO_ROOT = Path(__file__).resolve().parent.parent
BEFORE = "40dd9a8"  # the engine before distributed Muon (issue 52)
BIG = 10**9  # eval_interval / save_steps that never fire


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", default=BEFORE, help=f"the earlier engine's commit (default {BEFORE})")
    p.add_argument("--strategy", choices=("fsdp", "ddp"), default="fsdp")
    p.add_argument("--ranks", type=int, default=2, help="CPU processes per launch (default 2)")
    p.add_argument("--model", default="demo", help="a model preset (default demo)")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per rank per step (default 1)")
    p.add_argument("--seq-len", type=int, default=16, help="tokens per sequence (default 16)")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps per launch (default 300)")
    p.add_argument("--rounds", type=int, default=3, help="launches of each engine (default 3)")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per rank (default 1)")
    p.add_argument("--json", dest="json_out", help="also write every figure to this JSON file")
    args = p.parse_args(argv)
    if min(args.ranks, args.micro_batch, args.seq_len, args.steps, args.rounds, args.threads) < 1:
        p.error("--ranks, --micro-batch, --seq-len, --steps, --rounds and --threads must be >= 1")
    return args


def extract(commit: str, dest: Path) -> Path:
    archive = subprocess.run(["git", "-C", str(REPO_ROOT), "archive", commit], capture_output=True)
    if archive.returncode != 0:
        raise SystemExit(f"error: --baseline {commit}: git archive failed: {archive.stderr.decode().strip()}")
    dest.mkdir(parents=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return dest


def write_data(data: Path, args, vocab: int) -> None:
    tokens = int(1.25 * args.steps * args.ranks * args.micro_batch * args.seq_len) + 4 * args.seq_len
    for i in range(2):
        write_stream_shard(data / f"train-{i:03d}.npz", tokens // 2 + args.seq_len, vocab, seed=i)
    write_stream_shard(data / "val-999.npz", 64 * args.seq_len, vocab, seed=999)


def launch(engine: Path, out: Path, data: Path, shim: Path, args) -> dict:
    """One launch of `engine`: its CPU and wall seconds, and what its metrics rows say."""
    sets = {"model": args.model, "optimizer": "muon", "per_device_train_batch_size": args.micro_batch,
            "gradient_accumulation_steps": 1, "seq_len": args.seq_len, "max_steps": args.steps,
            "logging_steps": max(1, args.steps // 10), "eval_interval": BIG, "save_steps": BIG, "sample_every": 0,
            "dataloader_num_workers": 0, "val_files": 1, "eval_batches": 1, "mixed_precision": "no"}
    cmd = [str(engine / "start_training.sh"), "--config", "demo", "--cpu", "--gpus", str(args.ranks),
           "--strategy", args.strategy, "--", "--output-dir", str(out), "--data-dir", str(data),
           "--no-background-upload"]
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    env = dict(os.environ, PYTHONPATH=str(engine), TRAIN_SCRIPT=str(shim), BENCH_TRAIN_PY=str(engine / "train.py"),
               OMP_NUM_THREADS=str(args.threads), CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1",
               PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))
    before, wall = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=engine, capture_output=True, text=True)
    wall, after = time.perf_counter() - wall, resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"error: {engine} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    lines = (out / "logs" / "metrics.jsonl").read_text().splitlines()
    rows = sorted((r for r in map(json.loads, filter(str.strip, lines)) if "loss" in r), key=lambda r: r["step"])
    first, last = rows[0], rows[-1]
    if last["step"] != args.steps:
        raise SystemExit(f"error: {engine} logged up to step {last['step']}, not {args.steps}")
    return {"cpu_s": cpu, "wall_s": wall, "cpu_ms_per_step": 1e3 * cpu / args.steps, "final_loss": last["loss"],
            "rank0_opt_cpu_frac": (last["bench_opt_cpu_s"] - first["bench_opt_cpu_s"])
            / (last["bench_cpu_s"] - first["bench_cpu_s"]),
            "ns_flops_per_rank": last.get("bench_ns_flops")}


def every_matrix_flops(model: str) -> int:
    """Newton-Schulz FLOPs per step of all the model's Muon matrices: what each rank did before."""
    from configs import get_model_spec
    from utils.model.families import family_of
    from utils.training.optim.muon import newton_schulz_flops

    spec = get_model_spec(model)
    return spec.num_hidden_layers * sum(map(newton_schulz_flops, family_of(spec).muon_matrices(spec).values()))


def main(argv=None) -> int:
    args = parse_args(argv)
    from configs import get_model_spec

    vocab = get_model_spec(args.model).vocab_size
    load = [os.getloadavg()]
    runs: dict[str, list[dict]] = {"before": [], "now": []}
    with tempfile.TemporaryDirectory(prefix="bench_muon_") as tmp:
        work = Path(tmp)
        engines = {"before": extract(args.baseline, work / "before"), "now": REPO_ROOT}
        data = work / "data"
        data.mkdir()
        write_data(data, args, vocab)
        shim = work / "shim.py"
        shim.write_text("import os, sys\nsys.argv.insert(1, os.environ['BENCH_TRAIN_PY'])\n" + ENGINE_SHIM)
        for r in range(args.rounds):
            for name in (("before", "now") if r % 2 == 0 else ("now", "before")):
                runs[name].append(launch(engines[name], work / f"{name}-{r}", data, shim, args))
                load.append(os.getloadavg())
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(
                f"{n} {runs[n][-1]['cpu_ms_per_step']:.1f} CPU-ms/step ({runs[n][-1]['wall_s']:.0f} s wall)"
                for n in runs), flush=True)
    for run in runs["before"]:  # every rank orthogonalised every matrix
        run["ns_flops_per_rank"] = run["ns_flops_per_rank"] or [every_matrix_flops(args.model)] * args.ranks
    ratios = [b["cpu_ms_per_step"] / n["cpu_ms_per_step"] for b, n in zip(runs["before"], runs["now"])]
    median = {name: {key: statistics.median(run[key] for run in rs) for key in
                     ("cpu_ms_per_step", "wall_s", "rank0_opt_cpu_frac", "final_loss")} for name, rs in runs.items()}
    meta = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "cpus": os.cpu_count(),
            "load_avg_1_5_15": load, "command": shlex.join(["python", *sys.argv]),
            "baseline": args.baseline, "head": subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short",
                                                              "HEAD"], capture_output=True, text=True).stdout.strip()}
    lines = ["", "| engine | CPU ms/step (whole launch) | wall s/launch | rank 0: optimizer step % of its CPU | "
             "Newton-Schulz GFLOP/step, each rank | final loss |", "|---|---:|---:|---:|---|---:|"]
    for name, label in (("before", f"before ({args.baseline})"), ("now", f"now ({meta['head']})")):
        m, ns = median[name], runs[name][0]["ns_flops_per_rank"]
        lines.append(f"| {label} | {m['cpu_ms_per_step']:.1f} | {m['wall_s']:.1f} | {100 * m['rank0_opt_cpu_frac']:.1f} "
                     f"| {', '.join(f'{f / 1e9:.3f}' for f in ns)} | {m['final_loss']:.6f} |")
    lines += ["", f"before/now CPU time per step: {statistics.median(ratios):.3f} (median of the rounds: "
                  f"{', '.join(f'{x:.3f}' for x in ratios)})",
              f"{args.strategy} over {args.ranks} CPU ranks, model {args.model}, micro-batch {args.micro_batch} x "
              f"{args.seq_len} tokens, {args.steps} steps a launch, {args.rounds} round(s), OMP_NUM_THREADS="
              f"{args.threads}; {meta['cpus']} CPUs, load average (1, 5, 15 min) from "
              f"{', '.join(f'{x:.1f}' for x in load[0])} to {', '.join(f'{x:.1f}' for x in load[-1])}",
              f"date: {meta['date']}", f"command: {meta['command']}"]
    print("\n".join(lines))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"settings": vars(args), "median": median, "ratios": ratios,
                                                   "runs": runs, "meta": meta}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
