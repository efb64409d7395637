"""The loop's stateful components, in-process: TrainState, RngState, MetricsWindow, evaluate, StopSignal,
the Checkpointer (save -> restore round trip, host-buffer reuse, retention with a pending upload)."""
from __future__ import annotations

import math
import os
import random
import signal
import time

import numpy as np
import pytest
import torch

from configs import get_model_spec
from utils.training.state import RngState, TrainState


@pytest.fixture(scope="module")
def accelerator():
    os.environ.setdefault("ACCELERATE_USE_CPU", "true")
    from accelerate import Accelerator

    return Accelerator(cpu=True)


class Log:
    def __init__(self):
        self.lines, self.rows = [], []

    def info(self, msg):
        self.lines.append(msg)

    warning = error = info

    def write_row(self, row):
        self.rows.append(row)


def test_train_state_round_trip():
    state = TrainState()
    state.advance(1024)
    state.advance(1024)
    state.best_loss = 2.5
    again = TrainState()
    again.load_state_dict(state.state_dict())
    assert again == state == TrainState(step=2, tokens=2048, best_loss=2.5)


def test_rng_state_round_trip():
    RngState.seed(7)
    saved = RngState.state_dict()
    first = (random.random(), np.random.rand(), torch.rand(3))
    RngState.seed(8)
    RngState.load_state_dict(saved)
    again = (random.random(), np.random.rand(), torch.rand(3))
    assert first[0] == again[0] and first[1] == again[1] and torch.equal(first[2], again[2])


def test_metrics_window_excludes_eval_and_checkpoint_time(accelerator):
    from utils.observe.metrics import MetricsWindow, NonFiniteLoss

    waited = [0.0]  # the loader's own count of its waits
    window = MetricsWindow(accelerator, tokens_per_step=1000, flops_per_token=6e6, peak=1e12, precision="no",
                           data_wait=lambda: waited[0])
    window.restart(first_step=11)
    for loss in (2.0, 4.0):
        time.sleep(0.3)  # an eval or a checkpoint between steps: not counted
        window.begin_step()
        window.add(torch.tensor(loss))
    row = window.row(step=12, tokens=12_000, lr=1e-3, grad_norm=torch.tensor(0.5))
    assert row["loss"] == 3.0 and row["tokens"] == 12_000 and row["grad_norm"] == 0.5
    assert row["steps_per_sec"] > 2 / 0.3 * 10  # the 0.3 s left out of the rate (it would cap it at 6.7/s)
    assert math.isclose(row["mfu"], row["tokens_per_sec"] * 6e6 / 1e12)
    assert window.first_step == 13 and window.losses == []  # a fresh window
    time.sleep(0.3)  # the loop waits for the next step's files between steps (ResumableLoader.unavailable)
    waited[0] += 0.3
    window.begin_step()
    window.add(torch.tensor(1.0))
    window.add(torch.tensor(float("nan")))
    assert window.data_wait_s == 0.3 and window.window_s >= 0.3  # a wait for data is training time, and said
    with pytest.raises(NonFiniteLoss, match="non-finite loss at step 14"):
        window.checked_losses()


def test_a_skipped_step_counts_for_time_but_not_for_the_loss_or_the_finite_check(accelerator):
    from utils.observe.metrics import MetricsWindow, format_step_line

    window = MetricsWindow(accelerator, tokens_per_step=1000, flops_per_token=6e6, peak=None, precision="no")
    window.add(torch.tensor(2.0))
    window.add(torch.tensor(float("nan")), skipped=True)  # a non-finite step the spike guard skipped
    window.add(torch.tensor(4.0))
    row = window.row(step=3, tokens=3000, lr=1e-3, grad_norm=torch.tensor(0.5))
    assert row["loss"] == 3.0 and row["skipped_steps"] == 1 and row["tokens_per_sec"] > 0
    assert "| 1 skipped" in format_step_line(row, best=3.0)
    window.add(torch.tensor(9.0), skipped=True)
    row = window.row(step=4, tokens=4000, lr=1e-3, grad_norm=torch.tensor(0.5))
    assert math.isnan(row["loss"]) and "loss=-" in format_step_line(row, best=3.0)
    window.add(torch.tensor(1.0))
    assert "skipped_steps" not in window.row(step=5, tokens=5000, lr=1e-3, grad_norm=torch.tensor(0.5))


def test_evaluate_is_the_mean_batch_loss(accelerator):
    from utils.evals.validation import evaluate
    from utils.model import build_model

    model = build_model(get_model_spec("tiny"), seed=0)
    batches = [torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    with torch.no_grad():
        expected = sum(model(b).item() for b in batches) / 3
    assert math.isclose(evaluate(model, batches, accelerator), expected, rel_tol=1e-6)
    assert model.training and evaluate(model, [], accelerator) is None


def test_stop_signal_stops_at_the_step_boundary():
    from utils.runtime.signals import StopSignal

    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        stop = StopSignal(distributed=False)
        assert not stop.agreed()
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.agreed() and stop.reason == "SIGTERM"
    finally:
        signal.signal(signal.SIGTERM, before[0])
        signal.signal(signal.SIGINT, before[1])


def _objects(seed: int):
    from configs import get_training_config
    from utils.model import build_model
    from utils.training.lr_scheduler import build_scheduler
    from utils.training.optim import OptimizerSettings, build_optimizer
    from utils.training.schedules import ScheduleSettings

    cfg = get_training_config("demo", {"model": "tiny", "warmup_steps": 2})
    model = build_model(get_model_spec("tiny"), seed=seed)
    optimizer = build_optimizer(model, OptimizerSettings.of(cfg), fused=False)
    return cfg, model, optimizer, build_scheduler(optimizer, ScheduleSettings.of(cfg))


def test_checkpointer_round_trip_reuses_host_buffers(accelerator, tmp_path):
    from utils.checkpoint.checkpointer import Checkpointer, CheckpointPolicy
    from utils.checkpoint.run_record import RunRecord

    cfg, model, optimizer, scheduler = _objects(seed=1)
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    log = Log()
    state = TrainState()
    run = RunRecord(1, "ddp", 2, 16, cfg.to_dict(), get_model_spec("tiny").to_dict(), {"sha256": "x"}, 10)
    policy = CheckpointPolicy(tmp_path / "checkpoints", every=2, keep=2)

    def checkpointer(model, optimizer, scheduler, state):
        states = {"model": model, "optimizer": optimizer, "train": state, "scheduler": scheduler}
        return Checkpointer(accelerator, states, policy, run, lambda: f"checkpoint-epoch0-step{state.step}-files0", log)

    ckpt = checkpointer(model, optimizer, scheduler, state)
    saved = []
    for step in (1, 2, 3, 4, 5):
        model(ids).backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        state.advance(32)
        assert ckpt.due(step) == (step in (2, 4))  # every 2 steps
        if not ckpt.due(step, last=step == 5):  # and always at the session's last step
            continue
        path = ckpt.save(step)
        assert log.rows[-1]["checkpoint"] == path.name and log.rows[-1]["blocked_s"] < 5.0
        if step == 2:
            first_alloc = ckpt.buffers.allocated_bytes
            pointers = {k: v.data_ptr() for k, v in ckpt.buffers._pool.items()}
        if path:
            saved.append(path)
    ckpt.wait()
    assert ckpt.buffers.allocated_bytes == first_alloc > 0  # nothing allocated after the first save
    assert ckpt.buffers.reused_bytes == 2 * first_alloc
    assert {k: v.data_ptr() for k, v in ckpt.buffers._pool.items()} == pointers
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [p.name for p in saved[1:]]  # keep=2
    assert ckpt.close() == 0

    _, fresh, fresh_opt, fresh_sched = _objects(seed=2)
    restored = TrainState()
    checkpointer(fresh, fresh_opt, fresh_sched, restored).restore(saved[-1])
    assert restored == state
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    assert fresh_sched.state_dict()["last_epoch"] == 5
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])
    assert any("Resumed from" in line for line in log.lines)


def test_closing_summary_reads_the_whole_run_from_metrics_jsonl(tmp_path, accelerator):
    """The step and tokens reached, this session's tok/s and MFU from the window's counters, first/last val
    loss with the change (a resumed session's rewritten step counts once; a crashed session's rows past
    the step reached do not count; a torn last line is skipped), the checkpoint and the model."""
    import json

    from utils.observe.metrics import MetricsWindow, closing_summary

    rows = [{"step": 0, "tokens": 0, "val_loss": 8.0},
            {"step": 10, "tokens": 1000, "loss": 7.0, "tokens_per_sec": 100.0, "mfu": 0.2},
            {"step": 20, "tokens": 2000, "val_loss": 9.0},  # crashed session
            {"step": 20, "tokens": 2000, "val_loss": 6.0},  # its resume
            {"step": 30, "tokens": 3000, "val_loss": 1.0}]  # a crashed session's, past the step reached
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3')
    window = MetricsWindow(accelerator, tokens_per_step=100, flops_per_token=6e6, peak=1e12, precision="no")
    window.restart(first_step=1)
    for _ in range(4):
        window.add(torch.tensor(1.0))
    text = closing_summary(path, step=22, tokens=2200, session_s=12.0, window=window, checkpoint=tmp_path / "ck",
                           final_model=tmp_path / "final_model")
    tokens, seconds, tps, util = window.session()
    assert tokens == 400 and tps == 400 / seconds and util == tps * 6e6 / 1e12
    assert text.splitlines()[0] == (f"Summary: 22 steps, 2,200 tokens; this session 12 s, 400 tokens trained in "
                                    f"{seconds:,.1f} s of training steps (eval, samples and checkpoints left out): "
                                    f"{tps:,.0f} tok/s, MFU {100 * util:.1f}%")
    assert "val_loss 8.0000 at step 0 -> 6.0000 at step 20 (-25.0%)" in text
    assert f"checkpoint: {tmp_path / 'ck'}" in text and f"model: {tmp_path / 'final_model'}" in text
