#!/usr/bin/env python
"""Plot one or more runs from their logs/metrics.jsonl: training loss, validation loss, learning rate and
tokens/s against tokens seen, one line per run. For a remote machine without TensorBoard: copy the PNG.

    python scripts/plot_run.py runs/demo                # the demo's run: runs/demo/curves.png
    python scripts/plot_run.py runs/demo runs/cpu       # two runs side by side: runs/demo/curves-vs-cpu.png
    python scripts/plot_run.py runs/demo -o compare.svg # a file of your choice

RUN_DIR is a run's --output-dir (its logs/metrics.jsonl is read) or a metrics.jsonl file. The figure goes into
the first run's folder (curves.png, or curves-vs-NAME-....png naming the other runs), or to `-o`: the file to
write, its format from its extension (png, svg, pdf, ...; none: .png is added); a directory gets curves.png
inside it. Exit status: 0 written (the line names the file), 2 bad input (a RUN_DIR without metrics, nothing
to plot, an extension matplotlib cannot write).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


from utils import layout
from utils.errors import UserError

DEFAULT_OUTPUT = "curves.png"
PANELS = (("loss", "training loss"), ("val_loss", "validation loss"), ("lr", "learning rate"),
          ("tokens_per_sec", "tokens/s"))


def metrics_file(given: str) -> Path:
    path = Path(given)
    path = path if path.is_file() else path / layout.LOGS / layout.METRICS
    if not path.is_file():
        raise UserError(f"{given}: no logs/metrics.jsonl there (give a run's --output-dir or a metrics.jsonl)")
    return path


def run_folder(metrics: Path) -> Path:
    """The run a metrics file belongs to: RUN/logs/metrics.jsonl -> RUN; any other file -> its folder."""
    in_a_run = metrics.name == layout.METRICS and metrics.parent.name == layout.LOGS
    return metrics.parent.parent if in_a_run else metrics.parent


def run_label(metrics: Path) -> str:
    return run_folder(metrics).resolve().name if metrics.name == layout.METRICS else metrics.stem


def default_output(runs: list[str]) -> Path:
    """Inside the first run's folder: curves.png, or with other runs curves-vs-NAME-NAME.png."""
    paths = [metrics_file(given) for given in runs]
    others = "-".join(run_label(path) for path in paths[1:])
    return run_folder(paths[0]) / (f"curves-vs-{others}.png" if others else DEFAULT_OUTPUT)


def output_file(given: str) -> Path:
    """The file `-o` names: a directory gets DEFAULT_OUTPUT inside it, a name without an extension gets .png
    (what matplotlib would write anyway), an extension matplotlib cannot write is refused, listing those it can."""
    from matplotlib.backend_bases import FigureCanvasBase

    path = Path(given)
    if path.is_dir() or given.endswith("/"):
        path = path / DEFAULT_OUTPUT
    if not path.suffix:
        path = path.with_name(path.name + ".png")
    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    if path.suffix[1:].lower() not in formats:
        raise UserError(f"-o {given}: matplotlib cannot write {path.suffix} files; use one of "
                        f"{', '.join('.' + f for f in formats)}")
    return path


def plot(runs: list[str], out: Path) -> int:
    """Writes the figure; returns the number of points drawn."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    from utils.observe.metrics import read_metrics, rows_with

    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharex=True)
    drawn = 0
    for given in runs:
        path = metrics_file(given)
        rows = read_metrics(path)
        label = run_label(path)
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
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=100)
    except OSError as exc:
        raise UserError(f"-o {out}: cannot write it ({exc.strerror or exc}); give a file in a folder you may "
                        f"write") from None
    finally:
        plt.close(fig)
    return drawn


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", metavar="RUN_DIR")
    p.add_argument("-o", "--output",
                   help=f"the image to write, its format from its extension; a directory gets {DEFAULT_OUTPUT} "
                        f"inside it (default: the first run's folder, {DEFAULT_OUTPUT} or curves-vs-NAME.png)")
    args = p.parse_args(argv)
    try:
        out = output_file(args.output) if args.output else default_output(args.runs)
        drawn = plot(args.runs, out)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({drawn} points from {len(args.runs)} run(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
