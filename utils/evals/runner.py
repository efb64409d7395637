"""Scoring tasks with a model, in the training loop (`DownstreamEvals`) and in scripts/evaluate.py
(`score_tasks`): the same requests, the same scorer, the same metrics."""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from utils.errors import UserError
from utils.evals.scoring import Placement, RequestEncoder, loglikelihoods, task_metrics
from utils.evals.tasks import Task, load_task
from utils.settings import Settings


def load_encoder(source, max_length: int, advice: str) -> RequestEncoder:
    """The RequestEncoder of the tokenizer at `source` (a data directory, a checkpoint, an HF directory or a
    tokenizer.json; see ExportTokenizer.find); `advice` ends the error when there is none."""
    from utils.model.hf import ExportTokenizer

    found = ExportTokenizer.find(Path(source).expanduser())
    if found is None:
        raise UserError(f"no tokenizer.json in {source}, so the tasks' text cannot be tokenized; {advice}")
    tokenizer = found.tokenizer
    prefix = found.bos or found.eos
    return RequestEncoder(tokenizer, tokenizer.token_to_id(prefix) if prefix else None, max_length)


@dataclass(frozen=True)
class PreparedTask:
    task: Task
    requests: list[tuple[list[int], list[int]]]


def load_tasks(named_paths: dict[str, str], limit: int = 0) -> list[Task]:
    """Each task file read (its first `limit` examples; 0: all): before anything slow, so a bad file costs
    nothing."""
    return [load_task(path, name, limit) for name, path in named_paths.items()]


def prepare_tasks(tasks: list[Task], encoder: RequestEncoder) -> list[PreparedTask]:
    """Each task's requests, tokenized once."""
    return [PreparedTask(task, encoder.task_requests(task)) for task in tasks]


_ONE_PROCESS = Placement()  # score_tasks' default: one process on the CPU (Placement is frozen: shared safely)


def score_tasks(model, tasks: list[PreparedTask], batch_size: int, max_length: int,
                placement: Placement = _ONE_PROCESS) -> dict[str, tuple[dict[str, float], list[tuple[float, bool]]]]:
    """{task name: (metrics, each request's (log-likelihood, greedy))}: every task's requests scored in one
    pass over the ranks (see scoring.loglikelihoods; call on every rank)."""
    everything = [r for t in tasks for r in t.requests]
    results = loglikelihoods(model, everything, batch_size, max_length, placement)
    out, start = {}, 0
    for t in tasks:
        mine = results[start:start + len(t.requests)]
        start += len(t.requests)
        out[t.task.name] = (task_metrics(t.task, mine), mine)
    return out


def describe_metrics(metrics: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.4f}" for k, v in metrics.items())


@dataclass(frozen=True)
class EvalSettings(Settings):
    """When the run evaluates, and what: validation and the downstream tasks."""

    eval_interval: int
    eval_batches: int
    eval_tasks: dict
    eval_tasks_every: int
    eval_tasks_limit: int
    max_steps: int
    per_device_train_batch_size: int


class DownstreamEvals:
    """`eval_tasks` during training: every `eval_tasks_every` optimizer steps (0: with validation, every
    `eval_interval`), at step 0 and at the last step, each task's metrics go to metrics.jsonl and the
    trackers as `eval/<task>/<metric>` (TensorBoard: the same tags), with `eval_tasks_s`, and one log line.
    Every rank scores a share of the requests; the model is the unwrapped one (DDP) or the sharded one
    (FSDP: every rank runs each forward), in the run's autocast. Micro-batch: the training one."""

    def __init__(self, settings: EvalSettings, spec, described: Path, accelerator, log, sharded: bool = False):
        self.every = settings.eval_tasks_every or settings.eval_interval
        self.max_steps, self.batch_size = settings.max_steps, settings.per_device_train_batch_size
        self.max_length = spec.max_position_embeddings
        self.sharded = sharded  # the parallelism seam's: every rank runs each forward of a sharded model
        self.accelerator, self.log = accelerator, log
        self.tasks: list[PreparedTask] = []
        if settings.eval_tasks:
            tasks = load_tasks(settings.eval_tasks, settings.eval_tasks_limit)
            encoder = load_encoder(described, self.max_length, advice="eval_tasks needs the data's tokenizer "
                                   "there (prepare_data.py writes it), or leave eval_tasks empty")
            self.tasks = prepare_tasks(tasks, encoder)
            log.info("eval_tasks: " + "; ".join(
                f"{t.task.name} ({t.task.layout}, {len(t.task.examples)} examples, {len(t.requests)} requests)"
                for t in self.tasks) + f", every {self.every} steps")

    def due(self, step: int) -> bool:
        return bool(self.tasks) and (step % self.every == 0 or step == self.max_steps)

    def run(self, model, step: int, tokens: int) -> float:
        """Scores every task at `step` (call on every rank); returns the seconds it took, which the caller
        keeps out of tokens/s."""
        started = time.perf_counter()
        acc = self.accelerator
        placement = Placement(acc.device, acc.autocast, acc.process_index, acc.num_processes, self.sharded)
        scored = score_tasks(model, self.tasks, self.batch_size, self.max_length, placement)
        seconds = time.perf_counter() - started
        row = {"step": step, "tokens": tokens}
        for name, (metrics, _) in scored.items():
            row |= {f"eval/{name}/{key}": value for key, value in metrics.items()}
        self.log.info(f"Step {step}: eval_tasks " + "; ".join(f"{name} {describe_metrics(metrics)}"
                                                             for name, (metrics, _) in scored.items())
                      + f" ({seconds:.1f} s)")
        self.log.write_row(row | {"eval_tasks_s": seconds})
        return seconds
