#!/usr/bin/env python
"""Per-GPU memory of a training configuration, before renting the GPUs: weights, gradients, optimizer state,
activations, and whether it fits; with `--optimizer muon`, what its step holds besides and each rank's share
of its Newton-Schulz work.

    python scripts/memory_plan.py --model pythia-6.9b --strategy fsdp --world-size 8 --micro-batch 2 \\
        --activation-checkpointing selective --device-gib 80
    python scripts/memory_plan.py --optimizer muon --strategy fsdp --world-size 8

The figures are the estimate the memory profiles choose by (configs/profiles.py: `memory_plan`); the
training log states the measured per-rank parameter bytes at start. Exit status 1 when it does not fit.
"""
from __future__ import annotations

import argparse
import sys

from configs.model_config import MODELS, ConfigError, get_model_spec
from configs.profiles import USABLE_FRACTION, RunShape, memory_plan, muon_shapes
from configs.training_config import (
    ACTIVATION_CHECKPOINTING,
    OPTIMIZER_STATE_DTYPES,
    OPTIMIZERS,
    STRATEGIES,
    default_seq_len,
)
from utils.cli import CommandLine, number_flag


def main(argv=None) -> int:
    p = CommandLine(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-neox-1.2b", help=f"one of: {', '.join(MODELS)}")
    p.add_argument("--strategy", choices=STRATEGIES, default="ddp")
    p.add_argument("--world-size", type=number_flag("int"), default=1, help="processes (GPUs) in all")
    p.add_argument("--micro-batch", type=number_flag("int"), default=1, help="sequences per micro-batch per GPU")
    p.add_argument("--seq-len", type=number_flag("int"), default=0,
                   help="tokens per sequence (default: what a run trains at when seq_len is not set: the model's "
                        "positions, at most its context before rope scaling and 8192)")
    p.add_argument("--activation-checkpointing", choices=ACTIVATION_CHECKPOINTING, default="none",
                   help="the policy (training config field activation_checkpointing)")
    p.add_argument("--every", type=number_flag("int"), default=2, help="every_k: checkpoint every k-th block")
    p.add_argument("--checkpointing", action="store_true", help="the same as --activation-checkpointing full")
    p.add_argument("--moments", choices=OPTIMIZER_STATE_DTYPES, default="fp32",
                   help="optimizer state precision (training config field optimizer_state_dtype)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw",
                   help="adamw: two moments per parameter; muon: one momentum per block matrix (AdamW for the rest)")
    p.add_argument("--device-gib", type=number_flag("float"), default=80.0, help="memory of one GPU, GiB (default 80)")
    args = p.parse_args(argv)
    try:
        spec = get_model_spec(args.model)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.world_size < 1 or args.micro_batch < 1 or args.seq_len < 0 or args.every < 1:
        print("error: --world-size, --micro-batch and --every must be at least 1, --seq-len not negative",
              file=sys.stderr)
        return 2
    policy = "full" if args.checkpointing else args.activation_checkpointing
    seq_len = args.seq_len or default_seq_len(spec)[0]
    plan = memory_plan(spec, RunShape(strategy=args.strategy, world_size=args.world_size, micro_batch=args.micro_batch,
                                      seq_len=seq_len, checkpointing=policy, checkpointing_every=args.every,
                                      moments=args.moments, optimizer=args.optimizer))
    print(f"{spec.name}, {args.strategy} over {args.world_size} GPU(s), micro-batch {args.micro_batch} x seq_len "
          f"{seq_len:,}{'' if args.seq_len else ' (the training default)'}, activation checkpointing {policy}, "
          f"{args.optimizer} state in {args.moments}:")
    print("\n".join(plan.lines()))
    if args.optimizer == "muon":
        from utils.training.optim.muon_ranks import work_per_rank

        work = work_per_rank(muon_shapes(spec), args.world_size)
        print(f"Muon's Newton-Schulz: {sum(work) / 1e9:,.0f} GFLOP a step, {max(work) / 1e9:,.0f} on the busiest of "
              f"{args.world_size} rank(s) (each orthogonalises its share of the block matrices); its step holds "
              f"{plan.muon_step / 1e9:.2f} GB besides (Newton-Schulz in bf16)")
    usable = USABLE_FRACTION * args.device_gib * 2**30 / 1e9
    if plan.fits(args.device_gib):
        print(f"fits a {args.device_gib:g} GiB GPU ({usable:.1f} GB usable)")
        return 0
    print(f"does NOT fit a {args.device_gib:g} GiB GPU ({usable:.1f} GB usable): shard it (--strategy fsdp, more "
          f"GPUs), --activation-checkpointing selective or full, lower --micro-batch or use --moments bf16")
    return 1


if __name__ == "__main__":
    sys.exit(main())
