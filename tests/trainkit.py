"""Helpers for tests that run the real train.py / start_training.sh in subprocesses on tiny data."""
from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent

# Settings every tiny run shares: the tiny model, fp32 on CPU, no compile, fast loader, frequent logs, AdamW
# (the demo preset's Muon is tested where it is named: tests/unit/training/test_muon.py).
TINY = ["model=tiny", "compile_model=false", "mixed_precision=no", "dataloader_num_workers=0",
        "logging_steps=1", "eval_interval=1000", "eval_batches=2", "warmup_steps=2", "val_files=1",
        "learning_rate=3e-3", "optimizer=adamw"]


def make_shards(data_dir: Path, n_files: int = 4, rows: int = 64, seq_len: int = 64, vocab: int = 512,
                seed: int = 0, ids: tuple[int, int] | None = None) -> Path:
    """Nested 2-D shards of learnable token sequences (arithmetic runs mod vocab, random starts); with
    `ids=(low, high)` every id lies in [low, high) (sources with disjoint token ranges)."""
    low, high = ids or (0, vocab)
    rng = np.random.default_rng(seed)
    for i in range(n_files):
        sub = data_dir / f"part-{i % 2}" / f"sub-{i // 2}"
        sub.mkdir(parents=True, exist_ok=True)
        start = rng.integers(0, high - low, size=(rows, 1))
        stride = rng.integers(1, 4, size=(rows, 1))
        tokens = low + (start + stride * np.arange(seq_len)[None, :]) % (high - low)
        np.savez(sub / f"shard-{i:03d}.npz", input_ids=tokens.astype(np.uint16))
    return data_dir


def train_cmd(out: Path, data: Path, *sets: str, extra: tuple = (), config: str = "demo") -> list[str]:
    cmd = [sys.executable, str(REPO_ROOT / "train.py"), "--config", config, "--output-dir", str(out),
           "--data-dir", str(data)]
    for s in TINY + list(sets):
        cmd += ["--set", s]
    return cmd + list(extra)


def earlier_engine_cmd(engine: Path, out: Path, data: Path, *sets: str, extra: tuple = ()) -> list[str]:
    """train_cmd for the train.py of an earlier engine (engine_at) without `--set optimizer=adamw`: the engines
    before the `optimizer` field refuse it, and their demo preset trained AdamW."""
    cmd = [sys.executable, str(engine / "train.py")] + train_cmd(out, data, *sets, extra=extra)[2:]
    at = cmd.index("optimizer=adamw")
    return cmd[:at - 1] + cmd[at + 1:]


def demo_recipe_cmd(engine: Path, out: Path, data: Path, *sets: str, extra: tuple = ()) -> list[str]:
    """A run of the demo preset's own recipe (its optimizer, learning rate and warmup: none of them set on the
    command) on the tiny settings, by the train.py of `engine` (REPO_ROOT, or an earlier engine: engine_at):
    the command a user who started a demo run on an earlier engine resumes with."""
    own = [s for s in TINY if not s.startswith(("learning_rate=", "optimizer=", "warmup_steps="))]
    cmd = [sys.executable, str(engine / "train.py"), "--config", "demo", "--output-dir", str(out),
           "--data-dir", str(data)]
    return cmd + [a for s in [*own, *sets] for a in ("--set", s)] + list(extra)


# `[sys.executable, "-c", PINNED, "0,1", *cmd]` runs cmd on those CPUs (sched_setaffinity, inherited by all it
# starts; `nproc` counts them): a test's thread counts then do not depend on the machine's cores.
PINNED = ("import os, sys; os.sched_setaffinity(0, map(int, sys.argv[1].split(','))); "
          "os.execv(sys.argv[2], sys.argv[2:])")


# What libraries read once, when they are imported (OpenMP's threads and wait, torch's and transformers' switches,
# the interpreter's own): commands whose environments differ in one of these are forked from different interpreters.
IMPORT_TIME = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "TORCH", "PYTORCH_", "TRANSFORMERS_", "HF_",
               "TOKENIZERS_", "ACCELERATE_", "PYTHON", "LD_", "CUDA_", "NVIDIA_", "TF_", "TRITON_")
WARM_SERVERS = 3  # warm interpreters a test worker keeps, one per such environment, the least recently used closed
_warm: dict = {}  # this process's warm interpreters (WarmPython), by the environment's import-time variables
_warm_lock = threading.Lock()


def _import_time(env: dict) -> tuple:
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_TIME)))


def _warm_python(cmd: list[str], env: dict, cwd):
    """The warm interpreter (tests/warm_python.py) to fork `cmd` from, or None (start it cold): for `python
    SCRIPT.py ...` of this repo (an earlier engine's copy imports its own modules, not the ones preloaded), on one
    thread; one interpreter for each set of the variables libraries read at import (IMPORT_TIME)."""
    if len(cmd) < 2 or cmd[0] != sys.executable or not cmd[1].endswith(".py"):
        return None
    script = (Path(cwd) / cmd[1]).resolve()
    if REPO_ROOT not in script.parents or not script.is_file() or os.environ.get("NEOX_TESTS_COLD"):
        return None
    if env.get("OMP_NUM_THREADS") != "1":  # OpenMP's threads do not survive a fork: one thread, none to start
        return None
    key = _import_time(env)
    python = _warm.pop(key, None)
    if python is None:
        from tests.warm_python import PRELOAD, WarmPython

        if len(_warm) >= WARM_SERVERS:
            _warm.pop(next(iter(_warm))).close()
        python = WarmPython(env, Path(tempfile.mkdtemp(prefix="warm-python-")), PRELOAD)
        atexit.register(shutil.rmtree, python.workdir, True)
        atexit.register(python.close)
    _warm[key] = python  # the most recently used last
    return python


def forked_runs() -> int:
    """How many commands this test worker's warm interpreters have run."""
    return sum(python.count for python in _warm.values())


def run(cmd: list[str], env: dict, timeout: float = 300, check: bool = True, cwd=REPO_ROOT,
        cold: bool = False) -> subprocess.CompletedProcess:
    """Runs `cmd` to its end. A Python script of this repo is forked from a warm interpreter (its imports done once
    per test worker: tests/warm_python.py) unless `cold` (a test of what a fresh interpreter does: its imports, the
    threads' wait it chooses before torch loads) or it computes on more than one thread; anything else starts cold,
    as subprocess.run starts it."""
    cmd = [str(c) for c in cmd]
    if not cold and _warm_lock.acquire(blocking=False):  # one command at a time; another thread's starts cold
        try:
            python = _warm_python(cmd, env, cwd)
            proc = None if python is None else python.run(cmd[1:], cwd=cwd, timeout=timeout, env=env)
        except RuntimeError:  # the warm interpreter itself ended: the next command starts another
            _warm.pop(_import_time(env), None)
            raise
        finally:
            _warm_lock.release()
    else:
        proc = None
    if proc is None:
        proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\n"
                             f"stderr:\n{proc.stderr[-4000:]}")
    return proc


def metrics(out: Path) -> list[dict]:
    path = out / "logs" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train_rows(out: Path) -> dict[int, dict]:
    """Per-step training rows (the last one written for each step wins, as after a resume)."""
    return {r["step"]: r for r in metrics(out) if "loss" in r}


def training_process(out: Path) -> int | None:
    """The pid of the one training process of the run writing to `out` (`python train.py ...`, not accelerate's
    launcher, whose command line names train.py too), or None."""
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if len(argv) > 2 and argv[1].endswith(b"train.py") and str(out).encode() in b" ".join(argv):
            return int(proc.name)
    return None


def load_weights(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


def tiny_hf_model(path: Path) -> Path:
    """A tiny GPT-NeoX (the tiny model's shape) as transformers saves it: config.json + model.safetensors."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=256, max_position_embeddings=64)).save_pretrained(path)
    return path


def gpt2_style_tokenizer(path: Path, size: int = 50257) -> Path:
    """A GPT-2-shaped byte-level BPE tokenizer.json built locally (no hub download): 256 byte tokens, 50,000
    merges of byte pairs (common characters first) and `<|endoftext|>` as id 50256: 50,257 ids, as GPT-2
    (`size`: as many ids, fewer merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    common = "Ġetaoinshrdlucmfwypvbgkjqxz" + "ETAOINSHRDLUCMFWYPVBGKJQXZ" + ".,;:'\"!?-()Ċ0123456789"
    ordered = [c for c in common if c in alphabet] + sorted(c for c in alphabet if c not in common)
    vocab = {c: i for i, c in enumerate(ordered)}
    merges = []
    for a in ordered:
        for b in ordered:
            if len(vocab) == size - 1:
                break
            vocab[a + b] = len(vocab)
            merges.append((a, b))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    assert tok.get_vocab_size() == size and tok.token_to_id("<|endoftext|>") == size - 1
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def engine_at(commit: str, dest: Path) -> Path:
    """The repository as it was at `commit`, extracted into `dest` (an earlier engine, to write checkpoints
    today's code must still resume); skips the test where the clone has no history."""
    import pytest

    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO_ROOT), "archive", commit], capture_output=True)
    if archive.returncode != 0:
        pytest.skip(f"needs the repository's history (git archive {commit})")
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return dest
