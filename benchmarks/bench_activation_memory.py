#!/usr/bin/env python
"""Activation memory and time of each activation-checkpointing policy, measured on any device.

    python benchmarks/bench_activation_memory.py                       # CPU: a 4-layer 256-wide model, seq 256
    python benchmarks/bench_activation_memory.py --model gpt-neox-1.2b --seq-len 2048 --micro-batch 1   # GPU

For each policy (none, full, every_k, selective) it builds the native model with the policy applied,
times forward + backward (median of --repeats, after one warm-up), and prints the bytes the forward left
alive for the backward (`saved_activation_bytes`: every tensor created during the forward that is still alive after
it, parameters and input excluded; measured in a pass of its own), their share of `none`'s, the step time
and its ratio to `none`'s, and the memory plan's estimate for the same shape (configs/profiles.py: bf16, and
it adds the one block being recomputed, which is transient and not in the measured figure). fp32 on the CPU, bf16
autocast on CUDA.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from configs.model_config import MODELS, get_model_spec
from configs.profiles import RunShape, memory_plan
from configs.training_config import ACTIVATION_CHECKPOINTING
from utils.model import build_model
from utils.model.activation_checkpointing import apply_activation_checkpointing, saved_activation_bytes


def measure(spec, policy: str, every: int, ids: torch.Tensor, device: torch.device, repeats: int) -> dict:
    model = build_model(spec, seed=0).to(device)
    apply_activation_checkpointing(model, policy, every)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up: first-call allocations and kernels
        started = time.perf_counter()
        with autocast:
            model(ids).backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
        model.zero_grad(set_to_none=True)
    with autocast:
        kept = saved_activation_bytes(model, ids)  # a pass of its own: the noting slows it down
    return {"policy": policy, "saved_bytes": kept, "step_s": statistics.median(times[1:])}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help=f"one of: {', '.join(MODELS)} (default: tiny, widened below)")
    p.add_argument("--layers", type=int, default=4, help="with --model tiny: layers (default 4)")
    p.add_argument("--hidden", type=int, default=256, help="with --model tiny: hidden size (default 256)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--every", type=int, default=2, help="every_k's k")
    p.add_argument("--repeats", type=int, default=3, help="timed forward+backward passes per policy (median)")
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    spec = get_model_spec(args.model)
    if args.model == "tiny":
        spec = replace(spec, num_hidden_layers=args.layers, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                       num_attention_heads=max(1, args.hidden // 32), max_position_embeddings=args.seq_len)
    ids = torch.randint(0, spec.vocab_size, (args.micro_batch, args.seq_len), device=device)
    rows = [measure(spec, policy, args.every, ids, device, args.repeats) for policy in ACTIVATION_CHECKPOINTING]
    base = next(r for r in rows if r["policy"] == "none")
    print(f"# activation memory by policy: {spec.name} ({spec.num_hidden_layers} layers, hidden {spec.hidden_size}), "
          f"micro-batch {args.micro_batch} x seq {args.seq_len}, {device.type}, "
          f"{'bf16 autocast' if device.type == 'cuda' else 'fp32'}")
    print(f"{'policy':<10} {'saved MB':>10} {'of none':>8} {'step ms':>9} {'time x':>7} {'plan MB (bf16)':>15}")
    for r in rows:
        plan = memory_plan(spec, RunShape(micro_batch=args.micro_batch, seq_len=args.seq_len, checkpointing=r["policy"],
                                          checkpointing_every=args.every)).activations
        r["plan_bytes"] = plan
        print(f"{r['policy']:<10} {r['saved_bytes'] / 1e6:>10.2f} {r['saved_bytes'] / base['saved_bytes']:>8.2f} "
              f"{r['step_s'] * 1e3:>9.1f} {r['step_s'] / base['step_s']:>7.2f} {plan / 1e6:>15.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": spec.name, "device": device.type, "rows": rows,
                                               "seq_len": args.seq_len, "micro_batch": args.micro_batch}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
