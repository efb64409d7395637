"""Real multi-process runs on the CPU through start_training.sh (accelerate launch, gloo)."""
from __future__ import annotations

import json
import math

from tests.trainkit import REPO_ROOT, TINY, make_shards, metrics, run, train_cmd, train_rows


def launch(out, data, gpus: int, *sets: str, extra: tuple = (), env=None):
    cmd = [str(REPO_ROOT / "start_training.sh"), "--config", "demo", "--cpu", "--gpus", str(gpus), "--",
           "--output-dir", str(out), "--data-dir", str(data)]
    for s in TINY + list(sets):
        cmd += ["--set", s]
    return run(cmd + list(extra), env, timeout=600)


def test_two_ranks_match_one_process(tmp_path, subprocess_env):
    data = make_shards(tmp_path / "data")
    two, one = tmp_path / "two", tmp_path / "one"
    env = dict(subprocess_env, NEOX_TRACE_BATCHES="1")
    proc = launch(two, data, 2, "per_device_train_batch_size=2", "max_steps=6", "save_steps=3", env=env)
    assert "accelerate launch" in proc.stdout  # the launcher prints the command it runs
    assert "2 process(es) on cpu" in proc.stdout
    run(train_cmd(one, data, "per_device_train_batch_size=4", "max_steps=6", "save_steps=3"), subprocess_env)

    # weights identical on both ranks at the end
    final = [r for r in metrics(two) if r.get("final")][0]
    assert final["weights_in_sync"] is True and len(final["weight_sums"]) == 2

    # the two ranks read disjoint samples, every step
    trace = [json.loads(line) for line in (two / "logs" / "batch_trace.jsonl").read_text().splitlines()]
    assert [t["step"] for t in trace] == list(range(1, 7))
    seen = []
    for t in trace:
        r0, r1 = t["ranks"]
        assert len(r0) == len(r1) == 2 and not set(r0) & set(r1)
        seen += r0 + r1
    assert len(seen) == len(set(seen)) == 24  # 6 steps x global batch 4, no sample twice in the epoch

    # rank 0 alone wrote logs and checkpoints: one line per step, one row per step, no stray dirs
    log = (two / "logs" / "training.log").read_text()
    assert all(log.count(f"Step {s}: loss=") == 1 for s in range(1, 7))
    assert sorted(train_rows(two)) == list(range(1, 7))
    assert sorted(p.name for p in (two / "checkpoints").iterdir()) == [
        "checkpoint-epoch0-step3-files0", "checkpoint-epoch0-step6-files0"]

    # same LR sequence and (fp32) the same loss curve as one process with the same global batch
    a, b = train_rows(two), train_rows(one)
    for step in range(1, 7):
        assert a[step]["lr"] == b[step]["lr"]
        assert math.isclose(a[step]["loss"], b[step]["loss"], rel_tol=1e-5), (step, a[step], b[step])
        assert a[step]["tokens"] == b[step]["tokens"]


def test_resume_across_process_counts(tmp_path, subprocess_env):
    """2 processes -> resumed on 1, and 1 -> resumed on 2, both continue the 1-process reference curve."""
    data = make_shards(tmp_path / "data")
    ref = tmp_path / "ref"
    run(train_cmd(ref, data, "per_device_train_batch_size=4", "max_steps=6", "save_steps=3"), subprocess_env)
    expected = train_rows(ref)

    two_then_one = tmp_path / "a"
    launch(two_then_one, data, 2, "per_device_train_batch_size=2", "max_steps=6", "save_steps=3",
           "stop_at_step=3", env=subprocess_env)
    proc = run(train_cmd(two_then_one, data, "per_device_train_batch_size=4", "max_steps=6", "save_steps=3",
                         extra=("--resume", "latest")), subprocess_env)
    assert "checkpoint written by 2 processes, now 1" in proc.stdout

    one_then_two = tmp_path / "b"
    run(train_cmd(one_then_two, data, "per_device_train_batch_size=4", "max_steps=6", "save_steps=3",
                  "stop_at_step=3"), subprocess_env)
    proc = launch(one_then_two, data, 2, "per_device_train_batch_size=2", "max_steps=6", "save_steps=3",
                  extra=("--resume", "latest"), env=subprocess_env)
    assert "checkpoint written by 1 processes, now 2" in proc.stdout

    for out in (two_then_one, one_then_two):
        rows = train_rows(out)
        assert sorted(rows) == list(range(1, 7))
        for step in range(4, 7):
            assert rows[step]["lr"] == expected[step]["lr"]
            assert math.isclose(rows[step]["loss"], expected[step]["loss"], rel_tol=1e-5), (out.name, step)
