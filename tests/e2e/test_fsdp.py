"""strategy=fsdp on the CPU over gloo (real processes): FSDP2 trains like DDP, sharded checkpoints resume on
any world size and strategy (also from GCS), a corrupt shard is skipped, SIGTERM stops cleanly, the export
loads in transformers; and, in-process, the Pythia presets and the memory plan."""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import Emulator
from tests.trainkit import REPO_ROOT, TINY, load_weights, make_shards, metrics, run, train_cmd, train_rows

# init=hf: the 1e-5 bounds below were measured with transformers' init (std 0.02); the demo preset's neox init
# draws the tiny model's weights about 4x larger, and the same rounding noise then ends at 1.4e-5
STEPS = ("max_steps=8", "save_steps=4", "save_total_limit=3", "init=hf")


def launch(out: Path, data: Path, gpus: int, *sets: str, extra: tuple = (), env=None):
    cmd = [str(REPO_ROOT / "start_training.sh"), "--config", "demo", "--cpu", "--gpus", str(gpus),
           "--strategy", "fsdp", "--", "--output-dir", str(out), "--data-dir", str(data)]
    for s in TINY + list(sets):
        cmd += ["--set", s]
    return run(cmd + list(extra), env, timeout=600)


def close(a: float, b: float, rel: float = 1e-5) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-7)


@pytest.fixture(scope="module")
def emulator():
    emu = Emulator()
    yield emu
    emu.stop()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, emulator):
    """A: 2 FSDP ranks (micro 1 x accumulation 2), uploading to the GCS emulator; B: 1 DDP process (micro 2 x
    accumulation 2): the same global batch of 4, 8 steps, checkpoints at 4 and 8."""
    root = tmp_path_factory.mktemp("fsdp")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "STORAGE_EMULATOR_HOST": emulator.url, "TOKENIZERS_PARALLELISM": "false"}
    env.pop("GOOGLE_APPLICATION_CREDENTIALS", None)
    data = make_shards(root / "data")
    a, b = root / "fsdp2", root / "ddp1"
    launch(a, data, 2, *STEPS, "per_device_train_batch_size=1", "gradient_accumulation_steps=2",
           f"gcs_bucket={emulator.bucket}", "run_name=fsdp", env=env)
    run(train_cmd(b, data, *STEPS, "per_device_train_batch_size=2", "gradient_accumulation_steps=2"), env)
    return {"root": root, "data": data, "a": a, "b": b, "env": env}


def checkpoint(out: Path, step: int) -> Path:
    return next((out / "checkpoints").glob(f"checkpoint-epoch*-step{step}-files*"))


@pytest.mark.slow
def test_two_fsdp_ranks_train_like_one_ddp_process(runs):
    a, b = train_rows(runs["a"]), train_rows(runs["b"])
    assert sorted(a) == sorted(b) == list(range(1, 9))
    for step in range(1, 9):
        assert close(a[step]["loss"], b[step]["loss"]), (step, a[step]["loss"], b[step]["loss"])
        assert close(a[step]["grad_norm"], b[step]["grad_norm"]), (step, a[step]["grad_norm"], b[step]["grad_norm"])
        assert a[step]["lr"] == b[step]["lr"] and a[step]["tokens"] == b[step]["tokens"]
    wa, wb = (load_weights(out / "final_model" / "model.safetensors") for out in (runs["a"], runs["b"]))
    assert wa.keys() == wb.keys()
    # the whole model within 1e-5 (relative): fp32 sums in another order differ in the last bits, and AdamW
    # turns the rounding noise of gradients that are zero in exact arithmetic (the key biases) into full-size
    # updates, so a per-element bound would measure AdamW, not FSDP
    flat = lambda w: torch.cat([w[k].flatten() for k in sorted(w)])  # noqa: E731
    assert ((flat(wa) - flat(wb)).norm() / flat(wb).norm()).item() < 1e-5

    # the log says the strategy, and each FSDP rank holds half the parameters a DDP process holds
    def param_bytes(out):
        log = (out / "logs" / "training.log").read_text()
        line = re.search(r"strategy (\w+), world size (\d+): per-rank state .*\(parameters (\d+) bytes", log)
        return line.group(1), int(line.group(2)), int(line.group(3))

    (sa, wa_, pa), (sb, wb_, pb) = param_bytes(runs["a"]), param_bytes(runs["b"])
    assert (sa, wa_, sb, wb_) == ("fsdp", 2, "ddp", 1)
    assert abs(pa / pb - 0.5) < 0.025, (pa, pb)

    # the sharded checkpoint: every rank's file listed in the manifest, no model.safetensors
    manifest = json.loads((checkpoint(runs["a"], 8) / "manifest.json").read_text())
    assert {"dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp"} <= set(manifest["files"])
    assert "model.safetensors" not in manifest["files"] and "optimizer.pt" not in manifest["files"]


@pytest.mark.slow
def test_one_fsdp_process_without_a_launcher_trains_like_ddp(runs, tmp_path):
    """`python train.py --set strategy=fsdp` (and start_training.sh --gpus 1, the single-GPU comparison with
    DDP): one process gets a process group of its own and trains exactly as run B's DDP process."""
    out = tmp_path / "fsdp1"
    proc = run(train_cmd(out, runs["data"], *STEPS, "per_device_train_batch_size=2", "gradient_accumulation_steps=2",
                         "strategy=fsdp"), runs["env"])
    assert "strategy fsdp, world size 1" in proc.stdout
    rows, expected = train_rows(out), train_rows(runs["b"])
    assert sorted(rows) == list(range(1, 9))
    for step in range(1, 9):
        assert close(rows[step]["loss"], expected[step]["loss"]), (step, rows[step], expected[step])
    assert (checkpoint(out, 8) / "dcp" / "__0_0.distcp").is_file()


@pytest.mark.slow
def test_fsdp_export_loads_in_transformers_with_the_native_loss(runs):
    from transformers import AutoModelForCausalLM

    from configs import get_model_spec
    from utils.model import build_model

    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(3))
    hf = AutoModelForCausalLM.from_pretrained(runs["a"] / "final_model").eval()
    native = build_model(get_model_spec("tiny"), seed=0).eval()
    native.load_state_dict(load_weights(runs["a"] / "final_model" / "model.safetensors"), strict=False)
    with torch.no_grad():
        hf_loss = hf(input_ids=ids, labels=ids).loss.item()
        assert close(native(ids).item(), hf_loss)


@pytest.mark.slow
def test_sharded_checkpoint_resumes_on_other_world_sizes_and_strategies(runs, emulator):
    env, data, a, b = runs["env"], runs["data"], runs["a"], runs["b"]
    expected_a, expected_b = train_rows(a), train_rows(b)

    # FSDP (2 ranks) -> DDP (1 process), from its copy in GCS (uploaded in the background by run A)
    remote = f"gs://{emulator.bucket}/checkpoints/fsdp/{checkpoint(a, 4).name}"
    one = runs["root"] / "fsdp2-to-ddp1"
    proc = run(train_cmd(one, data, *STEPS, "per_device_train_batch_size=2", "gradient_accumulation_steps=2",
                         extra=("--resume", remote)), env)
    assert "checkpoint written by 2 processes (fsdp), now 1 (ddp)" in proc.stdout
    # FSDP (2 ranks) -> FSDP (4 ranks)
    four = runs["root"] / "fsdp2-to-fsdp4"
    launch(four, data, 4, *STEPS, "per_device_train_batch_size=1", "gradient_accumulation_steps=1", env=env,
           extra=("--resume", str(checkpoint(a, 4))))
    # DDP (1 process, unsharded checkpoint) -> FSDP (2 ranks)
    two = runs["root"] / "ddp1-to-fsdp2"
    launch(two, data, 2, *STEPS, "per_device_train_batch_size=1", "gradient_accumulation_steps=2", env=env,
           extra=("--resume", str(checkpoint(b, 4))))
    for out, expected in ((one, expected_a), (four, expected_a), (two, expected_b)):
        rows = train_rows(out)
        assert sorted(rows) == [5, 6, 7, 8], out.name
        for step in range(5, 9):
            assert rows[step]["lr"] == expected[step]["lr"]
            assert close(rows[step]["loss"], expected[step]["loss"]), (out.name, step, rows[step], expected[step])


@pytest.mark.slow
def test_corrupt_rank_file_is_skipped_and_named(runs, tmp_path):
    from utils.checkpoint.format import find_latest_local

    copy = tmp_path / "checkpoints"
    shutil.copytree(runs["a"] / "checkpoints", copy)
    newest = checkpoint(copy.parent, 8)
    shard = newest / "dcp" / "__1_0.distcp"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    shard.write_bytes(bytes(raw))
    lines = []
    assert find_latest_local(copy, lines.append) == checkpoint(copy.parent, 4)
    assert any(newest.name in line and "dcp/__1_0.distcp" in line and "corrupt" in line for line in lines), lines


def test_pythia_presets_have_the_published_parameter_counts():
    from configs import get_model_spec
    from utils.model import build_model

    published = {"pythia-160m": 162_322_944, "pythia-410m": 405_334_016, "pythia-1b": 1_011_781_632,
                 "pythia-1.4b": 1_414_647_808, "pythia-2.8b": 2_775_208_960, "pythia-6.9b": 6_857_302_016}
    for name, count in published.items():
        with torch.device("meta"):
            model = build_model(get_model_spec(name), seed=0)
        assert abs(model.parameter_counts()[0] / count - 1) < 0.005, name


def test_memory_plan_matches_the_profile_budget_and_shards_under_fsdp():
    from configs import get_model_spec
    from configs.profiles import RunShape, choose_profile, memory_plan

    spec = get_model_spec("gpt-neox-1.2b")
    ddp = memory_plan(spec, RunShape(strategy="ddp", world_size=8, micro_batch=4, checkpointing="full"))
    assert round(ddp.state / 1e9, 1) == 22.6  # configs/profiles.py: 5.6 + 5.6 + 11.3 GB
    fsdp = memory_plan(spec, RunShape(strategy="fsdp", world_size=8, micro_batch=4, checkpointing="full"))
    assert math.isclose(fsdp.state * 8, ddp.state) and fsdp.activations == ddp.activations
    # a 24 GB card: DDP must fall back to bf16 moments; sharded over 2 GPUs the balanced profile fits
    assert choose_profile(23.6, spec, "ddp", 2).name == "conservative"
    assert choose_profile(23.6, spec, "fsdp", 2).name == "balanced"
    assert not memory_plan(get_model_spec("pythia-6.9b"),
                           RunShape(strategy="ddp", micro_batch=1, checkpointing="full")).fits(80)
    assert memory_plan(get_model_spec("pythia-6.9b"),
                       RunShape(strategy="fsdp", world_size=8, micro_batch=2, checkpointing="full")).fits(80)
    out = subprocess.run([str(REPO_ROOT / ".venv" / "bin" / "python"), str(REPO_ROOT / "scripts" / "memory_plan.py"),
                          "--model", "pythia-6.9b", "--world-size", "8"], capture_output=True, text=True)
    assert out.returncode == 1 and "does NOT fit" in out.stdout and "weights (fp32)" in out.stdout


@pytest.mark.slow
def test_init_from_and_sigterm_to_the_launcher_during_an_fsdp_run(runs, tmp_path, subprocess_env):
    """Starts 2 FSDP ranks from run A's exported model (init_from: rank 0 reads it, the others get their
    shards by broadcast), then stops them with SIGTERM to the launcher."""
    from utils.checkpoint.format import verify_checkpoint

    out = tmp_path / "out"
    cmd = [str(REPO_ROOT / "start_training.sh"), "--config", "demo", "--cpu", "--gpus", "2", "--strategy", "fsdp",
           "--", "--output-dir", str(out), "--data-dir", str(runs["data"])]
    for s in TINY + ["per_device_train_batch_size=1", "gradient_accumulation_steps=2", "max_steps=100000",
                     "save_steps=100000", f"init_from={runs['a'] / 'final_model'}"]:
        cmd += ["--set", s]
    launcher = subprocess.Popen(cmd, env=subprocess_env, cwd=REPO_ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
    rows = out / "logs" / "metrics.jsonl"
    deadline = time.time() + 180
    while time.time() < deadline and not (rows.exists() and rows.read_text().count('"loss"') >= 3):
        time.sleep(0.2)
    launcher.send_signal(signal.SIGTERM)
    stdout, stderr = launcher.communicate(timeout=180)
    assert launcher.returncode == 0, stderr[-3000:]

    # init_from: the first evaluation sees run A's final weights (same validation batches)
    val = lambda out: {r["step"]: r["val_loss"] for r in metrics(out) if "val_loss" in r}  # noqa: E731
    assert close(val(out)[0], val(runs["a"])[8]), (val(out), val(runs["a"]))

    stopped = max(train_rows(out))
    ckpts = [p for p in (out / "checkpoints").iterdir() if not p.name.startswith(".")]
    assert len(ckpts) == 1 and f"-step{stopped}-" in ckpts[0].name, ckpts
    manifest = verify_checkpoint(ckpts[0])
    assert {"dcp/__0_0.distcp", "dcp/__1_0.distcp"} <= set(manifest["files"])
    assert f"stopped by SIGTERM after step {stopped}" in stdout
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]  # no temporary left
    assert subprocess.run(["pgrep", "-f", str(out)], capture_output=True).returncode == 1  # no process left


def start_two_nodes(outs: list[Path], data: Path, *sets: str, extra: tuple = (), env=None, envs=None) -> list:
    """Two launchers on this machine stand in for two nodes of one process each; each has its own
    --output-dir, as two machines with local disks would (and its own environment in `envs`)."""
    from tests.conftest import free_port

    port, procs = str(free_port()), []
    for rank, out in enumerate(outs):
        cmd = [str(REPO_ROOT / "start_training.sh"), "--config", "demo", "--cpu", "--gpus", "1", "--nodes", "2",
               "--node-rank", str(rank), "--main-addr", "127.0.0.1", "--main-port", port, "--strategy", "fsdp",
               "--", "--output-dir", str(out), "--data-dir", str(data)]
        for s in TINY + list(sets):
            cmd += ["--set", s]
        procs.append(subprocess.Popen(cmd + list(extra), env=envs[rank] if envs else env, cwd=REPO_ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      start_new_session=True))
    return procs


def two_nodes(*args, **kwargs) -> list[tuple]:
    """start_two_nodes, run to the end: (exit code, stdout, stderr) per node."""
    return [(p.returncode, *out)
            for p, out in [(p, p.communicate(timeout=300)) for p in start_two_nodes(*args, **kwargs)]]


@pytest.mark.slow
def test_two_nodes_without_a_shared_output_dir_or_a_bucket_are_refused(tmp_path, subprocess_env):
    """Without a bucket the checkpoint could be complete nowhere: the run stops before training."""
    outs = [tmp_path / "node0", tmp_path / "node1"]
    for code, _stdout, stderr in two_nodes(outs, make_shards(tmp_path / "data"), "max_steps=2", env=subprocess_env):
        assert code != 0
        assert "is not shared" in stderr and "cannot see it" in stderr and "gcs_bucket" in stderr, stderr[-2000:]
    assert not (outs[0] / "logs" / "metrics.jsonl").exists() or \
        '"loss"' not in (outs[0] / "logs" / "metrics.jsonl").read_text()


@pytest.mark.slow
def test_two_nodes_with_local_disks_complete_each_checkpoint_in_gcs(runs, emulator, tmp_path, monkeypatch):
    """Two nodes, each with its own disk, and a bucket: each node uploads its own shards and the manifest
    goes up last, so the checkpoint is complete in GCS; node 0 keeps a partial copy, node 1 nothing; both
    nodes resume from GCS and continue the 2-rank run's losses."""
    from utils.checkpoint.format import PartialCheckpoint, verify_checkpoint

    env, data, nodes = runs["env"], runs["data"], [tmp_path / "node0", tmp_path / "node1"]
    sets = (*STEPS, "per_device_train_batch_size=1", "gradient_accumulation_steps=2",
            f"gcs_bucket={emulator.bucket}", "run_name=nodes")
    first = two_nodes(nodes, data, *sets, env=env)
    for code, _stdout, stderr in first:
        assert code == 0, stderr[-3000:]
    assert "each node writes its ranks' checkpoint shards to its own disk and uploads them" in first[0][1]
    expected, rows = train_rows(runs["a"]), train_rows(nodes[0])
    assert sorted(rows) == list(range(1, 9))
    for step in range(1, 9):  # the same global batch as run A's 2 FSDP ranks on one node
        assert close(rows[step]["loss"], expected[step]["loss"]), (step, rows[step], expected[step])
        assert close(rows[step]["grad_norm"], expected[step]["grad_norm"])

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", emulator.url)
    client = emulator.client()
    for step in (4, 8):
        local = checkpoint(nodes[0], step)
        prefix = f"checkpoints/nodes/{local.name}/"
        remote = {b.name[len(prefix):]: b.size for b in client.list_blobs(emulator.bucket, prefix=prefix)}
        manifest = json.loads(client.bucket(emulator.bucket).blob(prefix + "manifest.json").download_as_bytes())
        # in GCS: every file the manifest lists, node 1's shard among them, with the size it has there
        assert {"dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp", "trainer_state.json"} <= set(manifest["files"])
        assert {rel: e["size"] for rel, e in manifest["files"].items()} == \
            {rel: size for rel, size in remote.items() if rel != "manifest.json"}
        assert manifest["files"]["dcp/__1_0.distcp"]["remote"] is True
        assert manifest["complete_at"] == f"gs://{emulator.bucket}/{prefix.rstrip('/')}"
        # node 0's copy holds its own files and says where the whole checkpoint is
        assert (local / "dcp" / "__0_0.distcp").is_file() and not (local / "dcp" / "__1_0.distcp").exists()
        with pytest.raises(PartialCheckpoint, match=manifest["complete_at"]):
            verify_checkpoint(local)
    assert not list((nodes[1] / "checkpoints").iterdir())  # node 1's shards went to GCS; no temporary left

    # both nodes resume from GCS: without step 8 (gone from GCS and node 0), --resume auto takes step 4. Node 1
    # still holds a complete step 8 of its own (left by an earlier resume, say): it must take rank 0's choice
    from utils.checkpoint.resume import resolve_resume

    step8 = checkpoint(nodes[0], 8).name
    resolve_resume(f"gs://{emulator.bucket}/checkpoints/nodes/{step8}", nodes[1] / "checkpoints",
                   client_factory=emulator.client, log=lambda _: None)
    for blob in client.list_blobs(emulator.bucket, prefix=f"checkpoints/nodes/{step8}/"):
        blob.delete()
    shutil.rmtree(checkpoint(nodes[0], 8))
    before = len(metrics(nodes[0]))
    results = two_nodes(nodes, data, *sets, extra=("--resume", "auto"), env=env)
    for code, _stdout, stderr in results:
        assert code == 0, stderr[-3000:]
    assert "holds only the shards its node wrote; downloading the whole checkpoint" in results[0][1]
    resumed = {r["step"]: r for r in metrics(nodes[0])[before:] if "loss" in r}
    assert sorted(resumed) == [5, 6, 7, 8]
    for step in range(5, 9):
        assert close(resumed[step]["loss"], expected[step]["loss"]), (step, resumed[step], expected[step])
    # node 1 downloaded step 4 for itself (its rank read its shards from it), then deleted it
    assert [p.name for p in (nodes[1] / "checkpoints").iterdir()] == [step8]


@pytest.mark.slow
def test_sigterm_to_both_nodes_leaves_a_checkpoint_complete_in_gcs(runs, emulator, tmp_path, monkeypatch):
    """A preemption of both nodes (SIGTERM to each launcher) in node-upload mode: both exit 0, and the
    checkpoint of the step they stopped after is complete in GCS, node 1's shard in it."""
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    procs = start_two_nodes(nodes, runs["data"], "max_steps=100000", "save_steps=100000",
                            "per_device_train_batch_size=1", "gradient_accumulation_steps=2",
                            f"gcs_bucket={emulator.bucket}", "run_name=preempted", env=runs["env"])
    rows = nodes[0] / "logs" / "metrics.jsonl"
    deadline = time.time() + 180
    while time.time() < deadline and not (rows.exists() and rows.read_text().count('"loss"') >= 3):
        time.sleep(0.2)
    for p in procs:
        p.send_signal(signal.SIGTERM)
    results = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results[0][1][-2000:] + results[1][1][-2000:]
    stopped = max(train_rows(nodes[0]))
    assert f"stopped by SIGTERM after step {stopped}" in results[0][0]
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", emulator.url)
    client = emulator.client()
    name = checkpoint(nodes[0], stopped).name
    prefix = f"checkpoints/preempted/{name}/"
    remote = {b.name[len(prefix):]: b.size for b in client.list_blobs(emulator.bucket, prefix=prefix)}
    manifest = json.loads(client.bucket(emulator.bucket).blob(prefix + "manifest.json").download_as_bytes())
    assert {rel: e["size"] for rel, e in manifest["files"].items()} == \
        {rel: size for rel, size in remote.items() if rel != "manifest.json"}
    assert "dcp/__1_0.distcp" in remote and not list((nodes[1] / "checkpoints").iterdir())


@pytest.mark.slow
def test_a_node_whose_shards_do_not_reach_gcs_leaves_no_checkpoint_that_looks_complete(runs, emulator, tmp_path,
                                                                                         monkeypatch):
    """Node 1 talks to another GCS (an emulator without the bucket): its upload fails at once. The run
    trains to the end, rank 0 names the incomplete checkpoint and exits 1; no manifest reaches GCS and no
    copy is left that a resume would take for complete."""
    other = Emulator(bucket="other-bucket")
    try:
        nodes = [tmp_path / "node0", tmp_path / "node1"]
        sets = ("max_steps=2", "save_steps=2", "per_device_train_batch_size=1", "gradient_accumulation_steps=2",
                f"gcs_bucket={emulator.bucket}", "run_name=lost-node")
        envs = [{**runs["env"], "STORAGE_EMULATOR_HOST": url} for url in (emulator.url, other.url)]
        (code0, out0, err0), (code1, out1, err1) = two_nodes(nodes, runs["data"], *sets, envs=envs)
    finally:
        other.stop()
    assert (code0, code1) == (1, 0), err0[-3000:]
    assert re.search(r"checkpoint checkpoint-epoch0-step2-files0 is incomplete in gs://test-bucket/checkpoints/"
                     r"lost-node: rank 1's node: .*the previous checkpoint is intact", err0), err0[-3000:]
    assert "this node's shards of checkpoint-epoch0-step2-files0 did not reach" in err1, err1[-3000:]
    assert train_rows(nodes[0]).keys() == {1, 2} and (nodes[0] / "final_model" / "model.safetensors").is_file()
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", emulator.url)
    names = [b.name for b in emulator.client().list_blobs(emulator.bucket, prefix="checkpoints/lost-node/")]
    assert not [n for n in names if n.endswith("manifest.json")], names
    assert [p.name for p in (nodes[0] / "checkpoints").iterdir()] == []
    assert [p.name for p in (nodes[1] / "checkpoints").iterdir()] == []


def test_a_large_export_is_sharded_safetensors_with_an_index(tmp_path, monkeypatch):
    """Above EXPORT_SHARD_SIZE (5 GB) the export is split as transformers writes it, and loads back."""
    from transformers import AutoModelForCausalLM

    from configs import get_model_spec
    from utils.model import build_model, hf

    monkeypatch.setattr(hf, "EXPORT_SHARD_SIZE", "200KB")  # the tiny model (0.7 MB) stands in for a 6.9B one
    spec = get_model_spec("tiny")
    model = build_model(spec, seed=4)
    hf.export_hf(model.state_dict(), spec, tmp_path / "out")
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    ids = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert close(loaded(input_ids=ids, labels=ids).loss.item(), model(ids).item())
