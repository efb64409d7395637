#!/usr/bin/env python
"""Write the demo's downstream task: pick the true next line of a Python standard-library file among 4.

    python scripts/make_demo_task.py data/demo_next_line.jsonl
    ./start_training.sh --config demo --set eval_tasks=next_line=data/demo_next_line.jsonl --set eval_tasks_limit=200

A multiple_choice task file (utils/evals/tasks.py) built from the standard-library files the demo corpus
leaves out, the same for the same Python installation and --seed (utils/evals/demo_task.py says how).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from utils.cli import CommandLine, number_flag
from utils.errors import UserError


def main(argv=None) -> int:
    p = CommandLine(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="the task file to write (JSON Lines)")
    p.add_argument("--examples", type=number_flag("int"), default=500, help="how many examples (default 500)")
    p.add_argument("--seed", type=number_flag("int"), default=0)
    args = p.parse_args(argv)
    from utils.evals.demo_task import build_next_line_task
    from utils.io import files

    out = Path(args.out)
    try:
        if args.examples < 1:
            raise UserError("--examples must be at least 1")
        if out.is_dir() or not out.parent.is_dir():
            raise UserError(f"{out}: give a file in an existing folder")
        with files.write_guard(out, advice="write it into a folder you may write"):
            written = build_next_line_task(out, args.examples, args.seed)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {written} examples to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
