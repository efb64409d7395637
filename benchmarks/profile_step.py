#!/usr/bin/env python
"""Where a training step's time goes: `torch.profiler` over a few optimizer steps of the engine's native
model (forward, chunked LM-head loss, backward, clip, fused AdamW), as train.py runs them; prints the top
operators/kernels by self time on the device (CUDA) or the CPU, and writes a Chrome trace
(chrome://tracing, https://ui.perfetto.dev).

    python benchmarks/profile_step.py --out trace.json                       # GPU: 1.2B, bf16, compile
    python benchmarks/profile_step.py --model tiny --micro-batch 2 --seq-len 64 --no-compile --out t.json

On a GPU machine, the first form is the one whose figures go into benchmarks/RESULTS.md.
"""
from __future__ import annotations

import argparse
import sys
import time

from utils.runtime.threads import settle_wait

settle_wait()  # how CPU threads wait: before torch (and its OpenMP runtime) is imported

import torch

from configs import get_model_spec, get_training_config
from configs.training_config import ACTIVATION_CHECKPOINTING
from utils.model import build_model
from utils.model.activation_checkpointing import apply_activation_checkpointing
from utils.training.optim import OptimizerSettings, build_optimizer


def main(argv=None) -> int:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-neox-1.2b" if cuda else "tiny")
    p.add_argument("--micro-batch", type=int, default=8 if cuda else 2)
    p.add_argument("--seq-len", type=int, default=0, help="default: the model's positions")
    p.add_argument("--precision", choices=("bf16", "fp8", "no"), default="bf16" if cuda else "no")
    p.add_argument("--no-compile", action="store_true", help="eager blocks (default on CUDA: regional compile)")
    p.add_argument("--activation-checkpointing", choices=ACTIVATION_CHECKPOINTING, default="none",
                   help="the policy (training config field activation_checkpointing)")
    p.add_argument("--warmup", type=int, default=3, help="steps before profiling (compile happens here)")
    p.add_argument("--steps", type=int, default=3, help="profiled steps")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", default="trace.json", help="Chrome trace path")
    args = p.parse_args(argv)

    device = torch.device("cuda" if cuda else "cpu")
    spec = get_model_spec(args.model)
    seq_len = args.seq_len or spec.max_position_embeddings
    model = build_model(spec, seed=0)
    apply_activation_checkpointing(model, args.activation_checkpointing)
    model = model.to(device)
    if args.precision == "fp8":
        from utils.model.fp8 import enable_fp8

        enable_fp8(model)
    if cuda and not args.no_compile:
        model.compile_blocks()
    optimizer = build_optimizer(model, OptimizerSettings.of(get_training_config("production")), fused=cuda)
    params = list(model.parameters())
    batch = torch.randint(0, spec.vocab_size, (args.micro_batch, seq_len), device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision != "no")

    def step():
        with autocast:
            loss = model(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    started = time.perf_counter()
    for _ in range(args.warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
    print(f"warm-up: {args.warmup} steps in {time.perf_counter() - started:.1f} s (compile included)")
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        started = time.perf_counter()
        for _ in range(args.steps):
            with torch.profiler.record_function("train_step"):
                step()
        if cuda:
            torch.cuda.synchronize()
        elapsed = (time.perf_counter() - started) / args.steps
    tokens = args.micro_batch * seq_len
    print(f"{spec.name}, micro-batch {args.micro_batch} x {seq_len}, {args.precision}: {elapsed * 1e3:.1f} ms a step, "
          f"{tokens / elapsed:,.0f} tokens/s")
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=args.top))
    prof.export_chrome_trace(args.out)
    print(f"Chrome trace: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
