"""tests/warm_python.py, which trainkit.run forks the repo's scripts from: a forked run is the cold run, bit for bit
(its losses, its checkpoint, its export, its exit status and what it says), and what it cannot be is run cold."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from tests import trainkit
from tests.trainkit import REPO_ROOT, make_shards, metrics, run, train_cmd


def lines(text: str) -> list[str]:
    """What a run says, its times and speeds (which differ between any two runs) left out."""
    return [re.sub(r"\d[\d,]*(\.\d+)? ?(steps/sec|tok/s|s\b|%)", "#", line) for line in text.splitlines()]


@pytest.mark.slow
def test_a_forked_run_is_the_cold_run(tmp_path, subprocess_env):
    data = make_shards(tmp_path / "data")
    for name in ("cold", "warm"):  # each its own copy of the data: the first run over a folder indexes it
        make_shards(tmp_path / f"{name}-data")
    cold = run(train_cmd(tmp_path / "cold", tmp_path / "cold-data", "max_steps=3", "save_steps=3"), subprocess_env,
               cold=True)
    before = trainkit.forked_runs()
    warm = run(train_cmd(tmp_path / "warm", tmp_path / "warm-data", "max_steps=3", "save_steps=3"), subprocess_env)
    assert trainkit.forked_runs() == before + 1
    said = [lines(proc.stdout.replace(str(tmp_path / name), "OUT")) for proc, name in ((cold, "cold"), (warm, "warm"))]
    assert said[0] == said[1] and len(said[0]) >= 15, said
    assert [(r.get("loss"), r.get("grad_norm")) for r in metrics(tmp_path / "cold")] == \
        [(r.get("loss"), r.get("grad_norm")) for r in metrics(tmp_path / "warm")]
    for name in ("final_model/model.safetensors", "final_model/config.json"):
        assert (tmp_path / "cold" / name).read_bytes() == (tmp_path / "warm" / name).read_bytes(), name
    [ckpt_cold], [ckpt_warm] = ((tmp_path / r / "checkpoints").glob("checkpoint-*") for r in ("cold", "warm"))
    assert sorted(p.name for p in ckpt_cold.iterdir()) == sorted(p.name for p in ckpt_warm.iterdir())
    assert (ckpt_cold / "model.safetensors").read_bytes() == (ckpt_warm / "model.safetensors").read_bytes()

    # a refusal: the same exit status and line; the environment is the command's own
    bad = train_cmd(tmp_path / "bad", data, "max_steps=0")
    refused = [run(bad, subprocess_env, check=False, cold=c) for c in (True, False)]
    assert refused[0].returncode == refused[1].returncode == 2
    assert refused[0].stderr == refused[1].stderr and refused[0].stderr.startswith("error:")


def test_a_command_on_more_than_one_thread_a_python_c_and_cold_true_start_cold(subprocess_env):
    """Each a process of its own, started as subprocess.run starts it, saying what the forked one says."""
    pid = [sys.executable, "-c", "import os; print(os.getppid())"]
    assert int(run(pid, subprocess_env).stdout) == os.getpid()
    script = REPO_ROOT / "scripts" / "memory_plan.py"
    before = trainkit.forked_runs()
    warm = run([sys.executable, str(script), "--help"], subprocess_env)
    assert warm.returncode == 0 and trainkit.forked_runs() == before + 1
    cold = [run([sys.executable, str(script), "--help"], dict(subprocess_env, OMP_NUM_THREADS="2")),
            run([sys.executable, str(script), "--help"], subprocess_env, cold=True)]
    assert trainkit.forked_runs() == before + 1 and [p.stdout for p in cold] == [warm.stdout] * 2


def test_a_forked_process_has_the_commands_environment_folder_and_arguments_and_its_timeout(tmp_path):
    from tests.warm_python import WarmPython

    probe = tmp_path / "probe.py"
    probe.write_text("import os, sys\nprint(os.environ['PROBE'], os.getcwd(), sys.argv[1:], __name__, os.getpid())\n"
                     "sys.exit(int(sys.argv[2]))\n")
    sleeper = tmp_path / "sleep.py"
    sleeper.write_text("import time\ntime.sleep(600)\n")
    with WarmPython(dict(PATH="/usr/bin:/bin"), tmp_path / "warm", preload=()) as python:
        said = python.run([str(probe), "a b", "3"], cwd=tmp_path, timeout=60, env=dict(PROBE="x"))
        assert said.returncode == 3
        assert said.stdout.split()[:5] == ["x", str(tmp_path), "['a", "b',", "'3']"]
        assert said.stdout.split()[5] == "__main__" and int(said.stdout.split()[6]) != python.proc.pid
        started = time.monotonic()
        with pytest.raises(subprocess.TimeoutExpired):
            python.run([str(sleeper)], cwd=tmp_path, timeout=2)
        assert time.monotonic() - started < 60
        assert python.run([str(probe), "", "0"], cwd=tmp_path, timeout=60, env=dict(PROBE="y")).stdout[0] == "y"
