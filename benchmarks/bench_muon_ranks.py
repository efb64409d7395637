"""Muon across ranks: the CPU time a step costs a whole launch, this engine against an earlier one, side by side;
and (`--recipe`) the production preset's model training Muon + neox init under FSDP on 2 and 4 CPU ranks.

    python benchmarks/bench_muon_ranks.py          # 2 FSDP ranks, demo model, micro-batch 1 x 16 tokens (~10 min)
    python benchmarks/bench_muon_ranks.py --strategy ddp --ranks 4 --steps 100 --rounds 1
    python benchmarks/bench_muon_ranks.py --recipe --layers 2   # the 1.2B's width and matrices, 2 of its 24 layers

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

`--recipe`: `start_training.sh --config production --cpu --gpus N --strategy fsdp --mixed-precision no` with
`--set optimizer=muon --set init=neox`, micro-batch 1 x `--seq-len` tokens on 4 / N ranks (the same global
batch of 4 sequences), `--steps` steps (default 4, warm-up 2), for N in `--recipe-ranks` (default 2,4): each
run's losses, gradient norms, its line on each rank's Newton-Schulz share, CPU and wall time and rank 0's
peak RSS; the runs must agree to fp32 rounding. The whole 1.2B holds ~18 GB of fp32 state under FSDP and its
Newton-Schulz is 5.8e13 FLOPs a step (~400 CPU-seconds here); `--layers L` trains a copy of it with its first
L layers only (its width, heads, vocabulary and matrices: each layer's Newton-Schulz work is the 1.2B's).
Its ranks give freed host memory back to the OS (GIVE_BACK_FREED_MEMORY below), which changes no number.
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
    p.add_argument("--recipe", action="store_true", help="the production model's Muon + neox run instead (above)")
    p.add_argument("--layers", type=int, default=24, help="--recipe: the 1.2B's first LAYERS layers (default 24)")
    p.add_argument("--recipe-ranks", default="2,4", help="--recipe: FSDP ranks of each run (default 2,4)")
    args = p.parse_args(argv)
    if args.recipe:
        args.steps = args.steps if "--steps" in (argv or sys.argv) else 4
        args.ranks_list = [int(r) for r in args.recipe_ranks.split(",")]
        if not 1 <= args.layers <= 24 or any(r < 1 or 4 % r for r in args.ranks_list):
            p.error("--layers takes 1 to 24; --recipe-ranks divisors of the global batch, 4")
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


# Run in every rank ahead of the shim: a copy of gpt-neox-1.2b with its first BENCH_LAYERS layers, as a preset
SHALLOW = """
import dataclasses, os
from utils.model import families
presets, layers = families.presets, int(os.environ["BENCH_LAYERS"])
def with_shallow():
    out = presets()
    out[os.environ["BENCH_MODEL"]] = dataclasses.replace(out["gpt-neox-1.2b"], name=os.environ["BENCH_MODEL"],
                                                         num_hidden_layers=layers)
    return out
families.presets = with_shallow
"""
# Run in every rank of --recipe: glibc gives freed blocks back to the OS as it does by default. Training on the CPU
# keeps them (utils/runtime/host_memory.py: no page faults for a 50K vocabulary's buffers each step); here the
# kept fragments of start-up's whole-matrix transients doubled a rank's RSS (7.7 GiB against 3.5 for one layer).
GIVE_BACK_FREED_MEMORY = """
import utils.runtime.host_memory
utils.runtime.host_memory.keep_freed_host_memory = lambda: False
"""


def recipe(args) -> int:
    """The production model (or its first `--layers` layers) training Muon + neox under FSDP on CPU ranks."""
    from configs import get_model_spec

    spec = get_model_spec("gpt-neox-1.2b")
    model = "gpt-neox-1.2b" if args.layers == 24 else f"gpt-neox-1.2b-first-{args.layers}-layers"
    results, load = {}, [os.getloadavg()]
    with tempfile.TemporaryDirectory(prefix="bench_muon_recipe_") as tmp:
        work = Path(tmp)
        data = work / "data"
        data.mkdir()
        write_stream_shard(data / "train-000.npz", 8 * args.steps * 4 * args.seq_len, spec.vocab_size, seed=0)
        write_stream_shard(data / "val-999.npz", 8 * args.seq_len, spec.vocab_size, seed=999)
        shim = work / "shim.py"
        shim.write_text("import os, sys\nsys.argv.insert(1, os.environ['BENCH_TRAIN_PY'])\n"
                        + GIVE_BACK_FREED_MEMORY + (SHALLOW if args.layers < 24 else "") + ENGINE_SHIM)
        for ranks in args.ranks_list:
            out = work / f"fsdp{ranks}"
            sets = {"optimizer": "muon", "init": "neox", "model": model, "seq_len": args.seq_len,
                    "per_device_train_batch_size": 4 // ranks, "gradient_accumulation_steps": 1,
                    "max_steps": args.steps, "warmup_steps": 2, "logging_steps": 1, "eval_interval": BIG,
                    "save_steps": BIG, "compile_model": "false", "dataloader_num_workers": 0, "val_files": 1,
                    "eval_batches": 1, "profile": "off"}
            cmd = [str(REPO_ROOT / "start_training.sh"), "--config", "production", "--cpu", "--gpus", str(ranks),
                   "--strategy", "fsdp", "--mixed-precision", "no", "--", "--output-dir", str(out), "--data-dir",
                   str(data), "--no-background-upload"]
            for key, value in sets.items():
                cmd += ["--set", f"{key}={value}"]
            env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), TRAIN_SCRIPT=str(shim), OMP_NUM_THREADS="1",
                       BENCH_TRAIN_PY=str(REPO_ROOT / "train.py"), BENCH_LAYERS=str(args.layers), BENCH_MODEL=model,
                       CUDA_VISIBLE_DEVICES="", PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"])
            before, wall = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            wall, after = time.perf_counter() - wall, resource.getrusage(resource.RUSAGE_CHILDREN)
            load.append(os.getloadavg())
            if proc.returncode != 0:
                raise SystemExit(f"error: {ranks} ranks exited {proc.returncode}:\n{proc.stdout[-3000:]}\n"
                                 f"{proc.stderr[-3000:]}")
            rows = [r for r in map(json.loads, (out / "logs" / "metrics.jsonl").read_text().splitlines())
                    if "loss" in r]
            log = (out / "logs" / "training.log").read_text().splitlines()
            results[ranks] = {
                "losses": [r["loss"] for r in rows], "grad_norms": [r["grad_norm"] for r in rows],
                "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), "wall_s": wall,
                "rank0_peak_rss_gb": rows[-1].get("host_peak_rss_gb"), "ns_flops_per_rank": rows[-1]["bench_ns_flops"],
                "lines": [x.split("] ")[-1] for x in log
                          if any(key in x for key in ("Training ", "Newton-Schulz", "per-rank"))]}
            print(f"fsdp over {ranks} ranks: losses {', '.join(f'{x:.4f}' for x in results[ranks]['losses'])} "
                  f"({wall:.0f} s wall, {results[ranks]['cpu_s']:.0f} CPU-s)", flush=True)
    first = results[args.ranks_list[0]]["losses"]
    apart = max(abs(a - b) / abs(b) for r in results.values() for a, b in zip(r["losses"], first))
    print()
    for ranks, r in results.items():
        print(f"{ranks} FSDP ranks, micro-batch {4 // ranks} x {args.seq_len} tokens: losses "
              f"{', '.join(f'{x:.4f}' for x in r['losses'])}; grad norms "
              f"{', '.join(f'{x:.3g}' for x in r['grad_norms'])}; "
              f"{r['cpu_s']:.0f} CPU-s, {r['wall_s']:.0f} s wall, rank 0's peak RSS {r['rank0_peak_rss_gb']:.2f} GiB")
        for line in r["lines"]:
            print(f"    {line}")
    print(f"largest relative difference between the runs' losses: {apart:.2e}")
    print(f"model {model}, Muon + neox init, production preset, fp32 on CPU, OMP_NUM_THREADS=1; load average from "
          f"{', '.join(f'{x:.1f}' for x in load[0])} to {', '.join(f'{x:.1f}' for x in load[-1])}")
    print(f"command: {shlex.join(['python', *sys.argv])}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"settings": vars(args), "runs": results, "load": load,
                                                   "max_relative_difference": apart}, indent=2))
    return 0 if apart < 1e-5 and all(x == x for r in results.values() for x in r["losses"]) else 1


def every_matrix_flops(model: str) -> int:
    """Newton-Schulz FLOPs per step of all the model's Muon matrices: what each rank did before."""
    from configs import get_model_spec
    from utils.model.families import family_of
    from utils.training.optim.muon import newton_schulz_flops

    spec = get_model_spec(model)
    return spec.num_hidden_layers * sum(map(newton_schulz_flops, family_of(spec).muon_matrices(spec).values()))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.recipe:
        return recipe(args)
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
        lines.append(f"| {label} | {m['cpu_ms_per_step']:.1f} | {m['wall_s']:.1f} | "
                     f"{100 * m['rank0_opt_cpu_frac']:.1f} | {', '.join(f'{f / 1e9:.3f}' for f in ns)} | "
                     f"{m['final_loss']:.6f} |")
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
