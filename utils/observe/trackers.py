"""The trackers `report_to` names: one registry, name -> how accelerate's tracker for it is made. The config's
choices are its keys (configs/training_config.py imports them: this module imports nothing of the project at
its top, and accelerate only when a tracker is made). Adding a tracker is one entry here.

TensorBoard writes into the run's logs/tensorboard/ with the hyperparameters in that same run; wandb and
mlflow are accelerate's own. A tracker whose package is missing is said once (rank 0) and left out; the
others keep working."""
from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Callable


def _accelerate_tracker(name: str):
    import accelerate.tracking

    return getattr(accelerate.tracking, name)


def _quiet_tensorboard_thread() -> None:
    """TensorBoard's writer thread re-raises its write error (a full disk) in its own thread, then again in
    the next `add_scalar` on ours, where it becomes the one-line DiskFullError: print it once, there. Wraps
    the hook in place when it is installed (by `tensorboard_tracker`, not by importing this module), once."""
    previous = threading.excepthook
    if getattr(previous, "quiets_tensorboard", False):
        return

    def hook(args) -> None:
        if type(args.thread).__name__ == "_AsyncWriterThread" and isinstance(args.exc_value, OSError):
            return
        previous(args)

    hook.quiets_tensorboard = True
    threading.excepthook = hook


def tensorboard_tracker(log_dir: Path):
    """accelerate's TensorBoard tracker writing into log_dir/tensorboard/, with the hyperparameters in that
    same run: accelerate's own stores them through `add_hparams`, which opens a second run named by the
    time, and `hparams.yml` in a third (TensorBoard then lists two stray runs)."""
    from accelerate.tracking import TensorBoardTracker, on_main_process

    _quiet_tensorboard_thread()

    class OneRunTensorBoard(TensorBoardTracker):
        @on_main_process
        def store_init_configuration(self, values: dict):
            import yaml
            from torch.utils.tensorboard.summary import hparams

            flat = {k: v if isinstance(v, (bool, int, float, str)) or v is None else str(v) for k, v in values.items()}
            for event in hparams({k: "" if v is None else v for k, v in flat.items()}, metric_dict={}):
                self.writer.file_writer.add_summary(event)
            self.writer.flush()
            Path(self.logging_dir, "hparams.yml").write_text(yaml.safe_dump(values, sort_keys=False))

    return OneRunTensorBoard("tensorboard", str(log_dir))


TRACKERS: dict[str, Callable[[str, Path], object]] = {  # (run name, the run's logs/ folder) -> tracker
    "tensorboard": lambda run_name, log_dir: tensorboard_tracker(log_dir),
    "wandb": lambda run_name, log_dir: _accelerate_tracker("WandBTracker")(run_name),
    "mlflow": lambda run_name, log_dir: _accelerate_tracker("MLflowTracker")(run_name,
                                                                             logging_dir=str(log_dir / "mlruns")),
}


def make_trackers(report_to: str, run_name: str, log_dir: Path) -> list:
    """accelerate's trackers for `report_to` (those whose package is installed)."""
    quiet = os.environ.get("RANK", "0") != "0"  # every rank finds the same missing package: rank 0 says it
    return [TRACKERS[name](run_name, log_dir)
            for name in usable_trackers(report_to, warn=(lambda msg: None) if quiet else None)]


def tracker_names(report_to: str) -> list[str]:
    """`report_to` ("tensorboard", "wandb,mlflow", "none") -> accelerate's tracker names."""
    names = [n.strip().lower() for n in report_to.split(",") if n.strip()]
    return [] if names in ([], ["none"]) else names


def usable_trackers(report_to: str, warn=None) -> list[str]:
    """`tracker_names`, less those whose package is not installed: one warning line each with the pip
    command, and the others keep working (accelerate would fail them all at once)."""
    import importlib.util

    warn = warn or (lambda msg: print(msg, file=sys.stderr, flush=True))
    usable = []
    for name in tracker_names(report_to):
        if importlib.util.find_spec(name) is None:
            warn(f"warning: report_to={name}: the {name} package is not installed, so nothing is logged to it; "
                 f"pip install {name} (or drop it from report_to)")
        else:
            usable.append(name)
    return usable
