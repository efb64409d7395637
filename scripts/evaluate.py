#!/usr/bin/env python
"""Score a model on downstream task files, as the training loop's `eval_tasks` and lm-evaluation-harness do.

    python scripts/evaluate.py runs/demo/final_model --task hellaswag=data/evals/hellaswag_val.jsonl --limit 500
    python scripts/evaluate.py runs/demo/checkpoints/CHECKPOINT --task data/demo_next_line.jsonl --json
    python scripts/evaluate.py runs/demo --task a.jsonl --task b.jsonl   # a run's newest checkpoint

PATH: final_model/ or any HF directory of a registered family (docs/models.md), an engine checkpoint (sharded FSDP ones
too, reassembled here), or a run's output directory (its newest complete checkpoint). `--task FILE` or
`--task NAME=FILE` (repeatable): the layouts of utils/evals/tasks.py (HellaSwag, PIQA, ARC, LAMBADA as published, or
the plain multiple_choice and cloze ones). The tokenizer is the one saved with PATH, or `--tokenizer`. The model is
the engine's own model of its family in fp32; the numbers equal the loop's for the same weights and lm-eval's
(`--model hf`) on the exported model. stdout holds the table (`--json`: one JSON object {task: {layout,
examples, metric: value, ...}}); everything else goes to stderr. `--samples FILE` writes every example's
log-likelihoods, as lm-eval's `--log_samples` does. Exit status: 0 done, 2 bad input.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from utils.cli import CommandLine, number_flag
from utils.errors import UserError
from utils.runtime.threads import settle_wait


def parse_args(argv=None) -> argparse.Namespace:
    p = CommandLine(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", metavar="PATH", help="an HF model directory, a checkpoint or a run's output directory")
    p.add_argument("--task", action="append", required=True, metavar="[NAME=]FILE",
                   help="a task file, named NAME or after the file (repeatable)")
    p.add_argument("--limit", type=number_flag("int"), default=0,
                   help="score the first N examples of each task (0: all)")
    p.add_argument("--batch-size", type=number_flag("int"), default=16, help="sequences per forward pass")
    p.add_argument("--device", default="auto", help="auto (cuda if available) | cpu | cuda | cuda:N")
    p.add_argument("--tokenizer", help="a prepared data directory, an HF tokenizer directory or a tokenizer.json "
                                       "(default: the one saved with PATH)")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    p.add_argument("--samples", metavar="FILE", help="write each example's log-likelihoods (one per choice), "
                                                     "greedy flags and gold index to FILE as JSON Lines")
    return p.parse_args(argv)


def load_model(path: Path):
    """(the engine's model holding PATH's weights, in eval mode, its spec, the directory it came from)."""
    import torch

    from generate import load_weights
    from utils.model import build_model

    kind, directory, spec, weights = load_weights(path)
    with torch.device("meta"):  # no time spent initialising weights that are replaced at once
        model = build_model(spec, seed=0)
    model.load_state_dict(weights, strict=not spec.tie_word_embeddings, assign=True)
    model.tie_weights()
    model.reset_buffers()
    print(f"evaluate: {kind} {directory}", file=sys.stderr)
    return model.float().eval(), spec, directory


def table(results: dict) -> str:
    metrics = sorted({k for r in results.values() for k in r if k not in ("layout", "examples")},
                     key=lambda k: ("acc", "acc_norm", "ppl").index(k))
    rows = [["task", "layout", "examples", *metrics]]
    for name, r in results.items():
        rows.append([name, r["layout"], str(r["examples"])] + [f"{r[m]:.4f}" if m in r else "" for m in metrics])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def write_samples(path: Path, tasks, scored) -> None:
    from utils.io import files

    lines = []
    for task in tasks:
        results = iter(scored[task.name][1])
        for index, example in enumerate(task.examples):
            mine = [next(results) for _ in example.choices]
            lines.append(json.dumps({"task": task.name, "index": index, "loglikelihoods": [ll for ll, _ in mine],
                                     "greedy": [greedy for _, greedy in mine], "gold": example.gold}))
    with files.write_guard(path, advice="give --samples a file in a folder you may write"):
        files.write_text(path, "".join(line + "\n" for line in lines))


def check_writable(path: Path) -> None:
    """--samples is refused before the scoring, not after it."""
    import os

    if path.is_dir() or not path.parent.is_dir() or not os.access(path.parent, os.W_OK):
        raise UserError(f"--samples {path}: not a file in an existing folder you may write")


def main(argv=None) -> int:
    settle_wait()  # how CPU threads wait: before torch (and its OpenMP runtime) is imported
    args = parse_args(argv)
    try:
        if args.limit < 0 or args.batch_size < 1:
            raise UserError("--limit must not be negative and --batch-size must be at least 1")
        import torch

        from configs.training_config import parse_eval_tasks
        from utils.evals.runner import load_encoder, load_tasks, prepare_tasks, score_tasks
        from utils.evals.scoring import Placement

        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", args.device):
            raise UserError(f"--device {args.device}: not a device this script runs on; use auto, cpu, cuda or cuda:N")
        device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise UserError(f"--device {args.device}: no CUDA GPU here; use --device cpu")
        tasks = load_tasks(parse_eval_tasks(args.task, "--task"), args.limit)
        if args.samples:
            check_writable(Path(args.samples))
        model, spec, directory = load_model(Path(args.path))
        encoder = load_encoder(args.tokenizer or directory, spec.max_position_embeddings,
                               advice="pass --tokenizer: the data directory or tokenizer.json the model was "
                                      "trained with")
        prepared = prepare_tasks(tasks, encoder)
        scored = score_tasks(model.to(device), prepared, args.batch_size, spec.max_position_embeddings,
                             Placement(device))
        if args.samples:
            write_samples(Path(args.samples), tasks, scored)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    results = {task.name: {"layout": task.layout, "examples": len(task.examples), **scored[task.name][0]}
               for task in tasks}
    print(json.dumps(results) if args.json else table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
