"""utils/checkpoint/compile_cache.py: what a resume does with the compiled code a checkpoint carries, before any of
it is used. Each file here is written as the engine writes one (torch's artifact format, a kernel library, the
manifest entry), then altered the way a bucket, another machine or another torch would; nothing compiles here
(the slow end-to-end check with a real compile: tests/e2e/test_compile_cache.py)."""
from __future__ import annotations

import json
import pickle
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from utils.checkpoint import compile_cache as cc
from utils.checkpoint.format import COMPILE_CACHE_FILE, MANIFEST, CheckpointError, verify_checkpoint
from utils.errors import UserError
from utils.io.storage import bytes_crc32c

SECRET = "a-secret-of-twenty-chars"
SETTINGS = cc.CompileCacheSettings(compile_model=True, compile_cache="signed", mixed_precision="no", strategy="ddp",
                                   attention="causal", position_reset=False, model_impl="native",
                                   activation_checkpointing="none", activation_checkpointing_every=2,
                                   gradient_checkpointing=False)
MODEL = {"name": "tiny", "hidden_size": 64, "num_hidden_layers": 2}
GRAPH_KEY = "fabcdefghijklmnopqrstuvwxyz234567abcdefghijklmnopqrs"
KERNEL = "ab/cabcdef0123.main.so"


class Lines:
    """The run's logger, as far as the loader uses it: rank 0's lines (info) and every rank's warnings."""

    def __init__(self):
        self.lines, self.warnings = [], []

    def info(self, msg):
        self.lines.append(msg)

    def warning(self, msg):
        self.warnings.append(msg)


def torch_artifacts(key: str = GRAPH_KEY, kind: str = "inductor", *more_keys: str) -> bytes:
    """torch.compiler.save_cache_artifacts()'s format: one chunk holding an entry under `key`, and one more chunk
    for each of `more_keys` (as later calls of save_cache_artifacts append them). The content is opaque here."""
    from torch.compiler._cache import CacheArtifactFactory, CacheArtifactManager, _serialize_single_cache
    from torch.utils._appending_byte_serializer import AppendingByteSerializer

    CacheArtifactManager._ensure_cache_artifacts_registered()
    serializer = AppendingByteSerializer(serialize_fn=_serialize_single_cache)
    graph = pickle.dumps(SimpleNamespace(_triton_bundle=None))  # torch reads this much of a graph on loading it
    for each in (key, *more_keys):
        serializer.extend([(kind, [CacheArtifactFactory.create(kind, each, graph)])])
    return serializer.to_bytes()


def made_for(**changes) -> dict:
    import torch

    return cc.made_for(SETTINGS, MODEL, 64, torch.device("cpu")) | changes


def write_checkpoint(tmp: Path, entries: dict | None = None, made: dict | None = None, secret: str | None = SECRET,
                     flip: int | None = None) -> Path:
    """A checkpoint folder holding only the compiled code and its manifest entry (what the loader reads)."""
    entries = {cc.TORCH_ENTRY: torch_artifacts(), cc.KERNEL_PREFIX + KERNEL: b"\x7fELF a kernel"} \
        if entries is None else entries
    text = json.dumps(made or made_for(), sort_keys=True)
    signature = cc._signature(secret.encode(), text, entries) if secret else ""
    data = cc._pack(entries, {"format": cc.FORMAT, "version": cc.VERSION, "made_for": text, "signature": signature})
    checkpoint = tmp / "checkpoint-epoch0-step2-files0"
    checkpoint.mkdir(parents=True)
    manifest = {"format_version": 1, "objects": [],
                "files": {COMPILE_CACHE_FILE: {"size": len(data), "crc32c": bytes_crc32c(data)}}}
    if flip is not None:  # after the manifest was made: a bit flipped in the bucket, on a disk
        data = data[:flip] + bytes([data[flip] ^ 0x01]) + data[flip + 1:]
    (checkpoint / COMPILE_CACHE_FILE).write_bytes(data)
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))
    return checkpoint


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """A fresh machine: an empty Inductor cache folder, the run's secret set."""
    cache = tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    monkeypatch.setenv(cc.KEY_ENV, SECRET)
    return cache


def load(checkpoint: Path, settings=SETTINGS, made: dict | None = None) -> tuple[str, Lines]:
    log = Lines()
    line = cc.CompileCache(settings, made or made_for(), checkpoint.parent, True, log).load(checkpoint)
    assert log.lines == [line] and not log.warnings
    return line, log


def test_signed_code_made_for_this_run_is_loaded_into_the_cache_folder(tmp_path, machine):
    line, _ = load(write_checkpoint(tmp_path))
    assert line.startswith("compile cache: loaded from checkpoint-epoch0-step2-files0 (1 inductor, 1 kernel "
                           "library;") and "signature verified" in line
    assert (machine / KERNEL).read_bytes() == b"\x7fELF a kernel"
    graphs = list((machine / "fxgraph").rglob("*"))
    assert any(p.parent.name == GRAPH_KEY for p in graphs if p.is_file())  # where torch looks it up by its key


def test_every_chunk_of_torchs_artifacts_is_loaded_not_only_the_last_of_each_kind(tmp_path, machine):
    """A run saves after its first step and again once an evaluation compiled more: two chunks of one kind. torch's
    own reader keeps the last; the next machine needs both (the training graphs are in the first)."""
    later = "f" + "b" * 51
    entries = {cc.TORCH_ENTRY: torch_artifacts(GRAPH_KEY, "inductor", later)}
    line, _ = load(write_checkpoint(tmp_path, entries=entries))
    assert "(2 inductor, 0 kernel libraries;" in line, line
    assert {p.parent.name for p in (machine / "fxgraph").rglob("*") if p.is_file()} == {GRAPH_KEY, later}


@pytest.mark.parametrize("made, said", [
    (made_for(torch="2.12.0 (0123456789ab)"), "was made for torch 2.12.0 (0123456789ab) (this run: 2.13"),
    (made_for(model=MODEL | {"hidden_size": 192}), "was made for another model (hidden_size 192, this run: 64)"),
    (made_for(device="cuda NVIDIA H100 80GB HBM3 sm_90 CUDA 12.8"), "was made for device cuda NVIDIA H100"),
    (made_for(settings=made_for()["settings"] | {"mixed_precision": "bf16"}),
     "other compile settings (mixed_precision bf16, this run: no)"),
], ids=["torch", "model", "device", "settings"])
def test_code_made_for_another_torch_model_device_or_settings_is_one_line_and_a_compile(tmp_path, machine, made,
                                                                                       said):
    line, _ = load(write_checkpoint(tmp_path, made=made))
    assert said in line and line.startswith("compile cache: ") and line.endswith("; compiling"), line
    assert "\n" not in line and not any(machine.rglob("*.so"))


@pytest.mark.parametrize("flip", [30, -5], ids=["header", "kernel bytes"])
def test_a_flipped_byte_is_one_line_and_a_compile_and_the_checkpoint_still_verifies(tmp_path, machine, flip):
    checkpoint = write_checkpoint(tmp_path, flip=flip)
    line, _ = load(checkpoint)
    assert "does not match its manifest entry" in line and "it is corrupt; compiling" in line, line
    assert not any(machine.rglob("*.so"))
    verify_checkpoint(checkpoint)  # the rest of the checkpoint resumes: only the compile is lost


def test_a_missing_file_the_manifest_lists_is_still_a_broken_checkpoint(tmp_path):
    checkpoint = write_checkpoint(tmp_path)
    (checkpoint / "model.safetensors").write_bytes(b"weights")
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    manifest["files"]["model.safetensors"] = {"size": 7, "crc32c": "AAAAAA=="}
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="model.safetensors has crc32c"):
        verify_checkpoint(checkpoint)  # only the compiled code is left to its reader


@pytest.mark.parametrize("secret_here, secret_there, mode, said", [
    (None, SECRET, "signed", "which this process does not have"),
    (SECRET, None, "signed", "is unsigned (written without NEOX_COMPILE_CACHE_KEY)"),
    ("another-secret-of-twenty", SECRET, "signed", "signature does not verify under this NEOX_COMPILE_CACHE_KEY"),
    (None, None, "unsigned", "loaded from"),
    (SECRET, None, "off", "not loaded from checkpoint-epoch0-step2-files0 (compile_cache=off)"),
], ids=["no-secret-here", "unsigned-file", "another-secret", "unsigned-trusted", "off"])
def test_compiled_code_runs_only_when_signed_under_the_runs_secret_or_trusted_by_the_setting(
        tmp_path, machine, monkeypatch, secret_here, secret_there, mode, said):
    if secret_here is None:
        monkeypatch.delenv(cc.KEY_ENV)
    else:
        monkeypatch.setenv(cc.KEY_ENV, secret_here)
    line, _ = load(write_checkpoint(tmp_path, secret=secret_there), settings=replace(SETTINGS, compile_cache=mode))
    assert said in line, line
    assert any(machine.rglob("*.so")) == (mode == "unsigned")
    if mode == "unsigned":
        assert "unsigned: compile_cache=unsigned trusts the checkpoint" in line


@pytest.mark.parametrize("entries, said", [
    ({cc.TORCH_ENTRY: torch_artifacts(), cc.KERNEL_PREFIX + "../../outside.so": b"x"}, "holds a kernel named"),
    ({cc.TORCH_ENTRY: torch_artifacts(), cc.KERNEL_PREFIX + "ab/payload.py": b"x"}, "holds a kernel named"),
    ({cc.TORCH_ENTRY: torch_artifacts(key="../../../outside")}, "holds a 'inductor' artifact keyed"),
    ({cc.TORCH_ENTRY: torch_artifacts(key="dynamo/code_state.pkl", kind="pgo")}, "holds a 'pgo' artifact keyed"),
    ({cc.TORCH_ENTRY: b"\x00" * 12}, "torch cannot read its compile artifacts"),
    ({"weights": b"x"}, "holds an entry 'weights' this format does not have"),
], ids=["kernel-out", "kernel-not-a-library", "graph-key-out", "other-kind", "torch-unreadable", "other-entry"])
def test_entries_that_would_land_outside_the_cache_or_are_not_its_kinds_are_refused_even_when_signed(
        tmp_path, machine, entries, said):
    line, _ = load(write_checkpoint(tmp_path, entries=entries))
    assert said in line and line.endswith("; compiling"), line
    assert not (tmp_path / "outside.so").exists() and not any(machine.rglob("*.so"))
    assert not (machine / "fxgraph").exists() or not any(p.is_file() for p in (machine / "fxgraph").rglob("*"))


def test_a_checkpoint_without_compiled_code_says_so_and_a_short_secret_is_refused(tmp_path, machine, monkeypatch):
    checkpoint = tmp_path / "checkpoint-epoch0-step2-files0"
    checkpoint.mkdir()
    (checkpoint / MANIFEST).write_text(json.dumps({"format_version": 1, "files": {}}))
    line, _ = load(checkpoint)
    assert "carries no compiled code" in line
    assert cc.CompileCache(replace(SETTINGS, compile_model=False), {}, tmp_path, True, Lines()).load(checkpoint) is None
    monkeypatch.setenv(cc.KEY_ENV, "short")
    with pytest.raises(UserError, match="NEOX_COMPILE_CACHE_KEY has 5 characters") as refused:
        cc.CompileCache(SETTINGS, {}, tmp_path, True, Lines())
    assert "short" not in str(refused.value)  # the secret itself is never shown


def test_other_ranks_say_only_what_went_wrong_with_their_own_copy(tmp_path, machine):
    """Rank 0 says what happened; another rank reads the same checkpoint and meets the same reason (a mismatch,
    no secret), so it says only a problem of its own copy (one downloaded for its node)."""
    log = Lines()
    cc.CompileCache(SETTINGS, made_for(), tmp_path, False, log, rank=1).load(write_checkpoint(tmp_path, flip=30))
    assert log.lines == [] and len(log.warnings) == 1 and log.warnings[0].startswith("rank 1: compile cache: ")
    assert "does not match its manifest entry" in log.warnings[0]
    other = Lines()
    mismatch = write_checkpoint(tmp_path / "other", made=made_for(torch="2.12.0 (0123456789ab)"))
    assert "was made for torch 2.12.0" in cc.CompileCache(SETTINGS, made_for(), tmp_path, False, other,
                                                           rank=1).load(mismatch)
    assert other.lines == [] and other.warnings == []
