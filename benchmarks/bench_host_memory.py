#!/usr/bin/env python
"""Minor page faults and seconds per training step of the `cpu` preset, with GPT-2's vocabulary against the
demo's: the real train.py on data prepared with a GPT-2-shaped tokenizer of 50,257 ids (50,304 embedding
rows) and with one of 2,048 ids (the demo's), built here (no download).

    python -m benchmarks.bench_host_memory                        # this checkout, 30 steps each (-m: from the
                                                                  # repository root, which holds tests/)
    python -m benchmarks.bench_host_memory --repo /tmp/before     # another checkout's train.py (git archive)

Each dataset trains twice, for --warmup and for --warmup + --steps steps; the per-step figures are the
differences (so start-up, the last checkpoint and the export cancel out): minor page faults
(getrusage of the finished child and its workers), wall seconds, user and system CPU seconds. A step that
page-faults its vocabulary-sized buffers in again shows as system time (utils/runtime/host_memory.py).
"""
from __future__ import annotations

import argparse
import os
import platform
import random
import resource
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

from tests.trainkit import gpt2_style_tokenizer
from utils.data.prepare import PrepareOptions, prepare

REPO_ROOT = Path(__file__).resolve().parent.parent


BIG = 10**9  # eval_interval / save_steps / sample_every that never fire inside the run


def corpus(path: Path, documents: int = 3000, seed: int = 0) -> Path:
    rng = random.Random(seed)
    words = ["".join(rng.choice("etaoinshrdlucmfwyp") for _ in range(rng.randint(2, 9))) for _ in range(5000)]
    path.write_text("".join(" ".join(rng.choices(words, k=rng.randint(40, 200))) + "\n" for _ in range(documents)))
    return path


def train(repo: Path, data: Path, out: Path, steps: int) -> dict:
    """One run of the cpu preset; its rusage (faults, CPU) and wall time."""
    cmd = [sys.executable, str(repo / "train.py"), "--config", "cpu", "--data-dir", str(data), "--output-dir",
           str(out), "--max-steps", str(steps), "--set", f"eval_interval={BIG}", "--set", f"save_steps={BIG}",
           "--set", "sample_every=0"]
    before, started = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    proc = subprocess.run(cmd, cwd=repo, capture_output=True, text=True)
    wall, after = time.perf_counter() - started, resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return {"faults": after.ru_minflt - before.ru_minflt, "wall": wall,
            "user": after.ru_utime - before.ru_utime, "sys": after.ru_stime - before.ru_stime}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repo", type=Path, default=REPO_ROOT, help="the checkout whose train.py runs")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--vocab", type=int, nargs="+", default=[50257, 2048], help="tokenizer sizes")
    args = p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="bench-host-memory-"))
    text = corpus(tmp / "corpus.txt")
    print("| data vocabulary | minor faults/step | s/step | user s/step | sys s/step | sys share |\n"
          "|---:|---:|---:|---:|---:|---:|")
    for vocab in args.vocab:
        data = tmp / f"data-{vocab}"
        prepare([str(text)], str(gpt2_style_tokenizer(tmp / f"tok-{vocab}.json", vocab)), data,
                PrepareOptions(shard_tokens=1 << 16))
        short = train(args.repo.resolve(), data, tmp / f"short-{vocab}", args.warmup)
        long = train(args.repo.resolve(), data, tmp / f"long-{vocab}", args.warmup + args.steps)
        per = {k: (long[k] - short[k]) / args.steps for k in short}
        cpu = per["user"] + per["sys"]
        print(f"| {vocab:,} | {per['faults']:,.0f} | {per['wall']:.2f} | {per['user']:.2f} | {per['sys']:.2f} | "
              f"{per['sys'] / cpu if cpu > 0 else 0:.0%} |", flush=True)
    print(f"\n{args.repo.resolve()}, {args.steps} steps after {args.warmup}; {platform.node()}, "
          f"{os.cpu_count()} cores, {platform.platform()}, Python {platform.python_version()}, {date.today()}\n"
          f"command: python benchmarks/bench_host_memory.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
