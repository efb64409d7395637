"""Downstream evals: multiple-choice and cloze tasks from local files, scored as lm-evaluation-harness scores
them, in the training loop (`eval_tasks`) and by scripts/evaluate.py.

tasks.py reads task files (the published layouts of HellaSwag, PIQA, ARC and LAMBADA, and two plain ones);
scoring.py tokenizes and scores requests as lm-eval's `hf` model does and computes its metrics; runner.py
drives them over the ranks and writes the rows; demo_task.py builds the demo's own task from held-out
standard-library files.

- `validation`: the validation loss; `evaluator`: validation, the downstream evals and the samples in the
  loop, each on its own schedule; `sampling`: samples during training (`sample_every`).

May import: utils, utils.io, utils.runtime, utils.observe, configs, utils.data, utils.model.
"""
