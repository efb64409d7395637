"""The training loop, run for real on tiny data: accumulation math, the LR schedule, errors, outputs."""
from __future__ import annotations

import math
import re

import pytest
import torch

from configs import get_model_spec, get_training_config, parse_overrides
from tests.trainkit import PINNED, TINY, load_weights, make_shards, metrics, run, train_cmd, train_rows
from utils.model import build_model
from utils.observe.metrics import METRIC_KEYS
from utils.training.schedules import ScheduleSettings


def _without_key_bias(name: str, tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """The key part of the fused QKV bias has an exactly zero true gradient (softmax ignores a constant
    added to every score), so Adam turns its float noise into +-lr steps; compare the rest."""
    if name.endswith("query_key_value.bias"):
        return tensor.view(heads, 3, -1)[:, [0, 2], :].reshape(-1)
    return tensor


@pytest.mark.slow
def test_accumulation_matches_one_big_batch(tmp_path, subprocess_env):
    """fp32 on CPU: one step of micro-batch 2 x accumulation 4 == micro-batch 8 x accumulation 1."""
    data = make_shards(tmp_path / "data")
    outs = {}
    for micro, accum in ((2, 4), (8, 1)):
        out = tmp_path / f"m{micro}a{accum}"
        run(train_cmd(out, data, f"per_device_train_batch_size={micro}",
                      f"gradient_accumulation_steps={accum}", "max_steps=1", "save_steps=100"), subprocess_env)
        outs[micro] = out
    a, b = train_rows(outs[2])[1], train_rows(outs[8])[1]
    assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5)
    assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-5)
    wa = load_weights(outs[2] / "final_model" / "model.safetensors")
    wb = load_weights(outs[8] / "final_model" / "model.safetensors")
    init = build_model(get_model_spec("tiny"), seed=42).state_dict()
    init["embed_out.weight"] = init.pop("lm_head.weight")  # save_pretrained keeps GPT-NeoX's legacy name
    assert wa.keys() == wb.keys() == init.keys()
    heads = get_model_spec("tiny").num_attention_heads
    diff2 = norm2 = 0.0
    for name in wa:
        x, y = _without_key_bias(name, wa[name], heads), _without_key_bias(name, wb[name], heads)
        rel = ((x - y).norm() / y.norm().clamp_min(1e-30)).item()
        assert rel <= 1e-5, (name, rel)
        diff2 += (wa[name] - wb[name]).norm().item() ** 2
        norm2 += wb[name].norm().item() ** 2
    assert (diff2 / norm2) ** 0.5 <= 1e-6
    moved = sum((wb[k] - init[k]).norm().item() ** 2 for k in wb) ** 0.5
    assert moved > 1e3 * diff2 ** 0.5  # the step really changed the weights, far beyond the mismatch


@pytest.mark.slow
@pytest.mark.parametrize("accum", [1, 4])
def test_logged_lr_equals_lr_at(tmp_path, subprocess_env, accum):
    data = make_shards(tmp_path / "data")
    sets = [f"gradient_accumulation_steps={accum}", "per_device_train_batch_size=2", "max_steps=8",
            "warmup_steps=3", "save_steps=100"]
    out = tmp_path / "out"
    run(train_cmd(out, data, *sets), subprocess_env)
    cfg = get_training_config("demo", parse_overrides(TINY + sets))
    schedule = ScheduleSettings.of(cfg).lr
    rows = train_rows(out)
    assert sorted(rows) == list(range(1, 9))
    for step, row in rows.items():
        assert math.isclose(row["lr"], schedule(step), rel_tol=1e-12), (step, row["lr"], schedule(step))
    # and the optimizer really used it: the scheduler state in the final checkpoint is at step 8
    ckpt = next((out / "checkpoints").glob("checkpoint-*-step8-*"))
    sched = torch.load(ckpt / "scheduler.pt", weights_only=True)
    assert sched["last_epoch"] == 8 and math.isclose(sched["_last_lr"][0], schedule(9), rel_tol=1e-12)


@pytest.mark.slow
def test_run_writes_logs_metrics_tensorboard_and_export(tmp_path, subprocess_env):
    data = make_shards(tmp_path / "data")
    out = tmp_path / "out"
    proc = run(train_cmd(out, data, "per_device_train_batch_size=4", "max_steps=4", "save_steps=2",
                        "eval_interval=2"), subprocess_env)
    assert "Step 4: loss=" in proc.stdout and "steps/sec" in proc.stdout and "tok/s" in proc.stdout
    # output to a file (not a terminal): no progress-bar fragments, so every line is whole
    assert "\r" not in proc.stdout + proc.stderr and "it/s]" not in proc.stdout + proc.stderr
    log_text = (out / "logs" / "training.log").read_text()
    assert "Step 4: loss=" in log_text
    rows = metrics(out)
    train = [r for r in rows if "loss" in r]
    for key in METRIC_KEYS + ("data_wait_frac", "steps_per_sec"):
        assert key in train[-1], key
    assert train[-1]["mfu"] is None  # CPU: peak unknown
    assert train[-1]["tokens"] == 4 * 4 * 64  # steps x global batch (4 x 1 x 1) x seq_len
    evals = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in evals] == [0, 2, 4]
    assert list((out / "logs" / "tensorboard").glob("events.out.tfevents.*"))
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == ["checkpoint-epoch0-step2-files0", "checkpoint-epoch0-step4-files0"]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "final_model")
    assert model.config.model_type == "gpt_neox" and model.config.vocab_size == 512
    # shards without a tokenizer.json (as a streamed dataset prepared elsewhere may be): said, not silent
    assert not (out / "final_model" / "tokenizer.json").exists()
    assert re.search(r"no tokenizer\.json in .*final_model has none: AutoTokenizer cannot load it", log_text)


@pytest.mark.slow
def test_how_cpu_threads_wait_reaches_openmp_says_why_and_changes_no_loss(tmp_path, subprocess_env):
    """Two threads on two CPUs (the demo's model, so its matrix products really are split), once with the engine's
    wait beside a busy loop on the same CPUs (so the threads keep to one core while it runs: cpu_share.py) and once
    with the user's OMP_WAIT_POLICY=PASSIVE: libgomp starts with each (its OMP_DISPLAY_ENV report), the run's first
    lines say which and why, and the losses and gradient norms are the same bit for bit."""
    import os
    import subprocess
    import sys
    import time

    from utils.runtime.threads import SPINCOUNT

    cpus = sorted(os.sched_getaffinity(0))[:2]
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    data = make_shards(tmp_path / "data")
    sets = ("model=demo", "seq_len=64", "per_device_train_batch_size=16", "max_steps=6", "save_steps=100")
    env = dict(subprocess_env, OMP_NUM_THREADS="2", OMP_DISPLAY_ENV="VERBOSE")
    pinned = [sys.executable, "-c", PINNED, ",".join(map(str, cpus))]
    # the busy loop until the run says its threads keep to one core (then the cores are free again: they spread)
    loop = subprocess.Popen(pinned + [sys.executable, "-c", "while True: pass"], start_new_session=True)
    said = tmp_path / "engine" / "logs" / "training.log"
    with open(tmp_path / "engine.out", "w") as out, open(tmp_path / "engine.err", "w") as err:
        proc = subprocess.Popen(pinned + train_cmd(tmp_path / "engine", data, *sets), env=env, stdout=out,
                                stderr=err, text=True)
        try:
            deadline = time.monotonic() + 300
            while proc.poll() is None and time.monotonic() < deadline and not (
                    said.is_file() and "sharing the cores: other programs use" in said.read_text()):
                time.sleep(0.1)
        finally:
            loop.kill()
            loop.wait()
        assert proc.wait(timeout=600) == 0, (tmp_path / "engine.err").read_text()[-3000:]
    engine = subprocess.CompletedProcess(proc.args, 0, (tmp_path / "engine.out").read_text(),
                                         (tmp_path / "engine.err").read_text())
    users = run(pinned + train_cmd(tmp_path / "users", data, *sets), dict(env, OMP_WAIT_POLICY="PASSIVE"))

    assert f"GOMP_SPINCOUNT = '{SPINCOUNT}'" in engine.stderr, engine.stderr[-3000:]
    assert "OMP_WAIT_POLICY = 'PASSIVE'" in users.stderr and "GOMP_SPINCOUNT = '0'" in users.stderr
    assert (f"cpu threads: 2 per process (OMP_NUM_THREADS=2, yours); waiting: spin {SPINCOUNT:,} times, then sleep "
            f"(GOMP_SPINCOUNT={SPINCOUNT}, the engine's default") in engine.stdout
    assert "sharing the cores: while other programs use 0.5+ of them" in engine.stdout
    assert "sharing the cores: other programs use " in engine.stdout and "keep to 1 of them" in engine.stdout, \
        engine.stdout[-3000:]  # the busy loop: the threads kept to one core
    users_log = (tmp_path / "users" / "logs" / "training.log").read_text()
    assert ("cpu threads: 2 per process (OMP_NUM_THREADS=2, yours); waiting: OMP_WAIT_POLICY=PASSIVE (yours); "
            "sharing the cores: off (OMP_WAIT_POLICY is yours)") in users_log
    a, b = train_rows(tmp_path / "engine"), train_rows(tmp_path / "users")
    assert sorted(a) == sorted(b) == list(range(1, 7))
    assert [(r["loss"], r["grad_norm"]) for r in a.values()] == [(r["loss"], r["grad_norm"]) for r in b.values()]


def _one_error_line(proc) -> str:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_unknown_set_key(tmp_path, subprocess_env):
    proc = run(train_cmd(tmp_path / "o", tmp_path / "d", "not_a_field=3"), subprocess_env, check=False)
    assert "not_a_field" in _one_error_line(proc) and proc.returncode == 2


def test_unknown_preset(tmp_path, subprocess_env):
    proc = run(train_cmd(tmp_path / "o", tmp_path / "d", config="prodution"), subprocess_env, check=False)
    assert "valid configs: cpu, demo, production, test" in _one_error_line(proc)


def test_missing_data_dir(tmp_path, subprocess_env):
    missing = tmp_path / "nowhere"
    proc = run(train_cmd(tmp_path / "o", missing, "demo_data=false"), subprocess_env, check=False)
    line = _one_error_line(proc)
    assert str(missing) in line and "download_training_data.py" in line
    assert (tmp_path / "o" / ".run.lock").read_text() == ""  # released at exit: the next run takes nothing over


@pytest.mark.slow
def test_nonfinite_loss_stops_naming_the_step(tmp_path, subprocess_env):
    data = make_shards(tmp_path / "data")
    out = tmp_path / "out"
    proc = run(train_cmd(out, data, "learning_rate=1e12", "warmup_steps=0", "max_grad_norm=0",
                         "max_steps=6", "save_steps=1", "logging_steps=3"), subprocess_env, check=False)
    line = _one_error_line(proc)
    assert "non-finite loss at step" in line
    bad_step = int(re.search(r"non-finite loss at step (\d+)", line).group(1))
    saved = [int(p.name.split("-step")[1].split("-")[0]) for p in (out / "checkpoints").glob("checkpoint-*")]
    assert all(s < bad_step for s in saved), (saved, bad_step)


@pytest.mark.slow
def test_on_a_terminal_the_bar_names_the_setup_phases_and_lines_are_never_glued_to_it(tmp_path, subprocess_env):
    """On a terminal (a pseudo-terminal from `script`) the progress bar says which setup phase the run is in
    (preflight, eval) before it counts steps, and every log line starts on a line of its own."""
    import shlex
    import shutil
    import subprocess

    from tests.trainkit import REPO_ROOT

    if shutil.which("script") is None:
        pytest.skip("needs util-linux's script for a pseudo-terminal")
    data = make_shards(tmp_path / "data")
    cmd = train_cmd(tmp_path / "out", data, "max_steps=3", "save_steps=100")
    proc = subprocess.run(["script", "-qec", "stty cols 120 rows 40; " + shlex.join(cmd), "/dev/null"],
                          env=subprocess_env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    screen = proc.stdout
    assert "setup: preflight" in screen and "setup: eval" in screen and "train:" in screen
    for line in ("Preflight: 2 forward/backward", "Step 0: val_loss=", "Step 3: loss="):
        at = screen.index(line)
        assert screen[at - 1] in "\r\n", repr(screen[max(0, at - 80):at + 20])


def test_a_batch_beyond_the_machine_s_memory_is_one_line_before_the_model_is_built(tmp_path, subprocess_env):
    """A micro-batch whose activations alone exceed this machine's RAM: one line naming the batch, the plan's
    figure and what to do, exit 2, before anything is allocated (the kernel used to kill it without a line).
    A batch that fits by the plan is not refused (the same run at micro-batch 4 trains)."""
    from utils.model.fit import machine_bytes

    data = make_shards(tmp_path / "data")
    spec = get_model_spec("tiny")
    per_sequence = 34 * 64 * spec.hidden_size * spec.num_hidden_layers  # bf16 activation bytes of one sequence
    too_many = int(2 * machine_bytes() / per_sequence)
    out = tmp_path / "out"
    proc = run(train_cmd(out, data, "seq_len=64", f"per_device_train_batch_size={too_many}", "max_steps=1"),
               subprocess_env, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and f"per_device_train_batch_size={too_many} at seq_len 64 cannot fit" in lines[0], lines
    assert "this machine's RAM" in lines[0] and "gradient_accumulation_steps" in lines[0]
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())
    run(train_cmd(tmp_path / "ok", data, "seq_len=64", "per_device_train_batch_size=4", "max_steps=1"), subprocess_env)
