"""Hardening, third pass (issue 26), settings: numbers that cannot train are refused from their declared
ranges; a resume follows the settings it is given (or refuses them); mixtures refuse sources they cannot mix
(another tokenizer, a name given twice, an empty folder under the demo) and a source deleted between runs can
be dropped; a config file's advice, run name and precision read right. Numbers are typed through train.py as
a user types them; the rest in-process where the code is a function."""
from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from configs.model_config import ConfigError
from configs.training_config import TrainingConfig, get_training_config, parse_overrides, read_config_file
from tests.trainkit import REPO_ROOT, TINY, load_weights, make_shards, run, train_cmd, train_rows


def one_error_line(proc) -> str:
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, proc.stderr
    return lines[0]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return make_shards(tmp_path_factory.mktemp("settings") / "data", n_files=3, rows=16)


# ------------------------------------------------------------------------------ 6: settings on resume

def test_a_restored_scheduler_and_optimizer_follow_this_runs_config():
    """The schedule is rebuilt from the config at the restored step (not the checkpoint's base LR), AdamW's
    hyperparameters are the config's, and bf16 moments stay bf16 through a restore."""
    from utils.optim import BF16MomentAdamW, build_optimizer, build_scheduler, schedule_from_config

    old = get_training_config("demo", {"model": "tiny", "warmup_steps": 2, "max_steps": 10})
    new = get_training_config("demo", {"model": "tiny", "warmup_steps": 2, "max_steps": 10, "learning_rate": 1e-9})
    model = torch.nn.Linear(4, 4)
    opt = build_optimizer(model, old, fused=False)
    sched = build_scheduler(opt, old)
    for _ in range(3):
        model(torch.ones(1, 4)).sum().backward()
        opt.step()
        sched.step()
    opt2 = build_optimizer(torch.nn.Linear(4, 4), new, fused=False)
    sched2 = build_scheduler(opt2, new)
    opt2.load_state_dict(opt.state_dict())
    sched2.load_state_dict(sched.state_dict())
    new_lr, old_lr = schedule_from_config(new), schedule_from_config(old)
    assert [g["lr"] for g in opt2.param_groups] == [new_lr(4)] * 2 and new_lr(4) < old_lr(4) * 1e-5
    opt2.step()
    sched2.step()
    assert [g["lr"] for g in opt2.param_groups] == sched2.get_last_lr() == [new_lr(5)] * 2

    half = get_training_config("demo", {"model": "tiny", "optimizer_state_dtype": "bf16"})
    bf16 = build_optimizer(torch.nn.Linear(4, 4), half, fused=False)
    assert isinstance(bf16, BF16MomentAdamW)
    bf16.load_state_dict(opt.state_dict())  # torch's AdamW (fp32 moments) -> bf16 moments
    assert {s["exp_avg"].dtype for s in bf16.state.values()} == {torch.bfloat16}
    again = build_optimizer(torch.nn.Linear(4, 4), half, fused=False)
    again.load_state_dict(bf16.state_dict())
    assert {s["exp_avg_sq"].dtype for s in again.state.values()} == {torch.bfloat16}


@pytest.mark.slow
def test_a_resume_applies_a_changed_learning_rate_and_refuses_another_seed(tmp_path, subprocess_env, shards):
    """2 steps, stop; --resume with learning_rate=1e-9 (and adam_beta2=0.9): one line each says so, the rows'
    lr is the new schedule's, the optimizer really used it (its saved LR and betas; the weights barely move)
    and nothing else changed. Another seed is refused in one line (13 s)."""
    from safetensors.torch import load_file

    from utils.optim import schedule_from_config

    out = tmp_path / "out"
    sets = ("max_steps=4", "save_steps=100")
    run(train_cmd(out, shards, *sets, "stop_at_step=2"), subprocess_env)
    proc = run(train_cmd(out, shards, *sets, "seed=7", extra=("--resume", "latest")), subprocess_env, check=False)
    assert "was trained with seed=42 but this run has seed=7" in one_error_line(proc)

    changed = ("learning_rate=1e-9", "adam_beta2=0.9")
    proc = run(train_cmd(out, shards, *sets, *changed, extra=("--resume", "latest")), subprocess_env)
    assert "resume: learning_rate changed 0.003 -> 1e-09: the LR schedule follows the new value from step 3" \
        in proc.stdout
    assert "resume: adam_beta2 changed 0.95 -> 0.9: AdamW follows the new value from step 3" in proc.stdout
    assert proc.stdout.count("resume: ") == 2
    schedule = schedule_from_config(get_training_config("demo", parse_overrides(TINY + list(sets + changed))))
    rows = train_rows(out)
    assert [rows[s]["lr"] for s in (3, 4)] == [schedule(3), schedule(4)]
    final = next((out / "checkpoints").glob("checkpoint-*-step4-*"))
    assert torch.load(final / "scheduler.pt", weights_only=True)["_last_lr"][0] == schedule(5)
    groups = torch.load(final / "optimizer.pt", weights_only=True)["param_groups"]
    assert [tuple(g["betas"]) for g in groups] == [(0.9, 0.9)] * 2 and groups[0]["eps"] == 1e-8
    before = load_file(str(next((out / "checkpoints").glob("checkpoint-*-step2-*")) / "model.safetensors"))
    after = load_file(str(final / "model.safetensors"))
    moved = max((after[k] - before[k]).abs().max().item() for k in before)
    assert 0 < moved < 1e-6  # two AdamW steps at ~1e-9 (at 3e-3 they move weights by ~1e-3)
