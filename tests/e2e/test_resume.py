"""Checkpoints end to end: exact resume, SIGTERM, uploads to a real GCS emulator, resume from GCS."""
from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest
import torch

from tests.trainkit import REPO_ROOT, load_weights, make_shards, metrics, run, train_cmd, train_rows

COMMON = ("per_device_train_batch_size=4", "gradient_accumulation_steps=2", "max_steps=8", "save_steps=4",
          "dataloader_num_workers=2")


def _final_weights(out):
    return load_weights(out / "final_model" / "model.safetensors")


@pytest.mark.slow
def test_exact_resume_bitwise(tmp_path, subprocess_env):
    """8 steps straight == 4 steps, stop, --resume latest, 4 more: identical losses and weights (bitwise)."""
    data = make_shards(tmp_path / "data")
    straight, split = tmp_path / "straight", tmp_path / "split"
    run(train_cmd(straight, data, *COMMON), subprocess_env)
    first = run(train_cmd(split, data, *COMMON, "stop_at_step=4"), subprocess_env)
    assert "Stopped by stop_at_step after step 4" in first.stdout
    assert not (split / "final_model").exists()
    second = run(train_cmd(split, data, *COMMON, extra=("--resume", "latest")), subprocess_env)
    assert "Resumed from" in second.stdout and "at step 4" in second.stdout

    a, b = train_rows(straight), train_rows(split)
    assert sorted(b) == list(range(1, 9))
    for step in range(1, 9):
        assert a[step]["loss"] == b[step]["loss"], (step, a[step]["loss"], b[step]["loss"])
        assert a[step]["lr"] == b[step]["lr"] and a[step]["tokens"] == b[step]["tokens"]
    wa, wb = _final_weights(straight), _final_weights(split)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # the resumed run continued the logs rather than starting new ones
    assert (split / "logs" / "training.log").read_text().count("Training demo") == 2
    state = json.loads((split / "checkpoints" / "checkpoint-epoch0-step8-files1" / "trainer_state.json").read_text())
    assert state["step"] == 8 and state["tokens"] == 8 * 8 * 64 and state["world_size"] == 1


@pytest.mark.slow
def test_sigterm_saves_and_resume_continues(tmp_path, subprocess_env):
    data = make_shards(tmp_path / "data")
    out = tmp_path / "out"
    cmd = train_cmd(out, data, "per_device_train_batch_size=2", "max_steps=100000", "save_steps=100000")
    proc = subprocess.Popen(cmd, env=subprocess_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        rows = (out / "logs" / "metrics.jsonl")
        if rows.exists() and sum('"loss"' in line for line in rows.read_text().splitlines()) >= 3:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    line = next(ln for ln in stdout.splitlines() if ln.startswith("Stopped by SIGTERM after step"))
    stopped = int(line.split("after step ")[1].split(":")[0])
    assert stopped >= 3
    ckpt = out / "checkpoints" / line.split("checkpoint ")[1].strip().split("/")[-1]
    assert ckpt.exists() and f"-step{stopped}-" in ckpt.name
    resumed = run(train_cmd(out, data, "per_device_train_batch_size=2", "max_steps=100000",
                            "save_steps=100000", f"stop_at_step={stopped + 2}", extra=("--resume", "latest")),
                  subprocess_env)
    assert f"at step {stopped}" in resumed.stdout
    assert max(train_rows(out)) == stopped + 2


@pytest.mark.slow
def test_upload_to_emulator_and_resume_from_gcs(tmp_path, subprocess_env, gcs_emulator):
    data = make_shards(tmp_path / "data")
    out = tmp_path / "out"
    sets = ("per_device_train_batch_size=2", "max_steps=4", "save_steps=2", f"gcs_bucket={gcs_emulator.bucket}",
            "gcs_prefix=runs", "run_name=r1")
    subprocess_env["STORAGE_EMULATOR_HOST"] = gcs_emulator.url
    run(train_cmd(out, data, *sets, "stop_at_step=2"), subprocess_env)
    client = gcs_emulator.client()
    names = {b.name for b in client.list_blobs(gcs_emulator.bucket, prefix="runs/checkpoints/r1/")}
    prefix = "runs/checkpoints/r1/checkpoint-epoch0-step2-files0/"
    assert prefix + "manifest.json" in names and prefix + "model.safetensors" in names
    from utils.io.storage import file_crc32c

    local = out / "checkpoints" / "checkpoint-epoch0-step2-files0"
    for f in local.iterdir():
        blob = client.bucket(gcs_emulator.bucket).get_blob(prefix + f.name)
        assert blob is not None and blob.crc32c == file_crc32c(f), f.name

    # a machine with no local checkpoint resumes from GCS
    fresh = tmp_path / "fresh"
    proc = run(train_cmd(fresh, data, *sets, extra=("--resume", "latest")), subprocess_env)
    assert "at step 2" in proc.stdout
    assert (fresh / "checkpoints" / "checkpoint-epoch0-step4-files0").exists()
    assert max(train_rows(fresh)) == 4


@pytest.mark.slow
def test_upload_failure_keeps_training_and_exits_nonzero(tmp_path, subprocess_env, gcs_emulator):
    data = make_shards(tmp_path / "data")
    out = tmp_path / "out"
    subprocess_env["STORAGE_EMULATOR_HOST"] = gcs_emulator.url
    gcs_emulator.stop()  # the bucket is unreachable for the whole run
    proc = run(train_cmd(out, data, "per_device_train_batch_size=2", "max_steps=4", "save_steps=2",
                         f"gcs_bucket={gcs_emulator.bucket}", "run_name=r2"), subprocess_env, check=False,
               timeout=600)
    assert proc.returncode == 1, proc.stderr
    assert max(train_rows(out)) == 4  # training went on
    assert "upload of gs://test-bucket/checkpoints/r2/checkpoint-epoch0-step4-files0 failed" in proc.stderr
    from utils.checkpoint.format import verify_checkpoint

    for name in ("checkpoint-epoch0-step2-files0", "checkpoint-epoch0-step4-files0"):
        verify_checkpoint(out / "checkpoints" / name)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_checkpoint_of_the_previous_engine_resumes_exactly(strategy, tmp_path, subprocess_env):
    """A checkpoint written by the engine before the Checkpointer took one `states` mapping, a policy and a
    typed run record, before the parallelism seam and before the `optimizer` field (commit f282397: its record
    has none; AdamW was the only optimizer), DDP's and FSDP's alike, of a run on the demo preset's own recipe
    (AdamW at 2e-3 then, Muon at 8e-3 now), resumes on today's code with the command that started it and
    continues the old engine's uninterrupted run: the same losses and final weights. The recipe kept is said in
    one line, and the warmup warning (30 warmup steps of 4) once, with the rate the run trains at."""

    from tests.trainkit import demo_recipe_cmd, engine_at

    old = engine_at("f282397", tmp_path / "old-engine")
    data = make_shards(tmp_path / "data")
    sets = ("per_device_train_batch_size=4", "max_steps=4", "save_steps=2", f"strategy={strategy}")
    old_env = dict(subprocess_env, PYTHONPATH=str(old))

    def old_engine(out, *more):
        return run(demo_recipe_cmd(old, out, data, *sets, *more), old_env)

    split, straight = tmp_path / "split", tmp_path / "straight"
    old_engine(split, "stop_at_step=2")
    old_engine(straight)
    saved = json.loads(next((split / "checkpoints").iterdir()).joinpath("trainer_state.json").read_text())
    assert "optimizer" not in saved["config"] and saved["config"]["learning_rate"] == 0.002
    proc = run(demo_recipe_cmd(REPO_ROOT, split, data, *sets, extra=("--resume", "latest")), subprocess_env)
    assert "Resumed from" in proc.stdout and "at step 2" in proc.stdout
    assert ("resume: the run continues the recipe it started with (optimizer=adamw, learning_rate=0.002); 'demo' "
            "now says optimizer=muon, learning_rate=0.008" in proc.stdout), proc.stdout
    warned = [line for line in proc.stderr.splitlines() if "warmup_steps=30 exceeds" in line]
    assert len(warned) == 1 and "learning_rate=0.002" in warned[0], proc.stderr
    resumed, reference = train_rows(split), train_rows(straight)
    for step in (3, 4):
        assert abs(resumed[step]["loss"] - reference[step]["loss"]) <= 1e-6, step
        assert resumed[step]["lr"] == reference[step]["lr"], step
    a, b = _final_weights(split), _final_weights(straight)
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6, rtol=0) for k in a)


@pytest.mark.slow
def test_a_run_started_under_the_demo_presets_adamw_resumes_with_it_after_the_preset_moved_to_muon(
        tmp_path, subprocess_env):
    """The demo preset trained AdamW at 2e-3 until commit c64c1e0, and Muon at 8e-3 after. A run the earlier
    engine started with `--config demo` (the preset's recipe: neither set on the command) resumes on today's
    code with the same command and continues it exactly: the checkpoint's optimizer and rate, one line saying
    so, the losses of the earlier engine's uninterrupted run; what the command sets itself still follows."""
    import sys

    from tests.trainkit import TINY, engine_at

    old = engine_at("c64c1e0", tmp_path / "old-engine")
    data = make_shards(tmp_path / "data")
    tiny = [s for s in TINY if not s.startswith(("learning_rate=", "optimizer="))]  # the preset's recipe
    sets = [*tiny, "per_device_train_batch_size=4", "max_steps=4", "save_steps=2"]

    def command(engine, out, *more):
        cmd = [sys.executable, str(engine / "train.py"), "--config", "demo", "--output-dir", str(out),
               "--data-dir", str(data)]
        return cmd + [a for s in [*sets, *more] for a in ("--set", s)]

    old_env = dict(subprocess_env, PYTHONPATH=str(old))
    split, straight = tmp_path / "split", tmp_path / "straight"
    run(command(old, split, "stop_at_step=2"), old_env)
    run(command(old, straight), old_env)
    proc = run(command(REPO_ROOT, split) + ["--resume", "latest"], subprocess_env)
    assert ("resume: the run continues the recipe it started with (optimizer=adamw, learning_rate=0.002); "
            "'demo' now says optimizer=muon, learning_rate=0.008") in proc.stdout, proc.stdout
    resumed, reference = train_rows(split), train_rows(straight)
    for step in (3, 4):
        assert abs(resumed[step]["loss"] - reference[step]["loss"]) <= 1e-6, step
        assert resumed[step]["lr"] == reference[step]["lr"]
    a, b = _final_weights(split), _final_weights(straight)
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6, rtol=0) for k in a)
    state = json.loads((split / "checkpoints" / "checkpoint-epoch0-step4-files0" / "trainer_state.json").read_text())
    assert (state["config"]["optimizer"], state["config"]["learning_rate"]) == ("adamw", 0.002)
    # a field the command sets follows (from the step-2 checkpoint again, in a copy of the folder)
    import shutil

    again = tmp_path / "again"
    shutil.copytree(split, again)
    shutil.rmtree(again / "checkpoints" / "checkpoint-epoch0-step4-files0")
    shutil.rmtree(again / "final_model")
    proc = run(command(REPO_ROOT, again, "learning_rate=1e-3", "max_grad_norm=0.5") + ["--resume", "latest"],
               subprocess_env)
    assert "recipe it started with (optimizer=adamw); 'demo' now says optimizer=muon" in proc.stdout, proc.stdout
    assert "resume: learning_rate changed 0.002 -> 0.001" in proc.stdout
    assert "resume: max_grad_norm changed 1 -> 0.5: gradient clipping follows the new value from step 3" in proc.stdout


def test_every_row_says_how_many_steps_it_averages_across_a_resume(tmp_path, subprocess_env):
    """logging_steps=4, a stop at step 6 and a resume to 10: each training row's `window_steps` is the number
    of steps it averages: 4 at step 4; at step 8 only 7-8 (steps 5-6 were trained before the stop, which
    writes no row), 2; at the last step 2. The short first window after a resume is never read as a full one."""
    data = make_shards(tmp_path / "data")
    out = tmp_path / "out"
    sets = ("per_device_train_batch_size=2", "max_steps=10", "save_steps=100", "logging_steps=4")
    run(train_cmd(out, data, *sets, "stop_at_step=6"), subprocess_env)
    run(train_cmd(out, data, *sets, extra=("--resume", "latest")), subprocess_env)
    rows = [r for r in metrics(out) if "loss" in r]
    steps = [r["step"] for r in rows]
    assert steps == [4, 8, 10], steps
    assert [r["window_steps"] for r in rows] == [4, 2, 2]
