"""The engine, one folder per layer. A module imports only from its own folder and the layers its folder's
docstring names after "May import:" (tests/test_architecture.py reads those lines; no circle).

Lowest first:
- `utils` itself, the base: `errors` (UserError, the one base class for problems the user fixes), `layout`
  (a run folder's file names), `debug` (debug and fault-injection switches), `settings` (the base of every
  component's typed settings, and the one numeric parsing), `cli` (the entry points' command lines: one-line
  errors, numeric flags), `quiet_imports` (torchao's import noise on CPU machines).
- `utils.io`: files, GCS, the run's lock, the console.
- `utils.runtime`: processes and signals: the launcher's supervisor, the stop signal, the run's status record,
  collectives that strand no rank, host memory.
- `utils.observe`: what a run reports: metrics, trackers, the hang watchdog.
- `utils.training`: the training loop's own parts: optimizers, LR schedules, the spike guard, the run state.
- `configs` (beside utils): the user-facing configuration, presets and the memory plan.
- `utils.data`, `utils.checkpoint`, `utils.model`: data, checkpoints, models and their families.
- `utils.parallel`, `utils.evals`: how the model is spread over processes; evaluation and samples.
- `utils.run`: a run end to end: the Trainer and its callbacks, the output folder, the report, the export.

May import: nothing of the project (the base modules import only each other).
"""
from utils import quiet_imports  # noqa: F401  (imported for its effect: torchao's import noise on CPU machines)
