#!/usr/bin/env python
"""The LM-head loss in an eval pass (no_grad): the loss-only path against the training path, which also
computes both gradients (two extra vocab-sized matmuls per chunk), side by side in interleaved rounds.

    python benchmarks/bench_eval_loss.py [--rows 2048] [--hidden 2048] [--vocab 50304] [--rounds 5]

Defaults are the 1.2B model's head (2048 x 50304) on 2048 tokens: one eval micro-batch's worth on a CPU.
"""
from __future__ import annotations

import argparse
import statistics
import time

from utils.runtime.threads import settle_wait

settle_wait()  # how CPU threads wait: before torch (and its OpenMP runtime) is imported

import torch

from utils.model.layers import ChunkedLMHeadLoss, chunked_loss_only


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.rows, args.hidden, generator=g)
    weight = torch.randn(args.vocab, args.hidden, generator=g) * 0.02
    targets = torch.randint(0, args.vocab, (args.rows,), generator=g)
    paths = {"with gradients": lambda: ChunkedLMHeadLoss.apply(hidden, weight, targets, torch.float32)[0],
             "loss only": lambda: chunked_loss_only(hidden, weight, targets, torch.float32)}
    times = {k: [] for k in paths}
    with torch.no_grad():
        values = {k: fn().item() for k, fn in paths.items()}  # warm-up, and the same value from both
        for _ in range(args.rounds):
            for name, fn in paths.items():
                started = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - started)
    a, b = (statistics.median(times[k]) for k in paths)
    print(f"head {args.hidden} x {args.vocab}, {args.rows} tokens, {args.rounds} interleaved rounds, "
          f"{torch.get_num_threads()} threads: with gradients {a * 1e3:.0f} ms, loss only {b * 1e3:.0f} ms "
          f"(median): {a / b:.2f}x faster; losses {values['with gradients']:.6f} / {values['loss only']:.6f}")


if __name__ == "__main__":
    main()
