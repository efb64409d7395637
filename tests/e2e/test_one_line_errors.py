"""Every fault a user can meet is one line (or one clear warning) and
loses nothing. Mostly in-process checks against real files, a real full disk (/dev/full, a small tmpfs), a
real unprivileged user (setpriv) and the GCS emulator; a few toy-sized subprocess runs. The last test
runs every command-line entry point against bad inputs and asserts no traceback reaches stderr."""
from __future__ import annotations

import json
import math
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.trainkit import REPO_ROOT, make_shards, train_cmd
from utils.checkpoint.format import CheckpointPayload, checkpoint_name, write_checkpoint
from utils.errors import DiskFullError, UserError
from utils.io import files

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def as_nobody_ok() -> bool:
    return os.getuid() == 0 and shutil.which("setpriv") is not None


def fake_checkpoint(root: Path, step: int, extra_files: dict | None = None) -> Path:
    """A real (tiny) checkpoint written by the real writer: one tensor, a model record, an rng object."""
    payload = CheckpointPayload({"w": torch.arange(4.0)}, {"rng": [{}]},
                                {"step": step, "epoch": 0, "tokens": step * 8, "world_size": 1,
                                 "model": {"name": "tiny"}})
    return write_checkpoint(root, checkpoint_name(0, step, 1), payload, extra_files)


def run_py(args: list, timeout: float = 120, user: list | None = None, cwd=REPO_ROOT, env=None, **kw):
    env = dict(env or os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.run((user or []) + [sys.executable, *map(str, args)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout, **kw)


def one_line(proc, code: int = 2) -> str:
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == code, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, proc.stderr
    return lines[0]


# ------------------------------------------------------------------------------------- bug 1: disk full

def test_disk_full_guard_names_the_file_and_passes_other_errors(tmp_path):
    with pytest.raises(DiskFullError, match=r"no space left on .* writing /dev/full \(.*free"):
        with files.disk_full_guard("/dev/full"), open("/dev/full", "w") as f:
            f.write("x" * 10_000)
    with pytest.raises(PermissionError):  # not a full disk: unchanged
        with files.disk_full_guard(tmp_path / "x"):
            raise PermissionError(13, "denied")


def test_a_cyclic_exception_chain_is_walked_in_bounded_time(tmp_path):
    """A chain whose __context__ leads back to itself (as urllib3's retries made while GCS did not answer):
    is_disk_full answered at once, where it walked the cycle for good at 100% CPU."""
    import threading

    a, b = ConnectionError("a"), TimeoutError("b")
    a.__context__, b.__context__ = b, a
    full = OSError(28, "No space left on device")
    c = RuntimeError("c")
    c.__context__, full.__context__ = full, c  # a cycle that holds a full disk further on
    answers = []
    walker = threading.Thread(target=lambda: answers.extend([files.is_disk_full(a), files.is_disk_full(c)]),
                              daemon=True)
    walker.start()
    walker.join(20)
    assert not walker.is_alive() and answers == [False, True]
    with pytest.raises(ConnectionError):  # not a full disk: unchanged, at once
        with files.disk_full_guard(tmp_path / "x"):
            raise a


def test_log_line_on_a_full_disk_is_one_line(tmp_path):
    """logs/metrics.jsonl linked to /dev/full: the promised DiskFullError, not a TypeError."""
    from utils.observe.metrics import RunLogger

    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "metrics.jsonl").symlink_to("/dev/full")
    logger = RunLogger(tmp_path / "logs", is_main=True)
    with pytest.raises(DiskFullError, match=r"writing \S+metrics.jsonl .*--resume auto"):
        logger.write_row({"step": 1, "loss": 1.0})
    logger.info("still printable after the failure")  # the files are dropped, nothing fails again
    logger.close()


def test_tensorboard_on_a_full_disk_is_one_line(tmp_path, monkeypatch):
    """TensorBoard's writer thread hits the full disk: one DiskFullError from the next log call, and its
    thread's own error reaches no excepthook (which would print it as a traceback in a run)."""
    import threading

    from accelerate import Accelerator

    from utils.observe.metrics import RunLogger
    from utils.observe.trackers import TRACKERS

    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("needs root to mount a small tmpfs")
    reached = []
    monkeypatch.setattr(threading, "excepthook", reached.append)  # what a run's default hook would print
    try:
        logger = RunLogger(tmp_path / "logs", is_main=True)
        accelerator = Accelerator(log_with=[TRACKERS["tensorboard"]("tb", mount)], cpu=True)
        logger.start_trackers(accelerator, "tb", {"a": 1}, None)
        with pytest.raises(DiskFullError, match=r"no space left on .*small"):
            for step in range(1, 20_000):
                logger.write_row({"step": step, "tokens": step, "loss": 1.0 + step, "lr": 0.1})
                if step % 500 == 0:
                    logger._tensorboard.flush()
        logger.close()
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)
    assert reached == []
    threading.excepthook(threading.ExceptHookArgs((ValueError, ValueError("x"), None, threading.current_thread())))
    assert [type(args.exc_value) for args in reached] == [ValueError]  # any other thread's error still reaches it


def test_checkpoint_on_a_full_disk_is_one_line(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("needs root to mount a small tmpfs")
    try:
        payload = CheckpointPayload({"w": torch.zeros(200_000)}, {}, {"step": 1})
        with pytest.raises(DiskFullError, match=r"about 0\.00 GB needed.*--resume auto"):
            write_checkpoint(mount, checkpoint_name(0, 1, 1), payload)
        assert not any(mount.iterdir()), "the partial checkpoint was left behind"
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def under_file_size_limit(limit_bytes: int):
    """A preexec_fn: the child may write files of at most `limit_bytes` (RLIMIT_FSIZE, `ulimit -f`)."""
    import resource

    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))


@pytest.mark.parametrize("small_disk", ["256k"], indirect=True)
def test_an_hf_export_on_a_full_disk_is_one_line_and_whole_or_absent(tmp_path, small_disk):
    """write_export (final_model/ at a run's end, scripts/export_hf.py): a full disk is one DiskFullError naming
    the folder, and the export is written whole or not at all: an earlier export there stays intact, no
    half-written folder or temporary is left (one was, with a config.json a later look took for an export)."""
    from configs.model_config import get_model_spec
    from utils.model import build_model
    from utils.run.export import write_export

    spec = get_model_spec("tiny")
    weights = build_model(spec, seed=0).state_dict()  # ~660 KB as safetensors: past the 256 KB disk
    final = small_disk / "final_model"
    final.mkdir()
    (final / "config.json").write_text("{}")  # an earlier export, kept
    with pytest.raises(DiskFullError, match=rf"no space left on .*small writing {re.escape(str(final))} .*the "
                                            r"checkpoints are intact: export one with scripts/export_hf.py"):
        write_export(weights, spec, final, None)
    assert [p.name for p in small_disk.iterdir()] == ["final_model"], list(small_disk.iterdir())
    assert [p.name for p in final.iterdir()] == ["config.json"] and (final / "config.json").read_text() == "{}"


@pytest.mark.slow
def test_export_and_prepare_past_the_file_size_limit_are_one_line(small_corpus, tmp_path, gcs_emulator):
    """A file past the size limit (EFBIG: `ulimit -f`) is a write that found no room, in the writers' one guard:
    scripts/export_hf.py (safetensors' SafetensorError) and prepare_data.py writing a gs:// output (numpy's
    OSError in a worker) were tracebacks; now one line naming the limit, exit 2, nothing exported or
    published, the partitions done kept."""
    from tests.e2e.test_crafted_files import tiny_checkpoint

    checkpoint, out = tiny_checkpoint(tmp_path / "ckpt"), tmp_path / "exported"
    proc = run_py([REPO_ROOT / "scripts" / "export_hf.py", checkpoint, out], preexec_fn=under_file_size_limit(100_000))
    assert f"error: file too large writing {out}: past this process's file-size limit of 100,000 bytes (ulimit -f);" \
           in one_line(proc) and not out.exists() and not list(tmp_path.glob(".exported*")), proc.stderr
    corpus, tok = small_corpus
    output = f"gs://{gcs_emulator.bucket}/data"
    proc = run_py([REPO_ROOT / "prepare_data.py", "--no-progress", "--workers", "1", "--input", corpus, "--tokenizer",
                   tok, "--output", output, "--shard-tokens", "1024"], preexec_fn=under_file_size_limit(1000))
    line = one_line(proc)
    assert "error: file too large writing" in line and "raise that limit and run the same command again: nothing " \
           "was published, and the partitions already done are kept" in line, line
    names = [blob.name for blob in gcs_emulator.client().list_blobs(gcs_emulator.bucket)]
    assert "data/dataset.json" not in names and not any(n.startswith("data/") for n in names), names


# -------------------------------------------------------------- bug 2: an unreadable newest checkpoint

def test_an_unreadable_newest_checkpoint_directory_is_skipped(open_tmp):
    if not as_nobody_ok():
        pytest.skip("needs root and setpriv to run as an unprivileged user")
    root = open_tmp / "ckpts"
    older, newest = fake_checkpoint(root, 2), fake_checkpoint(root, 4)
    os.chmod(root, 0o755)
    os.chmod(newest, 0o000)
    code = ("from utils.checkpoint.format import find_latest_local; "
            f"print('LATEST', find_latest_local({str(root)!r}).name)")
    proc = run_py(["-c", code], user=NOBODY)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert f"skipping checkpoint {newest.name}" in proc.stdout and "check its permissions" in proc.stdout
    assert f"LATEST {older.name}" in proc.stdout


# ----------------------------------------------------------------------------------------- config

def test_an_empty_config_file_is_refused(tmp_path):
    from configs.training_config import ConfigError, get_training_config

    path = tmp_path / "empty.yaml"
    path.write_text("# nothing yet\n")
    with pytest.raises(ConfigError, match=r"empty.yaml: the file is empty"):
        get_training_config(str(path))


def test_report_to_none_with_trackers_is_refused():
    from configs.training_config import ConfigError, get_training_config

    with pytest.raises(ConfigError, match=r"'none' cannot be combined"):
        get_training_config("demo", {"report_to": "tensorboard,none"})
    assert get_training_config("demo", {"report_to": "none"}).report_to == "none"


def test_warmup_longer_than_the_run_warns_once_with_print_config(capsys):
    """(A run prints it once, after a resume decided its values: tests/e2e/test_resume.py.)"""
    import train

    assert train.main(["--config", "demo", "--set", "max_steps=10", "--set", "warmup_steps=50", "--print-config"]) == 0
    assert capsys.readouterr().err.count("warning: warmup_steps=50 exceeds max_steps=10") == 1
    assert train.main(["--config", "demo", "--set", "max_steps=100", "--set", "warmup_steps=50", "--print-config"]) == 0
    assert "warmup_steps" not in capsys.readouterr().err


def test_a_tracker_without_its_package_is_one_line_and_others_keep_working(monkeypatch):
    import importlib.util

    from utils.observe.trackers import usable_trackers

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    said = []
    assert usable_trackers("tensorboard,wandb", warn=said.append) == ["tensorboard"]
    assert len(said) == 1 and "pip install wandb" in said[0]


# ---------------------------------------------------------------------------- bug 3 and prepare_data

@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    from tests.e2e.test_prepare_data import bpe_tokenizer

    root = tmp_path_factory.mktemp("prep")
    (root / "corpus").mkdir()
    for i in range(3):
        (root / "corpus" / f"d{i}.txt").write_text("the quick brown fox jumps over the lazy dog " * (50 + i))
    return root / "corpus", bpe_tokenizer(root / "tokenizer.json", vocab=300)


def prepare_cli(*args, timeout: float = 120):
    return run_py([REPO_ROOT / "prepare_data.py", "--no-progress", "--workers", "1", *args], timeout=timeout)


def test_a_second_prepare_on_one_output_is_refused_at_start(small_corpus, tmp_path):
    from utils.data.prepare import lock_output

    corpus, tok = small_corpus
    out = tmp_path / "data"
    held = lock_output(out)  # this test plays the first, still running, prepare_data
    try:
        line = one_line(prepare_cli("--input", corpus, "--tokenizer", tok, "--output", out))
    finally:
        held.release()
    assert f"{out} is in use by another live run (host" in line and f"pid {os.getpid()}" in line
    assert "--output" in line and not out.exists()
    proc = prepare_cli("--input", corpus, "--tokenizer", tok, "--output", out)
    assert proc.returncode == 0 and "prepared 3 documents" in proc.stdout, proc.stderr


def test_prepare_output_that_is_a_file_and_a_non_gs_upload_are_one_line_before_work(small_corpus, tmp_path):
    corpus, tok = small_corpus
    (tmp_path / "file").write_text("x")
    line = one_line(prepare_cli("--input", corpus, "--tokenizer", tok, "--output", tmp_path / "file"))
    assert "--output" in line and "is a file" in line
    line = one_line(prepare_cli("--input", corpus, "--tokenizer", tok, "--output", tmp_path / "o",
                                "--upload", "s3://bucket/x"))
    assert "--upload s3://bucket/x" in line and not (tmp_path / "o").exists()


def test_non_utf8_input_names_the_line_and_the_byte(tmp_path):
    from utils.data.corpus import PrepareError, read_documents

    good = "".join(json.dumps({"text": "word " * 2000}) + "\n" for _ in range(20))  # past the decoder's buffer
    path = tmp_path / "bad.jsonl"
    path.write_bytes(good.encode() + b'{"text": "caf\xe9"}\n')
    with pytest.raises(PrepareError, match=rf"invalid continuation byte at line 21, byte {len(good.encode()) + 13}\)"):
        list(read_documents(path, "text"))


def test_prepare_on_a_full_disk_is_one_line(small_corpus, tmp_path):
    from utils.data.prepare import PrepareOptions, prepare

    corpus, tok = small_corpus
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("needs root to mount a small tmpfs")
    try:
        with pytest.raises(DiskFullError, match=r"no space left on .*small.*run the same command again"):
            prepare([str(corpus)], str(tok), mount / "data", PrepareOptions(shard_tokens=1024))
        # nothing that looks like a dataset: the hidden staging area alone, kept for the rerun
        assert [p.name for p in mount.iterdir()] == [".data.staging"], "a partial output was left"
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


@pytest.mark.slow
def test_sigterm_during_prepare_leaves_no_worker_tracebacks(tmp_path):
    import signal
    import time

    from tests.e2e.test_prepare_data import bpe_tokenizer

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(400):
        (corpus / f"d{i:03d}.txt").write_text("the quick brown fox jumps over the lazy dog " * 400)
    tok = bpe_tokenizer(tmp_path / "tokenizer.json", vocab=300)
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, REPO_ROOT / "prepare_data.py", "--input", corpus, "--tokenizer", tok,
                             "--output", tmp_path / "out", "--workers", "2", "--no-progress", "--partition-mb", "1",
                             "--shard-tokens", "1024"], env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (tmp_path / ".out.staging").exists():
        time.sleep(0.05)
    time.sleep(1.0)  # the pool is up and tokenizing
    assert proc.poll() is None, "finished before the signal"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    time.sleep(0.5)  # orphaned workers would print after the main process exits
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    assert "interrupted: nothing was published; the partitions already done are kept" in err
    assert not (tmp_path / "out").exists() and not any(files.is_temp_name(p.name) for p in tmp_path.iterdir())


# ------------------------------------------------------------------------------------ the output-dir lock

def test_processes_forked_under_the_lock_do_not_hold_it(tmp_path):
    """A run with DataLoader workers is killed with -9: the orphaned workers must not keep the lock."""
    import signal
    import time

    from utils.io.lock import OutputDirLock

    code = ("import os, sys, time; from utils.io.lock import OutputDirLock; OutputDirLock(sys.argv[1]).acquire(); "
            "pid = os.fork()\nif pid == 0: print(os.getpid(), flush=True); time.sleep(60); os._exit(0)\n"
            "time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                            text=True, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    child = int(proc.stdout.readline())  # the child runs (its fork hooks have run) before the kill
    try:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        said = []
        lock = OutputDirLock(tmp_path)
        lock.acquire(log=said.append)  # the child is still alive: before the fix this is refused
        assert said and f"pid {proc.pid}" in said[0] and "no longer alive" in said[0]
        lock.release()
    finally:
        os.kill(child, signal.SIGKILL)
        time.sleep(0.1)


def test_an_output_dir_this_user_may_not_write_is_one_line(open_tmp):
    if not as_nobody_ok():
        pytest.skip("needs root and setpriv to run as an unprivileged user")
    out = open_tmp / "out"
    out.mkdir()  # owned by root, 0755
    code = ("import sys; from utils.errors import UserError; from utils.io.lock import OutputDirLock\n"
            f"try: OutputDirLock({str(out)!r}).acquire()\nexcept UserError as e: print('error:', e)")
    proc = run_py(["-c", code], user=NOBODY)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert f"cannot create {out}/.run.lock (Permission denied) ({out} is owned by root)" in proc.stdout


# ------------------------------------------------------------------ bug 4: extra files at save time

@pytest.mark.slow
def test_a_tokenizer_made_after_setup_is_in_the_checkpoint_and_export_warns_without_one(tmp_path):
    """The demo builds its data (and tokenizer.json) after the Checkpointer exists: checkpoints must still
    carry it. A checkpoint without one exports with a warning naming --tokenizer."""
    from accelerate import Accelerator

    from configs.model_config import get_model_spec
    from utils.checkpoint.checkpointer import Checkpointer, CheckpointPolicy
    from utils.checkpoint.run_record import RunRecord
    from utils.model import build_model
    from utils.observe.metrics import RunLogger
    from utils.training.state import TrainState

    accelerator = Accelerator(cpu=True)
    log = RunLogger(tmp_path / "logs", is_main=True)
    tokenizer = tmp_path / "data" / "tokenizer.json"
    spec = get_model_spec("tiny")
    model = build_model(spec, seed=0)
    state = TrainState()
    states = {"model": model, "optimizer": torch.optim.AdamW(model.parameters()), "train": state}
    policy = CheckpointPolicy(tmp_path / "checkpoints", keep=3, extra_files={"tokenizer.json": tokenizer})
    ckpt = Checkpointer(accelerator, states, policy, RunRecord(1, model=spec.to_dict(), max_steps=10),
                        lambda: checkpoint_name(0, state.step, 1), log)
    state.step = 1
    bare = ckpt.save(1)
    ckpt.wait()
    tokenizer.parent.mkdir()
    tokenizer.write_text('{"made": "after setup"}')
    state.step = 2
    with_tok = ckpt.save(2)
    ckpt.wait()
    log.close()
    assert not (bare / "tokenizer.json").exists()
    assert (with_tok / "tokenizer.json").read_text() == '{"made": "after setup"}'

    proc = run_py([REPO_ROOT / "scripts" / "export_hf.py", bare, tmp_path / "exported"], timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "warning: " in proc.stderr and "holds no tokenizer.json" in proc.stderr and "--tokenizer PATH" in proc.stderr
    proc = run_py([REPO_ROOT / "scripts" / "export_hf.py", bare, tmp_path / "e2", "--tokenizer", tmp_path / "nope"])
    assert "error: --tokenizer" in proc.stderr and "no such file" in proc.stderr and proc.returncode == 2


# ------------------------------------------------------------------------- the general guard: no traceback

def guard_cases(tmp: Path) -> list[tuple[str, list]]:
    """(what, argv) pairs: every command-line entry point against bad input it can meet (config mistakes
    share one path in train.py, checked in-process above; one of them runs here)."""
    data = make_shards(tmp / "data", n_files=2, rows=8)
    (tmp / "a_file").write_text("x")
    (tmp / "not_a_checkpoint").mkdir()
    (tmp / "corpus.txt").write_text("some text")
    (tmp / "other_run" / "checkpoints" / "checkpoint-epoch0-step2-files0").mkdir(parents=True)
    py = sys.executable
    train = [py, "train.py", "--config", "demo", "--set", "model=tiny", "--output-dir", str(tmp / "out"),
             "--data-dir", str(data)]
    prepare = [py, "prepare_data.py", "--no-progress", "--workers", "1"]
    download = [py, "download_training_data.py", "--no-progress"]
    export = [py, "scripts/export_hf.py"]
    cases = [
        ("train: unknown preset", [py, "train.py", "--config", "nope"]),
        ("train: data dir is a file", train[:-1] + [str(tmp / "a_file")]),
        ("train: output dir is a file", train[:6] + [str(tmp / "a_file")] + train[7:]),
        ("train: resume from a non-checkpoint dir", train + ["--resume", str(tmp / "not_a_checkpoint")]),
        ("start_training.sh: unknown preset", ["bash", "start_training.sh", "--cpu", "--config", "nope"]),
        ("start_training.sh: bad --gpus", ["bash", "start_training.sh", "--cpu", "--config", "demo", "--gpus", "x"]),
        ("start_training.sh: --gpus 0", ["bash", "start_training.sh", "--config", "demo", "--gpus", "0"]),
        ("start_training.sh: unknown option", ["bash", "start_training.sh", "--config", "demo", "--bogus"]),
        ("start_training.sh: no --config", ["bash", "start_training.sh", "--cpu"]),
        ("launch.py: no command", [py, "utils/runtime/launch.py"]),
        ("train: a fresh run into another run's folder", train[:6] + [str(tmp / "other_run")] + train[7:]),
        ("prepare: missing input", prepare + ["--input", str(tmp / "nope"), "--tokenizer", "t", "--output",
                                                   str(tmp / "o")]),
        ("prepare: missing tokenizer", prepare + ["--input", str(tmp / "corpus.txt"), "--tokenizer",
                                                  str(tmp / "nope.json"), "--output", str(tmp / "p")]),
        ("prepare: output is a file", prepare + ["--input", str(tmp / "corpus.txt"), "--tokenizer", "t",
                                                 "--output", str(tmp / "a_file")]),
        ("prepare: s3 upload", prepare + ["--input", str(tmp / "corpus.txt"), "--tokenizer", "t", "--output",
                                          str(tmp / "p"), "--upload", "s3://my-bucket/x"]),
        ("download: s3 source", download + ["--source", "s3://my-bucket/x", "--dest", str(tmp / "d")]),
        ("download: --max-files 0", download + ["--source", "gs://my-bucket/x", "--dest", str(tmp / "d"),
                                                "--max-files", "0"]),
        ("download: --workers 0", download + ["--source", "gs://my-bucket/x", "--dest", str(tmp / "d"),
                                              "--workers", "0"]),
        ("download: GCS unreachable", download + ["--source", "gs://my-bucket/x", "--dest", str(tmp / "d")]),
        ("export: not a checkpoint", export + [str(tmp / "not_a_checkpoint"), str(tmp / "e")]),
        ("export: output is a file", export + [str(tmp / "not_a_checkpoint"), str(tmp / "a_file")]),
    ]
    (tmp / "empty.yaml").write_text("# nothing\n")
    (tmp / "twice.yaml").write_text("base: demo\nlearning_rate: 1.0e-3\nlearning_rate: 2.0e-3\n")
    (tmp / "empty_source").mkdir()
    cases += [  # issue 26: settings that cannot train, mixtures that cannot be mixed, config files
        ("train: learning_rate=nan", train + ["--set", "learning_rate=nan"]),
        ("train: adam_beta2=1.5", train + ["--set", "adam_beta2=1.5"]),
        ("train: adam_eps=-1", train + ["--set", "adam_eps=-1"]),
        ("train: max_grad_norm=-1", train + ["--set", "max_grad_norm=-1"]),
        ("train: a data_mix source named twice", train + ["--set", f"data_mix=a={data}:1,a={data}:1"]),
        ("train: a Windows path without a weight", train + ["--set", r"data_mix=a=C:\data"]),
        ("train: an empty data_mix source under the demo",
         train + ["--set", f"data_mix=a={data}:1,b={tmp / 'empty_source'}:1"]),
        ("train: an empty config file", [py, "train.py", "--config", str(tmp / "empty.yaml")]),
        ("train: a config file with a key twice", [py, "train.py", "--config", str(tmp / "twice.yaml")]),
        ("train: cpu preset without its data", [py, "train.py", "--config", "cpu", "--output-dir", str(tmp / "out"),
                                                "--data-dir", str(tmp / "nope")]),
    ]
    crafted = crafted_sharded_checkpoint(tmp / "crafted")
    outside_tokenizer = make_shards(tmp / "outside_tokenizer", n_files=2, rows=8)
    (outside_tokenizer / "dataset.json").write_text(json.dumps({
        "format": "gpt-neox-shards", "version": 1, "dtype": "uint16", "documents": 1, "tokens": 1,
        "tokenizer": {"file": str(tmp / "corpus.txt"), "vocab_size": 512, "eos_id": 0}, "shards": []}))
    cases += [
        ("train: resume from a checkpoint whose dcp/.metadata runs code",
         train + ["--set", "val_files=1", "--resume", str(crafted)]),
        ("export: a checkpoint whose dcp/.metadata runs code", export + [str(crafted), str(tmp / "e3")]),
        ("train: dataset.json's tokenizer outside the data dir", train[:-1] + [str(outside_tokenizer)]),
    ]
    if (REPO_ROOT / "generate.py").is_file():
        cases += [("generate: missing model", [py, "generate.py", str(tmp / "nope")]),
                  ("generate: a checkpoint whose dcp/.metadata runs code",
                   [py, "generate.py", str(crafted), "--prompt", "x"])]
    cases += tool_cases(tmp)
    cases += text_cases(tmp)
    cases += crafted_input_cases(tmp)
    return cases


def crafted_input_cases(tmp: Path) -> list[tuple[str, list]]:
    """Issue 41's inputs: crafted model, checkpoint, dataset and prepare files, and numbers past their ranges."""
    py, root = sys.executable, tmp / "issue41"
    data = make_shards(root / "data", n_files=3, rows=16)
    train = [py, "train.py", "--config", "demo", "--output-dir", str(root / "out")]
    for setting in ("model=tiny", "compile_model=false", "mixed_precision=no", "val_files=1",
                    "dataloader_num_workers=0", "optimizer=adamw"):  # its crafted optimizer.pt is AdamW's
        train += ["--set", setting]
    from tests.e2e.test_prepare_data import bpe_tokenizer

    tokenizer = bpe_tokenizer(root / "bpe.json", vocab=300)  # so that each gets as far as its crafted file
    generate = [py, "generate.py", "--prompt", "x", "--tokenizer", str(tokenizer)]
    cases = [(f"train: {what}", train + ["--data-dir", str(folder)])
             for what, folder in dataset_cases(root, data, tokenizer)]
    cases += [(f"generate: an HF directory whose {what}", generate + [str(folder)]) for what, folder in hf_cases(root)]
    cases += [(f"generate: a checkpoint whose trainer_state.json has {what}", generate + [str(folder)])
              for what, folder in record_cases(root)]
    run_out = root / "run"
    run_py(train_cmd(run_out, data, "max_steps=1", "save_steps=1")[1:], timeout=300).check_returncode()
    cases += [(f"train: resume from a checkpoint whose {what}",  # a step past the checkpoint's max_steps=1, kept
               train + ["--data-dir", str(data), "--set", "max_steps=2", "--resume", str(where)])
              for what, where in resume_cases(root, run_out)]
    config = root / "config"
    config.mkdir()
    (config / "binary.yaml").write_text("base: demo\nrun_name: !!binary aGVsbG8=\n")
    (config / "yes.yaml").write_text("base: demo\nmixed_precision: yes\n")
    from tests.e2e.test_settings import huge_head_model

    cases += [
        ("train: init_from an HF directory of one position", train + ["--data-dir", str(data), "--set",
                                                                       f"init_from={root / 'hf-one-position'}"]),
        ("train: a gradient norm past fp32 at step 1",
         train + ["--data-dir", str(data), "--set", "max_steps=2", "--set",
                  f"init_from={huge_head_model(root / 'huge-head')}"]),
        ("train: --set max_steps=<400 digits>", train + ["--data-dir", str(data), "--set", "max_steps=" + "9" * 400]),
        ("train: --set z_loss=1e30", train + ["--data-dir", str(data), "--set", "z_loss=1e30"]),
        ("train: a config file with !!binary", [py, "train.py", "--config", str(config / "binary.yaml")]),
        ("train: mixed_precision: yes in a config file", [py, "train.py", "--config", str(config / "yes.yaml")]),
    ]
    for i, (_, argv) in enumerate(cases):  # each run its own output folder: they run two at a time
        if "--output-dir" in argv:
            argv[argv.index("--output-dir") + 1] = str(root / f"out-{i}")
    return cases + prepare_cases(root)


def dataset_cases(root: Path, data: Path, tokenizer: Path) -> list[tuple[str, Path]]:
    """Data folders whose dataset.json is nested 100,000 deep, names a shard path holding a NUL, or records the
    sha256 of another tokenizer than the tokenizer.json beside it (`tokenizer`)."""
    from tests.e2e.test_crafted_files import write_dataset

    folders = {}
    for name in ("nested", "nul", "tokenizer"):
        folders[name] = root / f"data-{name}"
        shutil.copytree(data, folders[name])
    train_shards = sorted(p.relative_to(data).as_posix() for p in data.rglob("*.npz"))
    (folders["nested"] / "dataset.json").write_text("[" * 100_000 + "]" * 100_000)
    with_nul = json.loads(write_dataset(folders["nul"], train_shards, []).joinpath("dataset.json").read_text())
    with_nul["shards"][0]["path"] += "\0x"
    (folders["nul"] / "dataset.json").write_text(json.dumps(with_nul))
    described = json.loads(write_dataset(folders["tokenizer"], train_shards, []).joinpath("dataset.json").read_text())
    described["tokenizer"]["sha256"] = "0" * 64
    (folders["tokenizer"] / "dataset.json").write_text(json.dumps(described))
    shutil.copy(tokenizer, folders["tokenizer"] / "tokenizer.json")
    return [("dataset.json is nested 100,000 deep", folders["nested"]),
            ("dataset.json names a shard path holding a NUL", folders["nul"]),
            ("tokenizer.json is not the one dataset.json records", folders["tokenizer"]),
            ("every token is the end-of-document id", eos_only_data(root / "data-eos", described=True))]


def hf_cases(root: Path) -> list[tuple[str, Path]]:
    """HF directories (the tiny GPT-NeoX) past their config check: see test_crafted_files."""
    from safetensors.torch import load_file, save_file

    from tests.trainkit import tiny_hf_model

    good = tiny_hf_model(root / "hf-good")
    config = json.loads((good / "config.json").read_text())
    crafted = {"config.json is nested": "[" * 100_000 + "]" * 100_000,
               "max_position_embeddings is 1": {"max_position_embeddings": 1},
               "rope factor is 'nan'": {"rope_parameters": {**config["rope_parameters"], "factor": "nan"}},
               "rope factor is 0": {"rope_parameters": {**config["rope_parameters"], "factor": 0}},
               "weights are int32": lambda w: {k: v.int() for k, v in w.items()},
               "weights hold NaN": lambda w: {k: v.fill_(float("nan")) for k, v in w.items()},
               "model.safetensors is a symlink out of it": None}
    cases = []
    for i, (what, change) in enumerate(crafted.items()):
        folder = root / ("hf-one-position" if i == 1 else f"hf-{i}")
        shutil.copytree(good, folder)
        if isinstance(change, (str, dict)):
            (folder / "config.json").write_text(change if isinstance(change, str) else json.dumps({**config, **change}))
        elif change is not None:
            save_file(change(load_file(str(folder / "model.safetensors"))), str(folder / "model.safetensors"))
        else:
            (folder / "model.safetensors").rename(root / "outside.safetensors")
            (folder / "model.safetensors").symlink_to(root / "outside.safetensors")
        cases.append((what, folder))
    return cases


def record_cases(root: Path) -> list[tuple[str, Path]]:
    """Checkpoints of the tiny model whose trainer_state.json's model record is crafted."""
    from configs.model_config import get_model_spec
    from tests.e2e.test_crafted_files import tiny_checkpoint

    tiny = get_model_spec("tiny").to_dict()
    crafted = {"heads not dividing hidden_size": {"num_attention_heads": 5},
               "a NaN rotary_pct": {"rotary_pct": math.nan},
               "a negative eps": {"layer_norm_eps": -1e-5}, "an unknown activation": {"hidden_act": "bogus"},
               "a string boolean": {"use_parallel_residual": "false"}, "one position": {"max_position_embeddings": 1},
               "a vocabulary larger than its weights": {"vocab_size": 1000}}
    return [(what, tiny_checkpoint(root / f"record-{i}", tiny | change))
            for i, (what, change) in enumerate(crafted.items())]


def resume_cases(root: Path, run_out: Path) -> list[tuple[str, Path]]:
    """Copies of a real run's checkpoint whose trainer_state.json's config is "x", or whose optimizer.pt holds a
    moment of another shape than its parameter, or a `step` that is NaN (the manifest rewritten to match)."""
    from tests.e2e.test_crafted_files import refresh_manifest

    (checkpoint,) = (run_out / "checkpoints").iterdir()
    copies = []
    for name in ("config", "optimizer", "step"):
        copy = root / f"resume-{name}" / checkpoint.name
        shutil.copytree(checkpoint, copy)
        if name == "config":
            state = json.loads((copy / "trainer_state.json").read_text())
            (copy / "trainer_state.json").write_text(json.dumps({**state, "config": "x"}))
            refresh_manifest(copy, "trainer_state.json")
        else:
            optimizer = torch.load(copy / "optimizer.pt", weights_only=True)
            if name == "optimizer":
                optimizer["state"][0]["exp_avg"] = torch.zeros(3, 3)
            else:
                optimizer["state"][0]["step"] = torch.tensor(math.nan)
            torch.save(optimizer, copy / "optimizer.pt")
            refresh_manifest(copy, "optimizer.pt")
        copies.append(copy)
    return [("trainer_state.json's config is 'x'", copies[0]),
            ("optimizer.pt has a moment of the wrong shape", copies[1]),
            ("optimizer.pt's step is NaN", copies[2])]


def prepare_cases(root: Path) -> list[tuple[str, list]]:
    """prepare_data.py with --partition-mb 1e308, on a staging area whose completion record names a symlinked
    shard, and on a finished output whose dataset.json lists a shard that is not there."""
    from utils.data.prepare import PrepareOptions, prepare

    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i} " + "word " * 40}) + "\n" for i in range(40)))
    args = ["--input", str(corpus), "--tokenizer", str(root / "bpe.json"), "--shard-tokens", "1024", "--val-fraction",
            "0"]
    done = root / "prepared"
    prepare([str(corpus)], str(root / "bpe.json"), done,
            PrepareOptions(shard_tokens=1024, val_fraction=0.0))  # as the CLI's
    described = json.loads((done / "dataset.json").read_text())
    staging = root / ".linked.staging"
    (staging / "p00000").mkdir(parents=True)
    shutil.copy(done / "plan.json", staging / "plan.json")
    (staging / "p00000" / "shard-00000.npz").symlink_to(done / described["shards"][0]["path"])
    record = {"partition": 0, "plan": described["fingerprint"], "documents": described["documents"],
              "documents_empty": 0, "tokens": described["tokens"], "validation": {"documents": 0, "tokens": 0},
              "shards": [{**described["shards"][0], "path": "shard-00000.npz"}]}
    (staging / "p00000" / "done.json").write_text(json.dumps(record))
    (done / described["shards"][-1]["path"]).unlink()
    prepare_py = [sys.executable, "prepare_data.py", "--no-progress", "--workers", "1", *args]
    return [("prepare: --partition-mb 1e308",
             prepare_py + ["--output", str(root / "p-big"), "--partition-mb", "1e308"]),
            ("prepare: a completion record naming a symlinked shard", prepare_py + ["--output", str(root / "linked")]),
            ("prepare: a reused output whose dataset.json lists a missing shard", prepare_py + ["--output", str(done)])]


def text_cases(tmp: Path) -> list[tuple[str, list]]:
    """Issue 32's text inputs: a lone surrogate or deeply nested JSON in a corpus line or a task file,
    non-finite --partition-mb, an unknown evaluate.py --device."""
    from tests.e2e.test_prepare_data import bpe_tokenizer

    tokenizer = bpe_tokenizer(tmp / "bpe.json")
    nested = '{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n"
    for name, line in (("surrogate", '{"text": "a \\ud800 b"}\n'), ("nested", nested)):
        (tmp / f"corpus-{name}").mkdir()
        (tmp / f"corpus-{name}" / "a.jsonl").write_text(line)
    (tmp / "task-surrogate.jsonl").write_text('{"context": "a \\ud800", "continuation": " b"}\n')
    (tmp / "task-nested.jsonl").write_text(nested.replace('"text"', '"context"'))
    py = sys.executable
    prepare = [py, "prepare_data.py", "--no-progress", "--workers", "1", "--tokenizer", str(tokenizer)]
    evaluate = [py, "scripts/evaluate.py", str(tmp / "hf-truncated")]
    return [
        ("prepare: a lone surrogate in a corpus line", prepare + ["--input", str(tmp / "corpus-surrogate"),
                                                                  "--output", str(tmp / "p3")]),
        ("prepare: deeply nested JSON in a corpus line", prepare + ["--input", str(tmp / "corpus-nested"),
                                                                    "--output", str(tmp / "p4")]),
        ("prepare: --partition-mb nan", prepare + ["--input", str(tmp / "corpus.txt"), "--output", str(tmp / "p5"),
                                                   "--partition-mb", "nan"]),
        ("prepare: --partition-mb inf", prepare + ["--input", str(tmp / "corpus.txt"), "--output", str(tmp / "p6"),
                                                   "--partition-mb", "inf"]),
        ("evaluate: --device tpu", evaluate + ["--task", str(tmp / "task-surrogate.jsonl"), "--device", "tpu"]),
        ("evaluate: a lone surrogate in a task file", evaluate + ["--task", str(tmp / "task-surrogate.jsonl")]),
        ("evaluate: deeply nested JSON in a task file", evaluate + ["--task", str(tmp / "task-nested.jsonl")]),
    ]


def crafted_sharded_checkpoint(root: Path) -> Path:
    """A sharded checkpoint (the tiny model's record, no weights) whose dcp/.metadata is a pickle that would
    create `root/code-ran`."""
    from configs.model_config import get_model_spec
    from tests.e2e.test_crafted_files import RunsCode

    root.mkdir(parents=True)
    (root / "metadata").write_bytes(pickle.dumps(RunsCode(root / "code-ran")))
    payload = CheckpointPayload(None, {"rng": [{}]}, {"step": 1, "epoch": 0, "tokens": 8, "world_size": 1,
                                                     "model": get_model_spec("tiny").to_dict()})
    return write_checkpoint(root, checkpoint_name(0, 1, 1), payload, {"dcp/.metadata": root / "metadata"})


def crafted_manifest(root: Path) -> Path:
    """A checkpoint whose manifest.json's format_version is "1" (it was a TypeError traceback)."""
    checkpoint = fake_checkpoint(root, 3)
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    (checkpoint / "manifest.json").write_text(json.dumps({**manifest, "format_version": "1"}))
    return checkpoint


def tool_cases(tmp: Path) -> list[tuple[str, list]]:
    """Issue 26's inputs to generate.py, export_hf.py, plot_run.py and prepare_data.py's tokenizer."""
    from configs import get_model_spec
    from utils.model.families import family

    config = family("gpt_neox").hf().hf_config(get_model_spec("tiny")).to_dict()
    for name, extra, weights in (("hf-truncated", {}, b"\x08\x00\x00"), ("hf-mamba", {"model_type": "mamba"}, b""),
                                 ("hf-auto-map", {"auto_map": {"AutoModel": "m.M"}}, b""),
                                 ("hf-no-weights", {}, None), ("hf-heads-5", {"num_attention_heads": 5}, b""),
                                 ("hf-string-size", {"hidden_size": "64"}, b""),
                                 ("hf-eos-beyond", {"eos_token_id": 10**6}, b"")):
        (tmp / name).mkdir()
        (tmp / name / "config.json").write_text(json.dumps(config | extra))
        if weights is not None:
            (tmp / name / "model.safetensors").write_bytes(weights)
    (tmp / "run" / "logs").mkdir(parents=True)
    (tmp / "run" / "logs" / "metrics.jsonl").write_text('{"step": 1, "tokens": 8, "loss": 2.0}\n')
    (tmp / "half-gpt2").mkdir()
    (tmp / "half-gpt2" / "vocab.json").write_text('{"a": 0}')
    py = sys.executable
    generate = [py, "generate.py", str(tmp / "hf-truncated"), "--prompt", "x"]
    return [
        ("generate: --temperature nan", generate + ["--temperature", "nan"]),
        ("generate: --top-k -1", generate + ["--top-k", "-1"]),
        ("generate: --device tpu", generate + ["--device", "tpu"]),
        *((f"generate: {name}", [py, "generate.py", str(tmp / name), "--prompt", "x"])
          for name in ("hf-truncated", "hf-auto-map", "hf-mamba", "hf-no-weights", "hf-heads-5", "hf-string-size",
                       "hf-eos-beyond")),
        ("generate: a manifest.json whose format_version is a string",
         [py, "generate.py", str(crafted_manifest(tmp / "manifest")), "--prompt", "x"]),
        ("export: a malformed --tokenizer", [py, "scripts/export_hf.py", str(tmp / "not_a_checkpoint"),
                                              str(tmp / "e2"), "--tokenizer", str(tmp / "a_file")]),
        ("plot_run: -o plot.txt", [py, "scripts/plot_run.py", str(tmp / "run"), "-o", str(tmp / "plot.txt")]),
        ("prepare: vocab.json without merges.txt", [py, "prepare_data.py", "--no-progress", "--input",
                                                    str(tmp / "corpus.txt"), "--tokenizer", str(tmp / "half-gpt2"),
                                                    "--output", str(tmp / "p2")]),
    ]


@pytest.mark.slow
def test_no_entry_point_shows_a_traceback_for_bad_input(tmp_path):
    """Every case: something said on stderr, no traceback, a non-zero exit. The Python commands run as processes forked
    from warm interpreters (tests/warm_python.py: their imports done once, not 80 times), the shell ones as they
    are."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from tests.warm_python import WarmPython

    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               STORAGE_EMULATOR_HOST="http://127.0.0.1:9", PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    env.pop("GOOGLE_APPLICATION_CREDENTIALS", None)

    cases = guard_cases(tmp_path)
    warm = [WarmPython(env, tmp_path / f"warm-{i}") for i in range(2)]  # the Python commands: forked, see there
    idle = list(warm)

    def one(case):
        what, argv = case
        started = time.monotonic()
        if argv[0] == sys.executable:
            python = idle.pop()
            try:
                proc = python.run(argv[1:], cwd=REPO_ROOT, timeout=300)
            finally:
                idle.append(python)
        else:
            proc = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
        print(f"{time.monotonic() - started:5.1f} s  {what}")
        return what, proc

    try:
        with ThreadPoolExecutor(len(warm)) as pool:
            results = list(pool.map(one, cases))
    finally:
        for python in warm:
            python.close()
    assert sum(python.count for python in warm) == sum(argv[0] == sys.executable for _, argv in cases)
    bad = [f"{what} (exit {p.returncode}):\n{p.stderr[-1500:]}" for what, p in results
           if "Traceback" in p.stderr or p.returncode == 0 or not p.stderr.strip()]
    assert not bad, "\n\n".join(bad)
    for what, words in (("train: resume from a checkpoint whose optimizer.pt's step is NaN",
                         "its optimizer state cannot be continued from: gpt_neox.embed_in.weight's step is nan"),
                        ("train: every token is the end-of-document id",
                         "is id 0 (the end-of-document token): there is nothing to learn")):
        said = dict(results)[what].stderr
        assert words in said, (what, said)
    assert not (tmp_path / "crafted" / "code-ran").exists(), "a crafted checkpoint ran its code"


# ------------------------------------------------------------------------------------------------ data

def eos_only_data(folder: Path, described: bool) -> Path:
    """Three shards whose every token is 0, the end-of-document id of the dataset.json beside them (as prepare
    writes it, sizes and crc32c true) when `described`."""
    import numpy as np

    from tests.e2e.test_crafted_files import write_dataset
    from utils.io.storage import file_crc32c

    folder.mkdir(parents=True)
    names = [f"shard-{i}.npz" for i in range(3)]
    for name in names:
        np.savez(folder / name, input_ids=np.zeros(1024, np.uint16))
    if described:
        described = json.loads(write_dataset(folder, names[:2], names[2:]).joinpath("dataset.json").read_text())
        for entry in described["shards"] + described["validation"]["shards"]:
            entry.update(tokens=1024, crc32c=file_crc32c(folder / entry["path"]))
        (folder / "dataset.json").write_text(json.dumps(described))
    return folder


def test_data_of_end_of_document_tokens_alone_is_refused_by_prepare_and_training(small_corpus, tmp_path):
    """Documents whose text is the tokenizer's end-of-document token alone are empty ones: a corpus of nothing
    else is prepare's "the corpus is empty" line (it prepared shards of EOS ids); shards whose every token is one
    id (made by hand, or by an earlier prepare) are refused when training opens them, naming the end-of-document
    token where dataset.json records it (it trained to a zero loss and exported without a word)."""
    from utils.data.build import open_source
    from utils.data.corpus import PrepareError
    from utils.data.index import DataDirError
    from utils.data.prepare import PrepareOptions, prepare
    from utils.data.source import OpenRequest, Source

    _, tok = small_corpus
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "d.jsonl").write_text(json.dumps({"text": "<|endoftext|>"}) + "\n" +
                                                 json.dumps({"text": "<|endoftext|><|endoftext|>"}) + "\n")
    with pytest.raises(PrepareError, match=r"the corpus is empty: 1 input file\(s\), 2 empty document\(s\) "
                                           r"\(no text, or only end-of-document tokens: the tokenizer's "
                                           r"'<\|endoftext\|>'\)"):
        prepare([str(tmp_path / "corpus")], str(tok), tmp_path / "out", PrepareOptions(shard_tokens=1024))
    request = OpenRequest(seq_len=64, vocab_size=512, log=lambda line: None)
    for described, what in ((True, " (the end-of-document token)"), (False, "")):
        data = eos_only_data(tmp_path / f"data-{described}", described)
        said = f"{data}: every token of its 2 training shard(s) is id 0{what}: there is nothing to learn; prepare"
        with pytest.raises(DataDirError, match="^" + re.escape(said)):
            open_source(Source("data", path=data, val_files=1), request)


def test_hidden_files_and_folders_in_the_data_dir_are_ignored_and_counted(tmp_path):
    from utils.data.index import ShardIndex

    data = make_shards(tmp_path / "data", n_files=2, rows=8)
    make_shards(tmp_path / "data" / ".data.partial-host-123-abcd", n_files=2, rows=8)  # a killed prepare_data
    shutil.copy(next((tmp_path / "data").rglob("shard-000.npz")), data / ".editor-copy.npz")
    said = []
    index = ShardIndex.build(data, seq_len=64, vocab_size=512, log=said.append)
    assert len(index) == 2 and all(not part.startswith(".") for s in index.shards for part in Path(s.path).parts)
    assert any("ignoring 3 .npz file(s) under hidden names" in line for line in said), said


def test_download_refuses_max_files_zero_and_negative(capsys):
    import download_training_data as dl

    for bad in ("0", "-3"):
        assert dl.main(["--source", "gs://my-bucket/x", "--dest", "/nonexistent/x", "--max-files", bad,
                        "--no-progress"]) == 2
        assert f"error: --max-files must be at least 1, got {bad}" in capsys.readouterr().err


@pytest.fixture
def two_sources(gcs_emulator):
    from tests.e2e.test_download import shard_bytes
    from utils.io.storage import make_client

    bucket = make_client().bucket(gcs_emulator.bucket)
    for source in ("web", "code"):
        for i in range(3):
            bucket.blob(f"mix/{source}/shard-{i}.npz").upload_from_string(
                shard_bytes(i + (10 if source == "web" else 0)))
    return f"gs://{gcs_emulator.bucket}/mix"


def test_a_bad_dest_is_said_once(two_sources, open_tmp, capsys):
    import download_training_data as dl

    (open_tmp / "file").write_text("x")
    assert dl.main(["--source", f"{two_sources}/web", "--dest", str(open_tmp / "file"), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "FAILED" not in err and err.count("error:") == 1 and "is a file" in err


def test_several_sources_in_one_call(two_sources, tmp_path, capsys):
    import download_training_data as dl

    assert dl.main(["--source", f"{two_sources}/web", "--source", f"py={two_sources}/code", "--dest",
                    str(tmp_path / "d"), "--no-progress"]) == 0
    assert sorted(p.relative_to(tmp_path / "d").as_posix() for p in (tmp_path / "d").rglob("*.npz")) == [
        "py/shard-0.npz", "py/shard-1.npz", "py/shard-2.npz", "web/shard-0.npz", "web/shard-1.npz", "web/shard-2.npz"]
    assert dl.main(["--source", f"{two_sources}/web", "--source", f"{two_sources}/x/web", "--dest", "d"]) == 2
    assert "two sources would go into d/web; name them" in capsys.readouterr().err


def test_download_on_a_full_disk_is_one_line(two_sources, tmp_path, capsys):
    import download_training_data as dl

    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8k", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("needs root to mount a small tmpfs")
    try:
        assert dl.main(["--source", f"{two_sources}/web", "--dest", str(mount / "d"), "--no-progress",
                        "--workers", "1"]) == 1
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)
    err = capsys.readouterr().err
    assert "FAILED" not in err and err.count("error:") == 1, err
    assert "no space left on" in err and "completed files are kept" in err


# ------------------------------------------------------------------------------------------- init_from

@pytest.mark.parametrize("sharded", [False, True])
def test_init_from_a_directory_with_only_pytorch_model_bin(tmp_path, sharded):
    """Older Pythia revisions ship only pytorch_model.bin (single or sharded with its index): load them."""
    from dataclasses import replace

    from configs.model_config import get_model_spec
    from utils.model import build_model
    from utils.model.hf import load_hf_pretrained, to_transformers

    spec = replace(get_model_spec("tiny"), pad_vocab_multiple=1)
    d = tmp_path / "old"
    hf = to_transformers(build_model(spec, seed=3, impl="hf").state_dict(), spec)
    hf.config.save_pretrained(d)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if sharded:
        keys = sorted(state)
        parts = {"pytorch_model-00001-of-00002.bin": keys[: len(keys) // 2],
                 "pytorch_model-00002-of-00002.bin": keys[len(keys) // 2:]}
        for name, part in parts.items():
            torch.save({k: state[k] for k in part}, d / name)
        (d / "pytorch_model.bin.index.json").write_text(json.dumps(
            {"weight_map": {k: name for name, part in parts.items() for k in part}}))
    else:
        torch.save(state, d / "pytorch_model.bin")
    _, loaded = load_hf_pretrained(d)
    assert "lm_head.weight" in loaded and "gpt_neox.embed_in.weight" in loaded
    for key, value in loaded.items():
        assert torch.equal(value, state[key]), key
    if not sharded:  # a pickle that holds more than tensors is refused, not executed
        from utils.model.hf import HFLoadError

        torch.save({"x": Path("anything but a tensor")}, d / "pytorch_model.bin")
        with pytest.raises(HFLoadError, match=r"pytorch_model.bin: cannot read it"):
            load_hf_pretrained(d)


# ---------------------------------------------------------------------------------------------- resume

def test_resume_from_an_output_dir_or_its_checkpoints_folder_says_what_it_is(tmp_path):
    from utils.checkpoint.format import CheckpointError
    from utils.checkpoint.resume import resolve_resume

    out = tmp_path / "run"
    names = [fake_checkpoint(out / "checkpoints", step).name for step in (2, 4, 6)]
    for given, what in ((out, "a run's output directory"), (out / "checkpoints", "a folder of checkpoints")):
        with pytest.raises(CheckpointError) as err:
            resolve_resume(str(given), tmp_path / "elsewhere", log=lambda m: None)
        msg = str(err.value)
        assert f"{given} is {what}, not a checkpoint; it holds 3 checkpoints: {', '.join(names)}" in msg
        assert f"--resume {out / 'checkpoints' / names[-1]}" in msg and f"--output-dir {out} --resume latest" in msg
        assert "delete it" not in msg
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="neither a checkpoint nor a folder holding any"):
        resolve_resume(str(tmp_path / "empty"), tmp_path / "elsewhere", log=lambda m: None)


def test_resume_gs_folder_missing_name_and_missing_bucket_are_told_apart(gcs_emulator, tmp_path):
    from utils.checkpoint.format import CheckpointError
    from utils.checkpoint.resume import resolve_resume
    from utils.io.storage import make_client, upload_directory

    client = make_client()
    run_url = f"gs://{gcs_emulator.bucket}/checkpoints/run1"
    for step in (2, 4):
        path = fake_checkpoint(tmp_path / "local", step)
        upload_directory(client, path, f"{run_url}/{path.name}")
    messages = {}
    for key, url in (("folder", run_url), ("name", f"{run_url}/checkpoint-epoch0-step9-files1"),
                     ("bucket", "gs://no-such-bucket-here/checkpoints/run1")):
        with pytest.raises(CheckpointError) as err:
            resolve_resume(url, tmp_path / "dl", log=lambda m: None)
        messages[key] = str(err.value)
    assert "is a folder of checkpoints, not a checkpoint; it holds 2 checkpoints" in messages["folder"]
    assert f"--resume {run_url}/checkpoint-epoch0-step4-files1" in messages["folder"]
    assert "nothing in gs://" in messages["name"] and "under that name" in messages["name"]
    assert "bucket gs://no-such-bucket-here does not exist" in messages["bucket"]
    assert resolve_resume(f"{run_url}/checkpoint-epoch0-step4-files1", tmp_path / "dl", log=lambda m: None).is_dir()


# ------------------------------------------------------------------------------------------------- GCS

def test_repeated_upload_failures_keep_only_the_newest_failed_checkpoint(gcs_emulator, tmp_path):
    """A mistyped bucket: every upload fails. Retention may delete all but the newest failed checkpoint
    (it used to keep every one, and a long run filled its disk), and says so once."""
    from utils.checkpoint.format import apply_retention, list_checkpoints
    from utils.checkpoint.upload import BackgroundUploader

    lines = []
    uploader = BackgroundUploader(synchronous=True, log=lines.append)
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3, 4):
        path = fake_checkpoint(root, step)
        uploader.submit(path, f"gs://no-such-bucket-here/ck/{path.name}")
        apply_retention(root, keep=2, protect={path} | uploader.protected(), log=lines.append)
    assert [p.name for p in list_checkpoints(root)] == [checkpoint_name(0, s, 1) for s in (3, 4)]
    said = [line for line in lines if "uploads failed in a row" in line]
    assert len(said) == 1 and "keeping only the newest" in said[0]
    report = uploader.close()
    assert len(report.failed) == 4
    assert sum("upload it with:" in line for line in report.summary()) == 2  # the two still on disk
    assert sum("retention keeps only the newest" in line for line in report.summary()) == 2


def test_a_missing_bucket_is_one_line_at_start_and_unreachable_gcs_only_warns(gcs_emulator, tmp_path):
    from benchmarks.bench_checkpoint import BlackHole
    from utils.checkpoint.upload import BackgroundUploader
    from utils.io.storage import StorageError

    lines = []
    uploader = BackgroundUploader(synchronous=True, log=lines.append)
    uploader.check(f"gs://{gcs_emulator.bucket}/ck/run")  # fine: nothing said, no probe left behind
    assert not lines and not list(gcs_emulator.client().list_blobs(gcs_emulator.bucket))
    with pytest.raises(StorageError, match=r"gs://no-such-bucket-here does not exist .*check gcs_bucket"):
        uploader.check("gs://no-such-bucket-here/ck/run")
    hole = BlackHole()
    try:
        os.environ["STORAGE_EMULATOR_HOST"] = hole.url  # gcs_emulator's monkeypatch restores it
        import time

        started = time.monotonic()
        from utils.io.storage import check_writable, make_client

        warning = check_writable(make_client(), "gs://some-bucket/ck/run", timeout=1.0)
        assert time.monotonic() - started < 10
        assert warning and "could not reach GCS within 1 s" in warning and "training goes on" in warning
    finally:
        hole.close()


def test_a_slow_gcs_call_says_what_it_waits_for(monkeypatch, capfd):
    import time

    from utils.io import storage

    monkeypatch.setattr(storage, "SLOW_NOTICE_S", 0.2)
    storage.retry_call(lambda: time.sleep(0.6), what="listing gs://b/x", retries=2)
    err = capfd.readouterr().err
    assert "GCS: listing gs://b/x: no answer after 0 s; waiting up to 60 s per attempt, 3 attempts" in err
    storage.retry_call(lambda: None, what="listing gs://b/y", retries=2)
    time.sleep(0.4)
    assert "gs://b/y" not in capfd.readouterr().err  # a quick call says nothing


def test_log_files_owned_by_another_user_are_one_line(open_tmp):
    if not as_nobody_ok():
        pytest.skip("needs root and setpriv to run as an unprivileged user")
    logs = open_tmp / "out" / "logs"
    logs.mkdir(parents=True)
    (logs / "training.log").write_text("root's run\n")  # 0644, owned by root
    os.chmod(logs, 0o777)
    code = ("from utils.errors import UserError; from utils.observe.metrics import RunLogger\n"
            f"try: RunLogger({str(logs)!r}, True)\nexcept UserError as e: print('error:', e)")
    proc = run_py(["-c", code], user=NOBODY)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert f"error: cannot write {logs}/training.log (Permission denied) ({logs}/training.log is owned by root)" \
        in proc.stdout


def test_a_lock_held_by_a_dead_runs_child_says_so(tmp_path):
    """Should a child of a dead run still hold the lock (one that kept the descriptor on purpose), the
    refusal says the run is dead and who to look for, rather than naming the dead pid as the live run."""
    import signal

    from utils.io.lock import OutputDirBusy, OutputDirLock

    code = ("import os, sys, time, fcntl; from utils.io.lock import OutputDirLock; l = OutputDirLock(sys.argv[1]); "
            "l.acquire(); fd = os.dup(l._fd)\npid = os.fork()\n"
            "if pid == 0: print(os.getpid(), flush=True); time.sleep(60); os._exit(0)\ntime.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                            text=True, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    child = int(proc.stdout.readline())
    try:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        with pytest.raises(OutputDirBusy, match=rf"the run that locked it \(.*pid {proc.pid}.*\) is dead, but a "
                                                rf"process it started still holds"):
            OutputDirLock(tmp_path).acquire(log=lambda m: None)
    finally:
        os.kill(child, signal.SIGKILL)


def test_write_guard_names_the_path_and_owner(open_tmp):
    theirs = open_tmp / "final_model"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    with pytest.raises(UserError, match=rf"cannot write {theirs}/model.safetensors \(Permission denied\) \({theirs} is "
                                        rf"owned by nobody\); export elsewhere"):
        with files.write_guard(theirs, advice="export elsewhere"):
            raise PermissionError(13, "Permission denied", str(theirs / "model.safetensors"))
    with pytest.raises(DiskFullError, match="export elsewhere"):
        with files.write_guard(theirs, advice="export elsewhere"):
            raise OSError(28, "No space left on device")


# ------------------------------------------------------------- issue 56: numbers past what the machine holds

def entry_point_parser(module_name: str):
    """The argparse parser an entry point builds (caught as its main() parses `--help`)."""
    import argparse
    import importlib

    caught = []

    class Caught(Exception):
        pass

    def capture(parser, *args, **kwargs):
        caught.append(parser)
        raise Caught

    module = importlib.import_module(module_name)
    original = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = capture
    try:
        module.main(["--help"])
    except Caught:
        pass
    finally:
        argparse.ArgumentParser.parse_args = original
    return caught[0]


@pytest.mark.parametrize("module_name", ["prepare_data", "generate", "download_training_data", "scripts.evaluate",
                                         "scripts.memory_plan", "scripts.make_demo_task"])
def test_every_numeric_flag_refuses_a_number_past_the_machine_in_one_line(module_name, capsys):
    """Every int or float flag of every entry point parses through utils/cli.py's number_flag: 400 nines (an int
    past int64, a float past its range) and inf / nan are one error line naming the flag (CommandLine: argparse
    printed its usage first), never an OverflowError deep in the run."""
    parser = entry_point_parser(module_name)
    numeric = [a for a in parser._actions if getattr(a.type, "__name__", None) in ("int", "float")]
    assert numeric and all(a.type not in (int, float) for a in numeric), "a numeric flag bypasses number_flag"
    for action in numeric:
        flag = action.option_strings[-1]
        bad = {"9" * 400: "must be below 2^63" if action.type.__name__ == "int" else "must be a finite number"}
        if action.type.__name__ == "float":
            bad |= {"inf": "must be a finite number", "nan": "must be a finite number"}
        for value, words in bad.items():
            with pytest.raises(SystemExit) as exited:
                parser.parse_args([flag, value])
            err = capsys.readouterr().err
            assert exited.value.code == 2 and err.startswith(f"error: argument {flag}: {words}"), (flag, value, err)
            assert err.count("\n") == 1 and err.endswith(" --help lists the options\n"), err  # no usage block


def test_a_number_flag_and_a_set_value_past_int64_are_one_line_naming_it(tmp_path, subprocess_env):
    """train.py's --max-steps is parsed as --set's values are (configs/settle.py); the launcher refuses a
    number bash's arithmetic would wrap (it compared 400 nines as -1) before anything starts."""
    from configs.model_config import ConfigError
    from configs.settle import settle_config

    huge = "9" * 400
    with pytest.raises(ConfigError, match=r"^--max-steps: max_steps must be below 2\^63, got a number of 400 digits$"):
        settle_config("demo", [], {"max_steps": int(huge)}, device=("cpu", None))
    with pytest.raises(ConfigError, match=r"learning_rate must be a finite number, got inf"):
        settle_config("demo", ["learning_rate=1e999"], {}, device=("cpu", None))
    proc = run_py([REPO_ROOT / "train.py", "--config", "demo", "--max-steps", huge, "--output-dir", tmp_path / "o"])
    assert "--max-steps: max_steps must be below 2^63" in one_line(proc) and not (tmp_path / "o").exists()
    for flag in ("--max-steps", "--gpus", "--max-restarts", "--restart-delay", "--node-rank"):
        proc = subprocess.run([str(REPO_ROOT / "start_training.sh"), "--cpu", "--config", "demo", "--dry-run", flag,
                               huge], env=subprocess_env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and proc.stdout == "", (flag, proc.stdout, proc.stderr)
        assert proc.stderr == f"start_training.sh: error: {flag}: a number of 400 digits is out of range (at most 18 " \
                              f"digits)\n"
    proc = subprocess.run([str(REPO_ROOT / "start_training.sh"), "--cpu", "--config", "demo", "--dry-run", "--gpus",
                           "08", "--main-port", "0080"], env=subprocess_env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr  # base 10: bash read 08 as a bad octal number
    assert "--num_processes 8 " in proc.stdout and "--main_process_port 80 " in proc.stdout, proc.stdout
