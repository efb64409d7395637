"""The loss-spike guard (utils/training/spike_guard.py): its statistic and state in-process; then through train.py, with
a batch poisoned on purpose (NEOX_DEBUG_POISON_SEQUENCES: each sequence its first token repeated, a gradient
norm about 7x the usual on the tiny model), skip (the weights after the step bitwise those before it),
rollback (back to the newest checkpoint, the data since skipped, the run finishes, and a resume from a
checkpoint written after the rollback continues bitwise), and both under 2 DDP and 2 FSDP ranks."""
from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from configs.training_config import TrainingConfig
from tests.trainkit import REPO_ROOT, TINY, load_weights, make_shards, metrics, run, train_cmd, train_rows
from utils.observe.metrics import RunLogger, read_metrics
from utils.training.spike_guard import MIN_SPREAD


@pytest.fixture(scope="module")
def accelerator():
    os.environ.setdefault("ACCELERATE_USE_CPU", "true")
    from accelerate import Accelerator

    return Accelerator(cpu=True)


def make_guard(tmp_path, accelerator, mode="skip", window=4, threshold=3.0, patience=2, max_rollbacks=3):
    from utils.training.spike_guard import SpikeGuard, SpikeGuardSettings

    cfg = TrainingConfig(spike_guard=mode, spike_window=window, spike_threshold=threshold, spike_patience=patience,
                         spike_max_rollbacks=max_rollbacks)
    log = RunLogger(tmp_path / mode, is_main=True)
    return SpikeGuard(SpikeGuardSettings.of(cfg), accelerator, log), tmp_path / mode / "metrics.jsonl"


def feed(guard, first_step: int, values) -> list[bool]:
    """The guard's decision for each (loss, grad norm), at consecutive steps from first_step."""
    return [guard.check(first_step + i, torch.tensor(loss), torch.tensor(norm)) for i, (loss, norm) in
            enumerate(values)]


def spike_rows(path) -> list[dict]:
    return [r for r in read_metrics(path) if "spike/action" in r]


CALM = [(5.0, 1.0), (5.2, 1.1), (4.8, 0.9), (5.0, 1.0)]  # mean 5.0, std 0.1155; norms: mean 1.0, std 0.0816


def test_a_step_far_above_the_window_is_a_spike_and_never_joins_it(tmp_path, accelerator):
    guard, rows = make_guard(tmp_path, accelerator)
    assert feed(guard, 1, [(5.0, 1.0), (50.0, 30.0)]) == [True, True]  # nothing judged before the window is full
    guard, rows = make_guard(tmp_path / "b", accelerator)
    assert feed(guard, 1, CALM) == [True] * 4
    # limits: loss 5.0 + 3 x 0.1155 = 5.346, norm 1.0 + 3 x max(0.0816, 0.15 x 1.0) = 1.45
    assert feed(guard, 5, [(5.3, 1.2)]) == [True]  # under both: joins the window
    assert feed(guard, 6, [(9.0, 1.0), (5.1, 10.0), (5.1, 1.0)]) == [False, False, True]  # a loss, a norm spike
    assert np.allclose(list(guard.recent), [(4.8, 0.9), (5.0, 1.0), (5.3, 1.2), (5.1, 1.0)])  # spikes stayed out
    first, second = spike_rows(rows)
    assert (first["step"], first["spike/action"], second["step"]) == (6, "skip", 7)
    history = np.array([(5.2, 1.1), (4.8, 0.9), (5.0, 1.0), (5.3, 1.2)], dtype=np.float32).astype(float)
    mean = history.mean(axis=0)
    limits = mean + 3 * np.maximum(history.std(axis=0, ddof=1), MIN_SPREAD * mean)
    assert limits[1] == 3 * 0.15 * mean[1] + mean[1]  # the norm's spread (0.13) is below 15% of its mean
    assert math.isclose(first["spike/loss_limit"], limits[0]) and math.isclose(first["spike/grad_norm_limit"],
                                                                               limits[1])
    assert first["spike/loss"] == 9.0 and math.isclose(second["spike/grad_norm"], 10.0)
    assert (guard.spikes, guard.skipped, guard.rollback_due) == (2, 2, False)


def test_a_non_finite_loss_is_a_skipped_spike_under_skip_and_left_to_the_run_under_warn(tmp_path, accelerator):
    skip, skip_rows = make_guard(tmp_path, accelerator, "skip")
    assert feed(skip, 1, [(float("nan"), 1.0), (5.0, float("inf")), (5.0, 1.0)]) == [False, False, True]
    assert [r["spike/loss"] for r in spike_rows(skip_rows)] == [None, 5.0]  # nan is null in metrics.jsonl
    warn, warn_rows = make_guard(tmp_path, accelerator, "warn")
    assert feed(warn, 1, [(float("nan"), 1.0)]) == [True]
    warn.review()
    assert spike_rows(warn_rows) == [] and warn.spikes == 0 and list(warn.recent) == []


def test_warn_applies_every_step_and_judges_them_at_review_as_skip_does(tmp_path, accelerator):
    warn, rows = make_guard(tmp_path, accelerator, "warn")
    skip, _ = make_guard(tmp_path, accelerator, "skip")
    steps = CALM + [(9.0, 1.0), (5.1, 1.0)]
    assert feed(warn, 1, steps) == [True] * 6
    assert spike_rows(rows) == []  # nothing on the host yet
    warn.review()
    assert [(r["step"], r["spike/action"]) for r in spike_rows(rows)] == [(5, "warn")]
    assert feed(skip, 1, steps) == [True] * 4 + [False, True]
    assert list(warn.recent) == list(skip.recent)


def test_rollback_is_due_after_patience_spikes_within_the_window(tmp_path, accelerator):
    guard, _ = make_guard(tmp_path, accelerator, "rollback", window=4, patience=2)
    feed(guard, 1, CALM)
    assert feed(guard, 5, [(9.0, 1.0)]) == [False] and not guard.rollback_due
    feed(guard, 6, CALM)
    assert feed(guard, 10, [(9.0, 1.0)]) == [False] and not guard.rollback_due  # step 5 is 5 steps back: out
    assert feed(guard, 11, [(9.0, 1.0)]) == [False] and guard.rollback_due
    assert guard.spike_steps == [10, 11]


def test_the_state_round_trips_through_a_checkpoint_file_and_decides_alike(tmp_path, accelerator):
    guard, _ = make_guard(tmp_path, accelerator, "rollback", patience=3)
    feed(guard, 1, CALM + [(9.0, 1.0), (5.1, 1.0)])
    guard.rollbacks.append({"step": 3, "checkpoint": "checkpoint-epoch0-step2-files0", "to_step": 2,
                            "skipped": [8, 12]})
    torch.save(guard.state_dict(), tmp_path / "spike_guard.pt")
    again, _ = make_guard(tmp_path / "again", accelerator, "rollback", patience=3)
    again.load_state_dict(torch.load(tmp_path / "spike_guard.pt", weights_only=True))
    assert again.state_dict() == guard.state_dict()
    later = [(9.0, 1.0), (5.0, 5.0)]  # with step 5's: 3 spikes within 4 steps
    assert feed(again, 7, later) == feed(guard, 7, later) == [False, False]
    assert again.rollback_due and guard.rollback_due


def test_a_skipped_step_under_a_grad_scaler_closes_the_scalers_step(tmp_path, accelerator, monkeypatch):
    """fp16: clipping unscaled the gradients; a skip calls no optimizer step, so the guard closes the scaler's
    step itself (else the next step's unscale_ fails), and the scaler lowers its scale for the inf."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    monkeypatch.setattr(accelerator, "scaler", scaler)
    guard, _ = make_guard(tmp_path, accelerator, "skip")
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, poisoned in enumerate([False, True, False], start=1):
        x = torch.full((2, 4), math.inf if poisoned else 1.0)
        loss = model(x).sum()
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)  # what accelerate's clip_grad_norm_ does first
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if guard.check(step, loss, norm):
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad()
    assert guard.skipped == 1 and scaler.get_scale() == 2.0 ** 7


def test_poison_makes_the_named_positions_one_repeated_token_in_a_copy():
    from utils.debug import poison

    batch = np.arange(12).reshape(4, 3)
    out = poison(batch, 10, [range(11, 13)])  # rows 1 and 2 are positions 11 and 12
    assert out.tolist() == [[0, 1, 2], [3, 3, 3], [6, 6, 6], [9, 10, 11]]
    assert batch.tolist() == np.arange(12).reshape(4, 3).tolist()  # the batch itself (a shard's view) untouched
    assert poison(batch, 20, [range(11, 13)]) is batch


# ------------------------------------------------------------------------------------- through train.py

GUARD = ("per_device_train_batch_size=4", "spike_window=8")  # 4 sequences a step: step s reads [4s - 4, 4s)
STEP_11, STEP_13 = "40-44", "48-52"


def events(out: Path) -> list[tuple]:
    """(step, action, [to_step, skipped_from, skipped_to] for a rollback) of each spike row."""
    return [(r["step"], r["spike/action"], [r["spike/to_step"], r["spike/skipped_from"], r["spike/skipped_to"]]
             if r["spike/action"] == "rollback" else None) for r in metrics(out) if "spike/action" in r]


def checkpoint(out: Path, step: int) -> Path:
    return next((out / "checkpoints").glob(f"checkpoint-epoch*-step{step}-files*"))


def objects(path: Path, name: str):
    return torch.load(path / f"{name}.pt", weights_only=True)


def same_tensors(a, b) -> bool:
    """Nested state dicts hold the same tensors, bitwise, and the same other values."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_tensors(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_tensors(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["skip", "warn"])
def test_a_poisoned_batch_is_a_spike_and_skip_leaves_the_weights_bitwise_as_they_were(mode, tmp_path,
                                                                                        subprocess_env):
    """A checkpoint after every step; step 11's batch poisoned. skip: the checkpoints before and after it hold
    the same weights and AdamW state bitwise, the schedule and the data cursor moved on, training goes on;
    warn: the same spike is said and its update applied (5 s each)."""
    data, out = make_shards(tmp_path / "data"), tmp_path / "out"
    env = dict(subprocess_env, NEOX_DEBUG_POISON_SEQUENCES=STEP_11)
    proc = run(train_cmd(out, data, *GUARD, f"spike_guard={mode}", "max_steps=14", "save_steps=1",
                         "save_total_limit=20"), env)
    spikes = [r for r in metrics(out) if "spike/action" in r]
    assert [(r["step"], r["spike/action"]) for r in spikes] == [(11, mode)], spikes
    assert spikes[0]["spike/grad_norm"] > 3 * spikes[0]["spike/grad_norm_limit"]
    assert "warning: spike at step 11: grad norm" in proc.stderr
    before, after, next_one = checkpoint(out, 10), checkpoint(out, 11), checkpoint(out, 12)
    w10, w11, w12 = (load_weights(p / "model.safetensors") for p in (before, after, next_one))
    rows = train_rows(out)
    assert all(math.isfinite(rows[s]["loss"]) for s in (12, 13, 14)) and (out / "final_model").is_dir()
    assert not same_tensors(w11, w12)  # training goes on after it
    assert objects(after, "data")["position"] == objects(before, "data")["position"] + 4  # the batch was read
    if mode == "warn":
        assert not same_tensors(w10, w11) and rows[11]["loss"] is not None
        return
    assert same_tensors(w10, w11)
    # AdamW's moments and step count; its param groups' lr is the schedule's, which moved on
    assert same_tensors(objects(before, "optimizer")["state"], objects(after, "optimizer")["state"])
    assert (objects(before, "scheduler")["last_epoch"], objects(after, "scheduler")["last_epoch"]) == (10, 11)
    assert rows[11]["skipped_steps"] == 1 and rows[11]["loss"] is None  # its only step was skipped
    assert "Step 11: loss=-" in proc.stdout and "| 1 skipped" in proc.stdout
    assert objects(after, "spike_guard")["skipped"] == 1


@pytest.fixture(scope="module")
def rolled_back(tmp_path_factory):
    """One run with spike_guard=rollback and steps 11 and 13 poisoned (patience 2, checkpoints every 5 steps):
    step 13 rolls back to step 10 and skips positions 40 to 52."""
    from tests.conftest import make_subprocess_env

    root = tmp_path_factory.mktemp("rollback")
    data, out = make_shards(root / "data"), root / "out"
    env = dict(make_subprocess_env(), NEOX_DEBUG_POISON_SEQUENCES=f"{STEP_11},{STEP_13}")
    sets = (*GUARD, "spike_guard=rollback", "spike_patience=2", "max_steps=20", "save_steps=5",
            "save_total_limit=5")
    proc = run(train_cmd(out, data, *sets), env)
    return {"root": root, "data": data, "out": out, "sets": sets, "env": env, "proc": proc}


@pytest.mark.slow
def test_rollback_reloads_the_newest_checkpoint_skips_the_data_since_and_finishes(rolled_back):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, proc = rolled_back["out"], rolled_back["proc"]
    assert events(out) == [(11, "skip", None), (13, "skip", None), (13, "rollback", [10, 40, 52])]
    back = [r for r in metrics(out) if r.get("spike/action") == "rollback"][0]
    assert back["spike/checkpoint"] == checkpoint(out, 10).name
    assert "Spike guard: rolled back to" in proc.stdout and "(stream positions 40 to 52) are skipped" in proc.stderr
    rows = train_rows(out)  # the last row of each step: steps 11 to 13 again, after the rollback
    assert sorted(rows) == list(range(1, 21)) and all(math.isfinite(rows[s]["loss"]) for s in rows)
    assert "skipped_steps" not in rows[11]
    after = checkpoint(out, 15)
    assert objects(after, "data")["position"] == 52 + 5 * 4  # 10 steps' data in, then the skip, then 5 steps
    assert objects(after, "spike_guard")["rollbacks"] == [
        {"step": 13, "checkpoint": back["spike/checkpoint"], "to_step": 10, "skipped": [40, 52]}]
    assert (out / "final_model").is_dir() and "spike guard (rollback): 2 spikes" in proc.stdout
    scalars = {}
    for event_file in (out / "logs" / "tensorboard").rglob("events.out.tfevents.*"):
        board = EventAccumulator(str(event_file.parent)).Reload()
        scalars |= {tag: [e.step for e in board.Scalars(tag)] for tag in board.Tags()["scalars"]}
    assert scalars["spike/grad_norm"] == [11, 13] and scalars["spike/skipped_sequences"] == [13]


@pytest.mark.slow
def test_a_resume_from_a_checkpoint_written_after_the_rollback_continues_bitwise(rolled_back, tmp_path):
    out = rolled_back["out"]
    resumed = tmp_path / "resumed"
    run(train_cmd(resumed, rolled_back["data"], *rolled_back["sets"], extra=("--resume", str(checkpoint(out, 15)))),
        rolled_back["env"])
    a, b = train_rows(out), train_rows(resumed)
    assert sorted(b) == list(range(16, 21))
    assert all(a[s]["loss"] == b[s]["loss"] for s in range(16, 21))
    assert same_tensors(load_weights(out / "final_model" / "model.safetensors"),
                        load_weights(resumed / "final_model" / "model.safetensors"))
    assert objects(checkpoint(out, 20), "spike_guard") == objects(checkpoint(resumed, 20), "spike_guard")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_take_the_same_decisions_and_roll_back_together(strategy, rolled_back, tmp_path):
    """The run of `rolled_back` on 2 ranks of 2 sequences each (the same global batch): the same spikes, the
    same rollback and skipped positions, the ranks' weights in sync, the losses of one process (9 s each)."""
    out = tmp_path / strategy
    cmd = [str(REPO_ROOT / "start_training.sh"), "--config", "demo", "--cpu", "--gpus", "2", "--strategy", strategy,
           "--", "--output-dir", str(out), "--data-dir", str(rolled_back["data"])]
    for s in TINY + [s for s in rolled_back["sets"] if not s.startswith("per_device")] + [
            "per_device_train_batch_size=2"]:
        cmd += ["--set", s]
    run(cmd, rolled_back["env"], timeout=600)
    assert events(out) == events(rolled_back["out"]) == [(11, "skip", None), (13, "skip", None),
                                                         (13, "rollback", [10, 40, 52])]
    judged = [[r["spike/loss"] for r in metrics(run_dir) if r.get("spike/action") == "skip"]
              for run_dir in (out, rolled_back["out"])]
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(*judged))  # the loss of all ranks, not rank 0's
    final = [r for r in metrics(out) if r.get("final")][0]
    assert final["weights_in_sync"] is True
    a, b = train_rows(out), train_rows(rolled_back["out"])
    assert all(math.isclose(a[s]["loss"], b[s]["loss"], rel_tol=1e-5) for s in range(1, 21))


@pytest.mark.slow
def test_spikes_that_come_back_after_max_rollbacks_stop_the_run_in_one_line(tmp_path, subprocess_env):
    """Steps 11 to 30 poisoned: the rollback to step 10 skips 2 steps' data and meets the poison again; with
    spike_max_rollbacks=1 the second rollback stops the run before anything more is saved (4 s)."""
    data, out = make_shards(tmp_path / "data"), tmp_path / "out"
    env = dict(subprocess_env, NEOX_DEBUG_POISON_SEQUENCES="40-120")
    proc = run(train_cmd(out, data, *GUARD, "spike_guard=rollback", "spike_patience=2", "spike_max_rollbacks=1",
                         "max_steps=30", "save_steps=10"), env, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "came back after 1 rollback to checkpoint checkpoint-epoch0-step10" in errors[0]
    assert "learning_rate" in errors[0] and "--resume checkpoint-epoch0-step10" in errors[0]
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["checkpoint-epoch0-step10-files0"]
    assert events(out) == [(11, "skip", None), (12, "skip", None), (12, "rollback", [10, 40, 48]),
                           (11, "skip", None), (12, "skip", None)]


@pytest.mark.slow
def test_spikes_before_the_first_checkpoint_are_skipped_and_the_run_goes_on(tmp_path, subprocess_env):
    data, out = make_shards(tmp_path / "data"), tmp_path / "out"
    env = dict(subprocess_env, NEOX_DEBUG_POISON_SEQUENCES=f"{STEP_11},{STEP_13}")
    proc = run(train_cmd(out, data, *GUARD, "spike_guard=rollback", "spike_patience=2", "max_steps=16",
                         "save_steps=100"), env)
    assert "but no checkpoint to roll back to yet; they were skipped and training goes on" in proc.stderr
    assert events(out) == [(11, "skip", None), (13, "skip", None)]
    assert sorted(train_rows(out)) == list(range(1, 17)) and (out / "final_model").is_dir()


BLOWN_UP = ["spike_guard=skip", "learning_rate=1e12", "warmup_steps=0", "max_grad_norm=0", "save_steps=100"]


def _error_line(proc) -> str:
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    return errors[0]


@pytest.mark.slow
def test_a_run_that_skipped_every_step_of_a_spike_window_stops_and_exports_nothing(tmp_path, subprocess_env):
    """spike_guard=skip with an LR that blows the weights up at step 1: every later step is a non-finite
    "spike", skipped. Once spike_window steps in a row were skipped the run stops in one line, non-zero, with no
    final_model/ (it ended "done" with one, having learned nothing)."""
    data, out = make_shards(tmp_path / "data"), tmp_path / "out"
    proc = run(train_cmd(out, data, *BLOWN_UP, "spike_window=4", "max_steps=12"), subprocess_env, check=False)
    line = _error_line(proc)
    assert "the last 4 steps (to step 5, a whole spike_window) were all spikes and skipped" in line, line
    assert "not finite" in line and "learning_rate" in line
    assert not (out / "final_model").exists()


@pytest.mark.slow
def test_a_run_whose_final_validation_loss_is_not_finite_stops_and_exports_nothing(tmp_path, subprocess_env):
    """The same run with a spike_window longer than the run: it reaches its last step with weights that give a
    NaN validation loss; it stops in one line naming it, non-zero, with no final_model/."""
    data, out = make_shards(tmp_path / "data"), tmp_path / "out"
    proc = run(train_cmd(out, data, *BLOWN_UP, "spike_window=50", "max_steps=4"), subprocess_env, check=False)
    line = _error_line(proc)
    assert "val_loss at the last step (4) is nan (not finite)" in line and "nothing is exported" in line, line
    assert not (out / "final_model").exists()
