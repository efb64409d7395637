"""deploy/skypilot.yaml: its schema (SkyPilot's own parser where `sky` is installed), and its run command
executed as SkyPilot executes it on one node (the SKYPILOT_* variables, the task's envs, the workdir as the
current folder) on the CPU with the GCS emulator as the bucket: stopped, then run again with an empty output
folder (a relaunched managed job on a new machine), it resumes from the bucket and ends with the weights of an
uninterrupted run."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import pytest
import torch
import yaml

from tests.conftest import free_port
from tests.trainkit import REPO_ROOT, TINY, load_weights, make_shards, run, train_cmd

TASK = REPO_ROOT / "deploy" / "skypilot.yaml"
SETS = TINY + ["per_device_train_batch_size=2", "save_steps=100000", "max_steps=8"]


def task() -> dict:
    return yaml.safe_load(TASK.read_text())


def test_the_task_file_asks_for_spot_h100s_sets_up_and_resumes_from_the_bucket():
    spec = task()
    assert spec["resources"]["accelerators"] == "H100:8" and spec["resources"]["use_spot"] is True
    assert spec["setup"].strip() == "./setup.sh"
    assert spec["workdir"] == "."
    assert {"GCS_BUCKET", "GOOGLE_APPLICATION_CREDENTIALS", "RUN_NAME", "CONFIG"} <= set(spec["envs"])
    assert set(spec) <= {"name", "resources", "num_nodes", "workdir", "file_mounts", "envs", "setup", "run"}
    for var in ("SKYPILOT_NUM_NODES", "SKYPILOT_NODE_RANK", "SKYPILOT_NODE_IPS"):
        assert var in spec["run"]
    assert "--resume auto" in spec["run"] and "./start_training.sh" in spec["run"]
    try:
        import sky
    except ImportError:
        # SkyPilot is not a dev dependency: skypilot 0.14.1 pins click 8.1.8 where huggingface-hub needs
        # click >= 8.4.2, and it took minutes to resolve; the keys above stand in (sky.Task.from_yaml of
        # 0.14.1, installed apart, loaded this file: resources {'H100': 8} spot, 1 node, setup ./setup.sh)
        return
    parsed = sky.Task.from_yaml(str(TASK))
    assert parsed.run and parsed.setup


def run_command_env(env: dict, bucket: str, out, data, *sets: str) -> dict:
    """The environment SkyPilot gives the run command on node 0 of 1: the task's envs, the SKYPILOT_* variables."""
    envs = {k: str(v) for k, v in task()["envs"].items()}
    launch = "--cpu " + " ".join(f"--set {s}" for s in SETS + list(sets))
    envs.update(GCS_BUCKET=bucket, RUN_NAME="sky-test", CONFIG="demo", MAX_RESTARTS="0", LAUNCH_ARGS=launch,
                MAIN_PORT=str(free_port()), TRAIN_ARGS=f"--output-dir {out} --data-dir {data}",
                GOOGLE_APPLICATION_CREDENTIALS="/nonexistent/gcs-key.json")
    if os.environ.get("STORAGE_EMULATOR_HOST"):  # the gcs_emulator fixture's, set after `env` was made
        envs["STORAGE_EMULATOR_HOST"] = os.environ["STORAGE_EMULATOR_HOST"]
    return dict(env, **envs, SKYPILOT_NUM_NODES="1", SKYPILOT_NODE_RANK="0", SKYPILOT_NODE_IPS="127.0.0.1\n",
                SKYPILOT_TASK_ID="sky-managed-test")


@pytest.mark.slow
def test_the_run_command_resumes_from_the_bucket_on_an_empty_machine(tmp_path, subprocess_env, gcs_emulator):
    data = make_shards(tmp_path / "data")
    ref = tmp_path / "ref"
    run(train_cmd(ref, data, *SETS[len(TINY):]), subprocess_env)
    first, second = tmp_path / "machine1" / "run", tmp_path / "machine2" / "run"
    script = task()["run"]
    env = dict(run_command_env(subprocess_env, gcs_emulator.bucket, first, data), NEOX_DEBUG_STEP_DELAY_S="0.5")
    log = tmp_path / "first.log"
    proc = subprocess.Popen(["bash", "-c", script], env=env, cwd=REPO_ROOT, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    rows, deadline = first / "logs" / "metrics.jsonl", time.time() + 240
    while not (rows.exists() and rows.read_text().count('"loss"') >= 3):
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.time() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGTERM)  # a spot VM's shutdown: the job checkpoints into the bucket and stops
    proc.wait(timeout=300)
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    assert "node 0 of 1, main 127.0.0.1:" in text
    stopped = re.search(r"stopped by SIGTERM after step (\d+)", text)
    assert stopped, text[-3000:]
    names = [b.name for b in gcs_emulator.client().list_blobs(gcs_emulator.bucket)]
    assert any(n.startswith("checkpoints/sky-test/") and n.endswith("manifest.json") for n in names), names

    # the relaunch: a new machine, nothing on its disk
    env = run_command_env(subprocess_env, gcs_emulator.bucket, second, data)
    again = subprocess.run(["bash", "-c", script], env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0, (again.stdout[-3000:], again.stderr[-3000:])
    assert f"step {stopped.group(1)}" in again.stdout and "gs://" in again.stdout, again.stdout[-3000:]
    expected, got = load_weights(ref / "final_model" / "model.safetensors"), \
        load_weights(second / "final_model" / "model.safetensors")
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


def test_the_run_command_without_a_bucket_says_so(tmp_path, subprocess_env):
    env = run_command_env(subprocess_env, "", tmp_path / "out", tmp_path / "data")
    proc = subprocess.run(["bash", "-c", task()["run"]], env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "GCS_BUCKET is not set" in proc.stderr, proc.stderr
