"""The README's demo command, end to end on this machine: builds its data, trains, learns, exports."""
from __future__ import annotations

import time

import pytest

from tests.trainkit import REPO_ROOT, metrics, run


@pytest.mark.slow
def test_demo_command_learns_within_ten_minutes(tmp_path, subprocess_env):
    out = tmp_path / "out"
    env = {k: v for k, v in subprocess_env.items() if k != "OMP_NUM_THREADS"}  # the launcher's default, as a user runs it
    cmd = [str(REPO_ROOT / "start_training.sh"), "--config", "demo", "--",
           "--output-dir", str(out), "--data-dir", str(tmp_path / "data")]
    started = time.monotonic()
    run(cmd, env, timeout=900)
    elapsed = time.monotonic() - started
    assert elapsed < 600, f"demo took {elapsed:.0f} s"
    evals = [r for r in metrics(out) if "val_loss" in r]
    first, last = evals[0], evals[-1]
    assert first["step"] == 0 and last["step"] == max(r["step"] for r in metrics(out))
    drop = 1 - last["val_loss"] / first["val_loss"]
    print(f"demo: {elapsed:.0f} s, val_loss {first['val_loss']:.3f} -> {last['val_loss']:.3f} ({100 * drop:.1f}% lower)")
    assert drop >= 0.40, (first, last)
    assert (tmp_path / "data" / "tokenizer.json").exists()
    assert list((out / "checkpoints").glob("checkpoint-epoch*-step*-files*"))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "final_model")
    assert model.config.vocab_size == 2048
