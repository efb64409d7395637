#!/usr/bin/env python
"""How long a restart on a new machine takes to its first step, with and without the compiled code its
checkpoint carries (utils/checkpoint/compile_cache.py).

Runs the real train.py, each run in its own process with its own Inductor cache folder (TORCHINDUCTOR_CACHE_DIR),
`fresh` and `resume-carried` `--rounds` times, one after the other (so that a load others put on the machine moves
each pair alike; the ratio is the median of the rounds'), the others once:

- `fresh`: a fresh compiled run (empty cache), `--steps` steps, a checkpoint every `--save-every`;
- `resume-carried`: `--resume` of its first checkpoint into another output folder with an empty cache: a new
  machine that loads the checkpoint's compiled code;
- `resume-again`: `--resume` of `resume-carried`'s checkpoint `--save-every` steps before the end, on another
  empty cache: the next preemption, whose checkpoint a resumed run wrote;
- `resume-compiles`: `resume-carried` with `compile_cache=off`: a new machine that compiles again (the engine
  before);
- `resume-warm`: `resume-carried` on the first run's cache folder: the machine the run was on (torch's own cache).

It prints each run's time to its first step, split into the phases of the first metrics row (`start/<phase>_s`),
the ratios of `resume-carried` to `fresh`, and the largest relative difference between the resumed runs' losses and
the uninterrupted runs' at the same steps. A warm-up run (compile off, one step) first builds the demo corpus
and warms the page cache for all of them. The signing secret is a random one of this benchmark.

    python benchmarks/bench_restart.py                                  # CPU: the demo model, ~10 min
    python benchmarks/bench_restart.py --json benchmarks/results/DATE-cpu-restart.json
    python benchmarks/bench_restart.py --config test --steps 9 --save-every 3 --rounds 1   # a GPU: the 1.2B model
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def train(args, out: Path, cache: Path, env: dict, *sets: str, resume: Path | None = None,
          steps: int | None = None) -> tuple[float, list[dict], str]:
    cmd = [sys.executable, str(REPO_ROOT / "train.py"), "--config", args.config, "--output-dir", str(out),
           "--data-dir", str(args.data_dir), "--max-steps", str(steps or args.steps), "--set", "logging_steps=1",
           "--set", f"save_steps={args.save_every}", "--set", "save_total_limit=1000", "--set", "eval_interval=1000000",
           "--set", "sample_every=0"]
    for s in ("compile_model=true", *args.set, *sets):
        cmd += ["--set", s]
    if resume is not None:
        cmd += ["--resume", str(resume)]
    started = time.perf_counter()
    proc = subprocess.run(cmd, env=env | {"TORCHINDUCTOR_CACHE_DIR": str(cache)}, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        sys.exit(f"train.py failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    said = next((line for line in proc.stdout.splitlines() if line.startswith("compile cache: ")), "")
    return wall, [r for r in rows if "loss" in r], said


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="demo")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--save-every", type=int, default=5, help="save_steps: the first restart resumes the first")
    p.add_argument("--rounds", type=int, default=3, help="fresh and resume-carried, one after the other, this often")
    p.add_argument("--data-dir", type=Path, help="default: the demo corpus, built in a temporary folder")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more train.py settings")
    p.add_argument("--json", type=Path, help="write the figures here too")
    args = p.parse_args()
    import torch

    from utils.observe.metrics import STARTUP_PHASES

    tmp = Path(tempfile.mkdtemp(prefix="bench-restart-"))
    args.data_dir = args.data_dir or tmp / "data"
    env = dict(os.environ, NEOX_COMPILE_CACHE_KEY=secrets.token_hex(16))
    load_before = os.getloadavg()
    train(args, tmp / "warmup", tmp / "inductor-warmup", env, "compile_model=false", steps=1)
    runs: list[tuple[str, float, dict, str]] = []  # (name, process seconds, first metrics row, compile cache line)
    losses: dict[str, dict[int, float]] = {}

    def measure(name: str, cache: str, *sets: str, resume: tuple[str, int] | None = None) -> None:
        checkpoint = None if resume is None else next(
            (tmp / resume[0] / "checkpoints").glob(f"checkpoint-*-step{resume[1]}-*"))
        wall, rows, said = train(args, tmp / name, tmp / cache, env, *sets, resume=checkpoint)
        runs.append((name, wall, rows[0], said))
        losses[name] = {r["step"]: r["loss"] for r in rows}

    first, again = args.save_every, args.steps - args.save_every
    for k in range(1, args.rounds + 1):  # each pair close in time: the machine's load moves under both alike
        measure(f"fresh-{k}", f"inductor-fresh-{k}")
        measure(f"resume-carried-{k}", f"inductor-empty-{k}", resume=(f"fresh-{k}", first))
    measure("resume-again", "inductor-empty-again", resume=("resume-carried-1", again))
    measure("resume-compiles", "inductor-empty-off", "compile_cache=off", resume=("fresh-1", first))
    measure("resume-warm", "inductor-fresh-1", resume=("fresh-1", first))
    load_after = os.getloadavg()

    phases = [f"start/{phase}_s" for phase in STARTUP_PHASES if any(f"start/{phase}_s" in row for *_, row, _ in runs)]
    threads = env.get("OMP_NUM_THREADS", "unset: train.py sets cores / processes")
    loads = " before, ".join(" ".join(f"{x:.2f}" for x in load) for load in (load_before, load_after))
    print(f"# Time to the first step: a fresh compiled run and its restarts on a new machine ({args.config})")
    print(f"device: cpu {platform.processor() or platform.machine()} ({os.cpu_count()} cores, OMP_NUM_THREADS "
          f"{threads}), torch {torch.__version__}, date {date.today()}; load average (1, 5, 15 min) {loads} after")
    print(f"command: python benchmarks/{Path(__file__).name} {' '.join(sys.argv[1:])}\n")
    print("| run | first step s | " + " | ".join(k[len('start/'):-2] for k in phases) + " | process s |")
    print("|---|---:|" + "---:|" * len(phases) + "---:|")
    for name, wall, row, _ in runs:
        print(f"| {name} | {row['first_step_s']:.1f} | " + " | ".join(
            f"{row[k]:.1f}" if k in row else "" for k in phases) + f" | {wall:.1f} |")
    first_step = {name: row["first_step_s"] for name, _, row, _ in runs}
    ratios = [first_step[f"resume-carried-{k}"] / first_step[f"fresh-{k}"] for k in range(1, args.rounds + 1)]
    ratio = statistics.median(ratios)
    again_ratio = first_step["resume-again"] / statistics.median(first_step[f"fresh-{k}"]
                                                                   for k in range(1, args.rounds + 1))
    worst = max(abs(loss - losses[f"fresh-{k}"][step]) / abs(losses[f"fresh-{k}"][step])
                for k in range(1, args.rounds + 1) for name in (f"resume-carried-{k}",)
                for step, loss in losses[name].items())
    worst = max([worst] + [abs(loss - losses["fresh-1"][step]) / abs(losses["fresh-1"][step])
                           for name in ("resume-again", "resume-compiles", "resume-warm")
                           for step, loss in losses[name].items()])
    print(f"\nresume-carried / fresh, round by round: {', '.join(f'{r:.2f}' for r in ratios)}; median {ratio:.2f}; "
          f"resume-again / fresh's median: {again_ratio:.2f}")
    print(f"resumed losses against the uninterrupted runs' at the same steps: largest relative difference "
          f"{worst:.2e}")
    for name, _, _, said in runs:
        if name in ("resume-carried-1", "resume-again"):
            print(f"{name} said: {said}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "benchmark": "bench_restart", "date": str(date.today()), "command": " ".join(sys.argv),
            "device": f"cpu {platform.processor() or platform.machine()}", "cores": os.cpu_count(),
            "omp_num_threads": env.get("OMP_NUM_THREADS"), "torch": torch.__version__,
            "load_average_before": load_before, "load_average_after": load_after, "config": args.config,
            "steps": args.steps, "save_every": args.save_every, "rounds": args.rounds, "settings": args.set,
            "runs": [{"name": name, "process_s": wall, "first_row": row, "compile_cache_line": said}
                     for name, wall, row, said in runs],
            "losses": losses, "carried_over_fresh_by_round": ratios, "carried_over_fresh_median": ratio,
            "again_over_fresh_median": again_ratio, "largest_relative_loss_difference": worst}, indent=2))
    return 0 if max(ratio, again_ratio) <= 0.6 and worst <= 1e-6 and math.isfinite(worst) else 1

if __name__ == "__main__":
    sys.exit(main())
