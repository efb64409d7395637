#!/usr/bin/env python
"""Plot one or more runs from their logs/metrics.jsonl: training loss, validation loss, learning rate and
tokens/s against tokens seen, one line per run. For a remote machine without TensorBoard: copy the PNG.

    python scripts/plot_run.py runs/demo -o run.png              # the demo's run (runs/RUN_NAME/ by default)
    python scripts/plot_run.py runs/demo runs/cpu -o compare.png # two runs side by side

RUN_DIR is a run's --output-dir (its logs/metrics.jsonl is read) or a metrics.jsonl file. Exit status: 0
written, 2 bad input (a RUN_DIR without metrics, nothing to plot).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from utils.errors import UserError  # noqa: E402

PANELS = (("loss", "training loss"), ("val_loss", "validation loss"), ("lr", "learning rate"),
          ("tokens_per_sec", "tokens/s"))


def metrics_file(given: str) -> Path:
    path = Path(given)
    path = path if path.is_file() else path / "logs" / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"{given}: no logs/metrics.jsonl there (give a run's --output-dir or a metrics.jsonl)")
    return path


def plot(runs: list[str], out: Path) -> int:
    """Writes the figure; returns the number of points drawn."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    from utils.metrics import read_metrics, rows_with

    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharex=True)
    drawn = 0
    for given in runs:
        path = metrics_file(given)
        rows = read_metrics(path)
        label = path.parent.parent.resolve().name if path.name == "metrics.jsonl" and path.parent.name == "logs" \
            else path.stem
        for ax, (key, title) in zip(axes.flat, PANELS):
            points = [r for r in rows_with(rows, key) if r.get("tokens") is not None]
            if points:
                ax.plot([r["tokens"] for r in points], [r[key] for r in points], label=label,
                        marker="o", markersize=3)
                drawn += len(points)
            ax.set_title(title)
            ax.grid(True, alpha=0.3)
    if not drawn:
        raise UserError(f"nothing to plot: no training or eval rows in {', '.join(runs)}")
    for ax in axes[1]:
        ax.set_xlabel("tokens seen")
    axes[0][0].legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return drawn


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", metavar="RUN_DIR")
    p.add_argument("-o", "--output", default="runs.png", help="the PNG to write (default runs.png)")
    args = p.parse_args(argv)
    try:
        drawn = plot(args.runs, Path(args.output))
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.output} ({drawn} points from {len(args.runs)} run(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
