"""The demo corpus builder: real builds from the standard library, checked shard by shard."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from configs import get_model_spec
from utils.data import demo as demo_data
from utils.data.demo import EOS_ID, DemoDataError, build_demo_data

VOCAB = get_model_spec("demo").vocab_size
SEQ_LEN = 128


def tree_digest(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, float]:
    data_dir = tmp_path_factory.mktemp("demo") / "data" / "demo"
    started = time.perf_counter()
    build_demo_data(data_dir, VOCAB, SEQ_LEN, log=lambda line: None)
    return data_dir, time.perf_counter() - started


def test_build_is_fast(built):
    _, seconds = built
    assert seconds < 60, f"demo data took {seconds:.1f}s"


def test_shards_are_nested_uint16_without_pickle(built):
    data_dir, _ = built
    shards = sorted(data_dir.rglob("*.npz"))
    assert 16 <= len(shards) <= 24
    assert len({p.parent for p in shards}) >= 2, "shards should sit in several sub-folders"
    assert all(p.parent != data_dir for p in shards), "every shard is nested below data_dir"
    ndims, total, eos = [], 0, 0
    for path in shards:
        with np.load(path, allow_pickle=False) as npz:
            assert list(npz.keys()) == ["input_ids"]
            ids = npz["input_ids"]
        assert ids.dtype == np.uint16
        assert ids.size > 0 and int(ids.max()) < VOCAB
        ndims.append(ids.ndim)
        if ids.ndim == 2:
            assert ids.shape[1] == SEQ_LEN
        total += ids.size
        eos += int((ids == EOS_ID).sum())
    assert set(ndims) == {1, 2} and ndims.count(1) > ndims.count(2)
    assert eos >= len(shards), "every 1-D shard ends documents with EOS"
    assert total > 1_000_000
    # The validation split holds out the last files: they are plain 1-D streams with whole documents.
    for path in shards[-2:]:
        ids = np.load(path, allow_pickle=False)["input_ids"]
        assert ids.ndim == 1 and ids[-1] == EOS_ID


def test_tokenizer_round_trips_python_source(built):
    from tokenizers import Tokenizer

    data_dir, _ = built
    tok = Tokenizer.from_file(str(data_dir / "tokenizer.json"))
    assert tok.get_vocab_size() == VOCAB
    assert tok.token_to_id("<|endoftext|>") == EOS_ID
    line = "    def __repr__(self):  return f'<{type(self).__name__} x={self.x!r}>'  # ünïcode ✓\n"
    ids = tok.encode(line).ids
    assert tok.decode(ids) == line
    assert len(ids) < 0.6 * len(line.encode()), "BPE should compress Python source"
    manifest = json.loads((data_dir / "demo_data.json").read_text())
    assert (manifest["vocab_size"], manifest["seq_len"], manifest["eos_id"]) == (VOCAB, SEQ_LEN, EOS_ID)


def test_second_call_is_a_no_op(built):
    data_dir, _ = built
    before = {p: p.stat().st_mtime_ns for p in data_dir.rglob("*")}
    lines = []
    started = time.perf_counter()
    assert build_demo_data(data_dir, VOCAB, SEQ_LEN, log=lines.append) == data_dir
    assert time.perf_counter() - started < 1.0
    assert lines == []
    assert {p: p.stat().st_mtime_ns for p in data_dir.rglob("*")} == before


def test_reuse_with_other_vocab_is_refused(built):
    data_dir, _ = built
    with pytest.raises(DemoDataError, match="vocab_size=2048 seq_len=128.*vocab_size=512"):
        build_demo_data(data_dir, 512, SEQ_LEN, log=lambda line: None)


def test_build_is_deterministic_across_processes(built, tmp_path, subprocess_env):
    """A second build in a fresh process (fresh hash seeds in the tokenizer's Rust code) is byte-identical."""
    data_dir, _ = built
    other = tmp_path / "again"
    code = f"from utils.data.demo import build_demo_data; build_demo_data({str(other)!r}, {VOCAB}, {SEQ_LEN})"
    env = dict(subprocess_env, TOKENIZERS_PARALLELISM="true", PYTHONHASHSEED="123")
    subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, timeout=120)
    assert tree_digest(other) == tree_digest(data_dir)


def test_failed_build_leaves_nothing(tmp_path, monkeypatch):
    data_dir = tmp_path / "demo"
    real_save = np.savez
    calls = []

    def save_then_fail(*args, **kwargs):
        calls.append(args[0])
        if len(calls) == 5:
            raise OSError("disk full (simulated)")
        return real_save(*args, **kwargs)

    monkeypatch.setattr(demo_data.np, "savez", save_then_fail)
    with pytest.raises(OSError, match="simulated"):
        build_demo_data(data_dir, VOCAB, SEQ_LEN, log=lambda line: None)
    assert len(calls) == 5
    assert not data_dir.exists()
    assert list(tmp_path.iterdir()) == [], "the temporary build folder is removed too"


def test_killed_build_leaves_no_shards(tmp_path, subprocess_env):
    data_dir = tmp_path / "demo"
    code = f"from utils.data.demo import build_demo_data; build_demo_data({str(data_dir)!r}, {VOCAB}, {SEQ_LEN})"
    proc = subprocess.Popen([sys.executable, "-c", code], env=subprocess_env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not any(p.name.startswith(".demo.partial-") for p in tmp_path.iterdir()):
            assert proc.poll() is None and time.monotonic() < deadline, "the build never started"
            time.sleep(0.05)
        time.sleep(1.0)  # mid-build: reading the corpus or training the tokenizer
    finally:
        proc.kill()
        proc.wait()
    assert not data_dir.exists()
    # The next build cleans the dead process's folder and completes.
    build_demo_data(data_dir, VOCAB, SEQ_LEN, log=lambda line: None)
    assert [p.name for p in tmp_path.iterdir()] == ["demo"]
    assert len(list(data_dir.rglob("*.npz"))) == demo_data.NUM_SHARDS


def test_non_empty_foreign_folder_is_refused(tmp_path):
    data_dir = tmp_path / "mine"
    data_dir.mkdir()
    (data_dir / "notes.txt").write_text("not demo data")
    with pytest.raises(DemoDataError, match="not empty"):
        build_demo_data(data_dir, VOCAB, SEQ_LEN, log=lambda line: None)
    assert [p.name for p in data_dir.iterdir()] == ["notes.txt"]
