"""Checkpoints: round trip, atomicity under SIGKILL, corruption detection, retention, the async writer, resume."""
from __future__ import annotations

import collections
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from utils.checkpoint.format import (
    MANIFEST,
    CheckpointError,
    CheckpointPayload,
    apply_retention,
    checkpoint_name,
    find_latest_local,
    list_checkpoints,
    parse_checkpoint_name,
    read_checkpoint,
    snapshot_to_cpu,
    verify_checkpoint,
    write_checkpoint,
)
from utils.checkpoint.resume import resolve_resume
from utils.checkpoint.writer import AsyncCheckpointWriter
from utils.io import files


def small_payload(step: int, numel: int = 1024) -> CheckpointPayload:
    return CheckpointPayload(
        model_state={"gpt_neox.embed_in.weight": torch.full((numel,), float(step))},
        objects={"optimizer": {"state": {0: {"exp_avg": torch.full((numel // 2,), float(step))}}},
                 "cursor": {"epoch": 0, "samples": step * 8}},
        trainer_state={"step": step, "epoch": 0, "tokens": step * 1000},
    )


def save(root: Path, step: int, **kw) -> Path:
    return write_checkpoint(root, checkpoint_name(0, step, step // 2), small_payload(step, **kw))


def flip_byte(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_name_format_round_trips():
    name = checkpoint_name(2, 1500, 37)
    assert name == "checkpoint-epoch2-step1500-files37"
    assert parse_checkpoint_name(name) == (2, 1500, 37)
    for other in (f".{name}.partial-host-12-ab", name + "x", "checkpoint-epoch2-step-1-files3", "final"):
        assert parse_checkpoint_name(other) is None
    with pytest.raises(ValueError):
        checkpoint_name(0, -1, 0)


def test_round_trip_is_bitwise(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    for _ in range(2):
        model(torch.randn(5, 8)).pow(2).mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    rng = [{"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}]
    model_state = dict(model.state_dict(), **{"half.weight": torch.randn(3, 5).to(torch.bfloat16)})
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text('{"version": "1.0"}')

    payload = CheckpointPayload(
        model_state=model_state,
        objects={"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "rng": rng,
                 "cursor": {"epoch": 1, "samples": 40}},
        trainer_state={"step": 2, "epoch": 1, "tokens": 640, "world_size": 1, "config": {"model": "tiny"}},
    )
    path = write_checkpoint(tmp_path / "ckpts", checkpoint_name(1, 2, 0), snapshot_to_cpu(payload),
                            extra_files={"tokenizer.json": tokenizer})
    assert path == tmp_path / "ckpts" / "checkpoint-epoch1-step2-files0"
    assert sorted(p.name for p in path.iterdir()) == sorted(
        [MANIFEST, "model.safetensors", "trainer_state.json", "tokenizer.json", "optimizer.pt", "scheduler.pt",
         "rng.pt", "cursor.pt"])
    assert [p.name for p in (tmp_path / "ckpts").iterdir()] == [path.name]  # no temp dir left behind

    back = read_checkpoint(path)
    assert back.model_state.keys() == model_state.keys()
    for k, v in model_state.items():
        assert back.model_state[k].dtype == v.dtype and torch.equal(back.model_state[k], v), k
    assert back.trainer_state == payload.trainer_state
    assert back.objects["cursor"] == {"epoch": 1, "samples": 40}
    assert back.objects["scheduler"] == sched.state_dict()
    assert back.objects["rng"][0]["python"] == rng[0]["python"]
    assert torch.equal(back.objects["rng"][0]["torch"], rng[0]["torch"])
    np_back, np_orig = back.objects["rng"][0]["numpy"], rng[0]["numpy"]
    assert np_back[0] == np_orig[0] and np.array_equal(np_back[1], np_orig[1]) and np_back[2:] == np_orig[2:]
    assert (path / "tokenizer.json").read_text() == '{"version": "1.0"}'

    saved_opt = opt.state_dict()
    for pid, state in saved_opt["state"].items():
        for key, value in state.items():
            got = back.objects["optimizer"]["state"][pid][key]
            assert torch.equal(got, value) if torch.is_tensor(value) else got == value
    assert back.objects["optimizer"]["param_groups"] == saved_opt["param_groups"]

    # The restored states drive the next step exactly like the originals.
    model2 = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    model2.load_state_dict({k: v for k, v in back.model_state.items() if k != "half.weight"})
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3, weight_decay=0.1)
    opt2.load_state_dict(back.objects["optimizer"])
    x = torch.randn(5, 8)
    for m, o in ((model, opt), (model2, opt2)):
        m(x).pow(2).mean().backward()
        o.step()
    for p1, p2 in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p1, p2)


def test_snapshot_is_independent_of_the_original():
    original = {
        "w": torch.arange(6.0).reshape(2, 3),
        "nested": [torch.ones(3), (torch.zeros(2), 5, "x")],
        "arr": np.arange(4),
        "n": 3,
    }
    snap = snapshot_to_cpu(original)
    original["w"].add_(100)
    original["nested"][0].mul_(7)
    original["nested"][1][0].fill_(9)
    original["arr"][0] = 42
    assert torch.equal(snap["w"], torch.arange(6.0).reshape(2, 3))
    assert torch.equal(snap["nested"][0], torch.ones(3))
    assert torch.equal(snap["nested"][1][0], torch.zeros(2)) and snap["nested"][1][1:] == (5, "x")
    assert isinstance(snap["nested"][1], tuple)
    assert snap["arr"][0] == 0 and snap["n"] == 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_snapshot_from_cuda_uses_pinned_copies():
    original = {"w": torch.randn(1024, 1024, device="cuda"), "step": [torch.tensor(3, device="cuda")]}
    expected = {"w": original["w"].cpu(), "step": original["step"][0].cpu()}
    snap = snapshot_to_cpu(original)
    original["w"].zero_()
    assert snap["w"].device.type == "cpu" and snap["w"].is_pinned()
    assert torch.equal(snap["w"], expected["w"]) and torch.equal(snap["step"][0], expected["step"])


def test_resave_same_step_replaces_it(tmp_path):
    name = checkpoint_name(0, 7, 1)
    write_checkpoint(tmp_path, name, small_payload(7))
    write_checkpoint(tmp_path, name, small_payload(8))
    assert read_checkpoint(tmp_path / name).trainer_state["step"] == 8
    assert [p.name for p in tmp_path.iterdir()] == [name]


def test_failed_write_leaves_nothing_named_like_a_checkpoint(tmp_path):
    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("boom while pickling")

    payload = small_payload(3)
    payload.objects["broken"] = Unpicklable()
    with pytest.raises(CheckpointError, match="boom while pickling") as info:
        write_checkpoint(tmp_path, checkpoint_name(0, 3, 0), payload)
    assert "checkpoint-epoch0-step3-files0" in str(info.value)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(CheckpointError, match="not a checkpoint name"):
        write_checkpoint(tmp_path, "final", small_payload(3))


@pytest.mark.parametrize("damage,expect", [
    ("flip", r"model\.safetensors has crc32c"),
    ("truncate", r"optimizer\.pt has \d+ bytes, the manifest says"),
    ("no_manifest", r"no manifest\.json: it is incomplete"),
    ("missing_file", r"trainer_state\.json is missing"),
    ("bad_manifest", r"manifest\.json is unreadable"),
])
def test_verify_detects_damage(tmp_path, damage, expect):
    path = save(tmp_path, 4, numel=4096)
    verify_checkpoint(path)
    if damage == "flip":
        size = (path / "model.safetensors").stat().st_size
        flip_byte(path / "model.safetensors")
        assert (path / "model.safetensors").stat().st_size == size
    elif damage == "truncate":
        with open(path / "optimizer.pt", "r+b") as f:
            f.truncate(100)
    elif damage == "no_manifest":
        (path / MANIFEST).unlink()
    elif damage == "missing_file":
        (path / "trainer_state.json").unlink()
    elif damage == "bad_manifest":
        (path / MANIFEST).write_text("{not json")
    with pytest.raises(CheckpointError, match=expect) as info:
        verify_checkpoint(path)
    assert str(path) in str(info.value)
    with pytest.raises(CheckpointError):
        read_checkpoint(path)
    logs = []
    assert find_latest_local(tmp_path, log=logs.append) is None
    assert len(logs) == 1 and path.name in logs[0]


# A writer process that loops forever writing checkpoints of a few MB (re-saving every third step, running
# retention after each) until the test kills it with SIGKILL. A fork server imports torch once, so each
# round starts a fresh writer process in milliseconds.
WRITER_SERVER = textwrap.dedent("""
    import os, sys
    import torch
    from utils.checkpoint.format import (CheckpointPayload, apply_retention, checkpoint_name, find_latest_local,
                                  parse_checkpoint_name, write_checkpoint)

    def write_forever(root):
        latest = find_latest_local(root, log=lambda m: None)
        step = parse_checkpoint_name(latest.name)[1] if latest else 0
        while True:
            step += 1
            payload = CheckpointPayload(
                model_state={"w": torch.full((768 * 1024,), float(step)), "b": torch.arange(1000.0)},
                objects={"optimizer": {"state": {0: {"exp_avg": torch.full((256 * 1024,), float(step))}}},
                         "rng": [torch.get_rng_state()]},
                trainer_state={"step": step},
            )
            for _ in range(2 if step % 3 == 0 else 1):
                write_checkpoint(root, checkpoint_name(0, step, 0), payload)
            apply_retention(root, keep=2, log=lambda m: None)

    print("ready", flush=True)
    for line in sys.stdin:
        pid = os.fork()
        if pid == 0:
            try:
                write_forever(line.strip())
            finally:
                os._exit(1)
        print(pid, flush=True)
        os.waitpid(pid, 0)
        print("reaped", flush=True)
""")


def test_sigkill_during_saves_never_leaves_a_bad_latest(tmp_path, subprocess_env):
    root = tmp_path / "ckpts"
    write_checkpoint(root, checkpoint_name(0, 0, 0), CheckpointPayload({"w": torch.zeros(1)}, {}, {"step": 0}))
    script = tmp_path / "writer_server.py"
    script.write_text(WRITER_SERVER)
    server = subprocess.Popen([sys.executable, str(script)], env=subprocess_env, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    seed = int(time.time())
    rng = random.Random(seed)
    rounds, mid_write, previous_step = 15, 0, 0
    try:
        assert server.stdout.readline().strip() == "ready"
        for r in range(rounds):
            server.stdin.write(f"{root}\n")
            server.stdin.flush()
            writer_pid = int(server.stdout.readline())
            time.sleep(rng.uniform(0.05, 0.5))
            os.kill(writer_pid, signal.SIGKILL)
            assert server.stdout.readline().strip() == "reaped"

            context = f"seed {seed}, round {r}, dir {sorted(p.name for p in root.iterdir())}"
            if any(files.is_temp_name(p.name) and f"-{writer_pid}-" in p.name for p in root.iterdir()):
                mid_write += 1
            for path in list_checkpoints(root):  # every directory named like a checkpoint is complete
                verify_checkpoint(path)
            latest = find_latest_local(
                root, log=lambda m, context=context: pytest.fail(f"skipped a checkpoint: {m} ({context})"))
            assert latest is not None, context
            step = parse_checkpoint_name(latest.name)[1]
            payload = read_checkpoint(latest)
            assert payload.trainer_state == {"step": step}, context
            if step > 0:
                assert torch.equal(payload.model_state["w"], torch.full((768 * 1024,), float(step))), context
                assert payload.objects["optimizer"]["state"][0]["exp_avg"][-1].item() == step, context
            assert step >= previous_step, f"the newest checkpoint went backwards ({context})"
            previous_step = step
    finally:
        server.kill()
        server.wait()
    print(f"sigkill test: {rounds} rounds, {mid_write} killed mid-write, reached step {previous_step}")
    assert previous_step >= 2, f"writers made too little progress: step {previous_step} (seed {seed})"
    assert mid_write >= 1, f"no kill landed mid-write in {rounds} rounds (seed {seed})"


def test_retention_keeps_newest_complete_and_cleans_stale_temps(tmp_path):
    paths = [save(tmp_path, s) for s in range(1, 6)]
    incomplete = tmp_path / checkpoint_name(0, 9, 0)
    incomplete.mkdir()
    (incomplete / "model.safetensors").write_bytes(b"partial")

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        host = files.host_tag()
        stale = tmp_path / f".{checkpoint_name(0, 6, 0)}.partial-{host}-{dead.pid}-abcd1234"
        alive = tmp_path / f".{checkpoint_name(0, 6, 0)}.partial-{host}-{live.pid}-abcd1234"
        # our pid but not one of our live temporaries: a past run's (PID 1 in a container, every time)
        reused_pid = tmp_path / f".{checkpoint_name(0, 6, 0)}.partial-{host}-{os.getpid()}-0000beef"
        for d in (stale, alive, reused_pid):
            d.mkdir()
            (d / "model.safetensors").write_bytes(b"x")

        logs = []
        deleted = apply_retention(tmp_path, keep=2, protect={paths[1]}, log=logs.append)
        assert set(deleted) == {paths[0], paths[2], stale, reused_pid}
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            [paths[1].name, paths[3].name, paths[4].name, incomplete.name, alive.name])
        assert len(logs) == 4

        assert apply_retention(tmp_path, keep=None, log=lambda m: None) == []  # None: no limit
        # keep below 1 still never deletes the newest complete checkpoint
        assert apply_retention(tmp_path, keep=0, log=lambda m: None) == [paths[1], paths[3]]
        assert list_checkpoints(tmp_path) == [paths[4], incomplete]
    finally:
        live.kill()
        live.wait()


def test_a_partial_node_copy_counts_for_retention_and_names_its_complete_copy(tmp_path):
    """Rank 0's copy of a checkpoint written on several nodes without a shared dir: the manifest lists the
    other node's shard as remote. Verification says where the whole checkpoint is, resume passes it over,
    and retention counts it (node 0's disk does not fill with partial copies)."""
    from utils.checkpoint.format import PartialCheckpoint, ShardedPart

    url = "gs://bucket/checkpoints/run"
    remote = {"dcp/__1_0.distcp": {"size": 10, "crc32c": "AAAAAA==", "remote": True}}
    paths = []
    for step in (1, 2, 3):
        name = checkpoint_name(0, step, 0)
        tmp = files.temp_path(tmp_path / name)
        (tmp / "dcp").mkdir(parents=True)
        (tmp / "dcp" / "__0_0.distcp").write_bytes(b"rank0 data")
        part = ShardedPart(tmp, lambda: remote, complete_at=f"{url}/{name}")
        payload = CheckpointPayload(None, {"cursor": {"samples": step}}, {"step": step, "epoch": 0, "tokens": 1})
        paths.append(write_checkpoint(tmp_path, name, payload, sharded=part))
    manifest = json.loads((paths[-1] / MANIFEST).read_text())
    assert manifest["files"]["dcp/__1_0.distcp"] == remote["dcp/__1_0.distcp"]
    assert manifest["complete_at"] == f"{url}/{paths[-1].name}" and "dcp/__0_0.distcp" in manifest["files"]
    with pytest.raises(PartialCheckpoint, match=f"whole checkpoint is at {url}/{paths[-1].name}"):
        verify_checkpoint(paths[-1])
    logs = []
    assert find_latest_local(tmp_path, log=logs.append) is None and len(logs) == 3
    assert apply_retention(tmp_path, keep=2, log=lambda m: None) == [paths[0]]
    # once the other node's file is there (a downloaded copy), it is an ordinary complete checkpoint
    (paths[-1] / "dcp" / "__1_0.distcp").write_bytes(b"rank1 data")
    with pytest.raises(CheckpointError, match="crc32c"):
        verify_checkpoint(paths[-1])


class Gate:
    """Pickles only once the test opens the event: holds a background write in the middle of a file."""

    def __init__(self, event: threading.Event):
        self.event = event

    def __reduce__(self):
        assert self.event.wait(20)
        return (collections.OrderedDict, ())


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread dies on purpose
def test_async_writer_never_waits_on_a_dead_thread():
    """The writer thread gone mid-write (a job it cannot even unpack kills it before its own try): wait() and
    the next save() raise BackgroundFailure within seconds, where they waited for good."""
    from utils.errors import THREAD_FAILED, BackgroundFailure

    writer = AsyncCheckpointWriter()
    writer._idle.clear()
    writer._jobs.put(("not a job",))
    writer._thread.join(10)
    assert not writer._thread.is_alive()
    for call in (writer.wait, lambda: writer.save("/nonexistent", "x", small_payload(1))):
        result = []
        waiter = threading.Thread(target=lambda result=result, call=call: result.append(_raised(call)), daemon=True)
        waiter.start()
        waiter.join(20)
        assert not waiter.is_alive() and isinstance(result[0], BackgroundFailure), result
        assert str(result[0]).startswith(THREAD_FAILED) and "checkpoint-writer" in str(result[0])


def _raised(call):
    try:
        call()
    except BaseException as exc:  # noqa: BLE001 - what the test looks at
        return exc
    return None


def test_async_writer_returns_at_once_and_reports_errors(tmp_path):
    writer = AsyncCheckpointWriter()
    assert writer.wait() is None
    opened = threading.Event()
    done = []
    payload = small_payload(1)
    payload.objects["gate"] = Gate(opened)
    name = checkpoint_name(0, 1, 0)

    t0 = time.monotonic()
    writer.save(tmp_path, name, payload, on_done=done.append)
    assert time.monotonic() - t0 < 1.0
    assert not (tmp_path / name).exists()  # held mid-write by the gate: the write runs in the background

    second = threading.Thread(target=writer.save, args=(tmp_path, checkpoint_name(0, 2, 0), small_payload(2)))
    second.start()
    second.join(0.3)
    assert second.is_alive(), "save() must wait for the previous write to finish"
    opened.set()
    second.join(10)
    assert not second.is_alive()
    assert done == [tmp_path / name]
    assert writer.wait() == tmp_path / checkpoint_name(0, 2, 0)
    verify_checkpoint(tmp_path / name)
    assert read_checkpoint(tmp_path / name).objects["gate"] == {}

    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    writer.save(not_a_dir, name, small_payload(3))
    with pytest.raises(CheckpointError, match="file"):
        writer.wait()
    assert writer.wait() == tmp_path / checkpoint_name(0, 2, 0)  # the error was reported once

    with pytest.raises(CheckpointError, match="meta"):
        writer.save(tmp_path, name, CheckpointPayload({"w": torch.empty(2, device="meta")}, {}, {}))


def test_resolve_resume_local(tmp_path):
    root = tmp_path / "ckpts"
    with pytest.raises(CheckpointError, match="start without --resume"):
        resolve_resume("latest", root, log=lambda m: None)
    first, second = save(root, 1), save(root, 2)
    assert resolve_resume("latest", root) == second
    assert resolve_resume(first.name, root) == first
    assert resolve_resume(str(first), tmp_path / "elsewhere") == first

    flip_byte(second / "model.safetensors")
    logs = []
    assert resolve_resume("latest", root, log=logs.append) == first
    assert len(logs) == 1 and "skipping" in logs[0] and second.name in logs[0]
    with pytest.raises(CheckpointError, match="crc32c"):
        resolve_resume(second.name, root)
    with pytest.raises(CheckpointError, match="checkpoint-epoch0-step99-files0"):
        resolve_resume(checkpoint_name(0, 99, 0), root)
    with pytest.raises(CheckpointError, match="no-such-dir"):
        resolve_resume(str(tmp_path / "no-such-dir"), root)


def test_resolve_resume_from_gcs(tmp_path, gcs_emulator):
    from utils.io import storage

    client = gcs_emulator.client()
    remote = f"gs://{gcs_emulator.bucket}/proj/checkpoints/run1"
    source = tmp_path / "source"
    complete = save(source, 5, numel=4096)
    storage.upload_directory(client, complete, f"{remote}/{complete.name}")
    partial = save(source, 9)
    (partial / MANIFEST).unlink()  # an upload that stopped before its manifest
    storage.upload_directory(client, partial, f"{remote}/{partial.name}")

    local = tmp_path / "local"
    logs = []
    got = resolve_resume("latest", local, remote, log=logs.append)  # default client: STORAGE_EMULATOR_HOST
    assert got == local / complete.name
    assert verify_checkpoint(got) == json.loads((complete / MANIFEST).read_text())
    assert read_checkpoint(got).trainer_state["step"] == 5
    assert any(partial.name in m and "incomplete upload" in m for m in logs)
    assert [p.name for p in local.iterdir()] == [complete.name]

    # A broken local copy of a remote checkpoint is replaced by a fresh download.
    flip_byte(got / "model.safetensors")
    assert resolve_resume(complete.name, local, remote, client_factory=gcs_emulator.client,
                          log=lambda m: None) == got
    verify_checkpoint(got)

    with pytest.raises(CheckpointError, match="incomplete upload"):
        resolve_resume(partial.name, tmp_path / "other", remote, client_factory=gcs_emulator.client,
                       log=lambda m: None)

    # A gs:// URL is downloaded under its last path component; a newer remote beats an older local one.
    by_url = resolve_resume(f"{remote}/{complete.name}", tmp_path / "by-url", client_factory=gcs_emulator.client)
    assert by_url == tmp_path / "by-url" / complete.name
    older_local = tmp_path / "older"
    save(older_local, 2)
    assert resolve_resume("latest", older_local, remote, client_factory=gcs_emulator.client,
                          log=lambda m: None) == older_local / complete.name

    with pytest.raises(CheckpointError, match="start without --resume"):
        resolve_resume("latest", tmp_path / "empty", f"gs://{gcs_emulator.bucket}/nothing/here",
                       client_factory=gcs_emulator.client, log=lambda m: None)


def test_dcp_metadata_builds_nothing_but_dcp_s_own_metadata(tmp_path, subprocess_env):
    """A real `.metadata`, read as before; the same behind a crafted prefix that uses admitted names only and
    BUILDs {"_str": PATH} onto pathlib.PosixPath (every path the process then builds would point at PATH, and a
    resume would delete it): refused in one line, no path changed. Each read in its own process."""
    import torch.distributed.checkpoint as dcp

    from tests.trainkit import REPO_ROOT

    checkpoint = tmp_path / "ck"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.randn(4, 4), "o": {"step": 3}}, checkpoint_id=str(checkpoint / "dcp"))
    real = (checkpoint / "dcp" / ".metadata").read_bytes()
    victim = str(tmp_path / "victim.txt").encode()
    crafted = (b"\x80\x04cpathlib\nPosixPath\nN}X\x04\x00\x00\x00_strX" + len(victim).to_bytes(4, "little") + victim
               + b"s\x86b0" + real)
    probe = ("import sys; from pathlib import Path; from utils.checkpoint.sharded import MetadataReader\n"
             "from utils.errors import UserError\n"
             "try:\n    m = MetadataReader.checked(sys.argv[1]).metadata; print('read', len(m.state_dict_metadata))\n"
             "except UserError as e:\n    print('error:', e)\n"
             "print('path', Path('/somewhere/else'))\n")
    outputs = []
    for data in (real, crafted):
        (checkpoint / "dcp" / ".metadata").write_bytes(data)
        proc = subprocess.run([sys.executable, "-c", probe, str(checkpoint)], env=subprocess_env, cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
        outputs.append(proc.stdout.splitlines())
    assert outputs[0] == ["read 2", "path /somewhere/else"], outputs[0]
    assert len(outputs[1]) == 2 and outputs[1][1] == "path /somewhere/else", outputs[1]
    assert re.match(r"error: \S+/dcp/\.metadata sets state on PosixPath, which is none of DCP's metadata: refused",
                    outputs[1][0]), outputs[1][0]


@pytest.mark.slow
def test_a_crafted_trainer_state_json_is_one_line_naming_the_field(tmp_path, subprocess_env):
    """trainer_state.json (a checkpoint may come from a bucket) with a string step, a negative one, a config whose
    max_steps is -5, and a model shape far beyond the weights saved: --resume and generate.py stop in one line
    naming the file and field (they were a traceback, "Resumed at step -5", "max_steps changed -5 -> 4", and a
    traceback allocating the shape)."""
    import sys

    from tests.trainkit import REPO_ROOT, make_shards, run, train_cmd
    from utils.io.storage import file_crc32c

    data, out = make_shards(tmp_path / "data", n_files=3, rows=16), tmp_path / "out"
    run(train_cmd(out, data, "max_steps=2", "save_steps=2"), subprocess_env)
    original = next((out / "checkpoints").glob("checkpoint-*"))

    def crafted(name, edit):
        checkpoint = tmp_path / name / original.name
        shutil.copytree(original, checkpoint)
        state = json.loads((checkpoint / "trainer_state.json").read_text())
        edit(state)
        (checkpoint / "trainer_state.json").write_text(json.dumps(state))
        manifest = json.loads((checkpoint / "manifest.json").read_text())  # whoever crafts it writes this too
        manifest["files"]["trainer_state.json"] = {"size": (checkpoint / "trainer_state.json").stat().st_size,
                                                   "crc32c": file_crc32c(checkpoint / "trainer_state.json")}
        (checkpoint / "manifest.json").write_text(json.dumps(manifest))
        return checkpoint

    cases = [
        ("string", lambda s: s.update(step="2"), "resume", r"trainer_state\.json: step is '2', not an integer"),
        ("negative", lambda s: s.update(step=-5), "resume", r"trainer_state\.json: step is -5, not an integer"),
        ("max_steps", lambda s: s["config"].update(max_steps=-5), "resume",  # --max-steps set: checked all the same
         r"trainer_state\.json: config: max_steps=-5 must be at least 1; the checkpoint is corrupt or crafted"),
        ("huge", lambda s: s["model"].update(hidden_size=1_000_000), "generate",
         r"trainer_state\.json: model's shape \(hidden_size 1,000,000, .*more than its [\d,]+ bytes of weights hold"),
    ]
    for name, edit, tool, said in cases:
        checkpoint = crafted(name, edit)
        if tool == "resume":
            cmd = train_cmd(tmp_path / f"out-{name}", data, "max_steps=4", extra=("--resume", str(checkpoint)))
        else:
            cmd = [sys.executable, str(REPO_ROOT / "generate.py"), str(checkpoint), "--prompt", "x"]
        proc = run(cmd, subprocess_env, check=False, timeout=180)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, (name, proc.stderr[-3000:])
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and re.search(said, errors[0]), (name, errors, proc.stderr[-2000:])
        assert "Resumed at step" not in proc.stdout + proc.stderr
