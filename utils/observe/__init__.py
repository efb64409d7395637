"""Observation: what a run says about itself while it trains.

- `metrics`: the run's logger (console, logs/training.log, logs/metrics.jsonl, trackers), the metrics window
  (tokens/s, MFU, data waits), the closing summary;
- `trackers`: the `report_to` registry (TensorBoard, wandb, mlflow through accelerate);
- `watchdog`: the hang watchdog (`hang_timeout_s`): stacks of every rank and exit 3.

May import: utils, utils.io, utils.runtime.
"""
