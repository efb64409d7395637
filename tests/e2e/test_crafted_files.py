"""What a file can make the engine do: a crafted sharded checkpoint runs no
code (resume from a path or gs://, generate.py, export_hf.py), paths a manifest or dataset.json names stay in
their folder, a data dir's symlink loops and nested datasets add nothing, a key other users can read is
said, and a full disk during a sharded save is one line with the earlier checkpoint intact (real processes,
a small tmpfs)."""
from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.trainkit import REPO_ROOT, TINY, make_shards, run, tiny_hf_model, train_cmd
from utils.errors import UserError
from utils.io.storage import file_crc32c


def env_for_runs() -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    env.pop("GOOGLE_APPLICATION_CREDENTIALS", None)
    return env


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, proc.stderr
    return lines[0]


# ----------------------------------------------------------------------- 1: a crafted sharded checkpoint

class RunsCode:
    """Unpickled, it creates `marker`: a stand-in for whatever code a crafted pickle could run."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').close()",)


def refresh_manifest(checkpoint: Path, rel: str) -> None:
    """The manifest's size and crc32c for a file changed on purpose (whoever crafts a checkpoint writes its
    manifest too)."""
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"][rel] = {"size": (checkpoint / rel).stat().st_size, "crc32c": file_crc32c(checkpoint / rel)}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


def craft_metadata(checkpoint: Path, marker: Path) -> None:
    """dcp/.metadata stays valid DCP metadata, with a value whose unpickling runs code: torch's reader would
    run it and load the checkpoint as if nothing happened."""
    path = checkpoint / "dcp" / ".metadata"
    metadata = pickle.loads(path.read_bytes())  # our own run's file
    metadata.storage_meta.modules = [RunsCode(marker)]
    path.write_bytes(pickle.dumps(metadata))
    refresh_manifest(checkpoint, "dcp/.metadata")


def craft_value(checkpoint: Path, marker: Path) -> None:
    """The optimizer's learning rate in a .distcp file, replaced by a pickle that runs code (DCP loads such
    non-tensor values with torch.load(weights_only=False))."""
    from io import BytesIO

    meta_path = checkpoint / "dcp" / ".metadata"
    metadata = pickle.loads(meta_path.read_bytes())
    index = next(i for i in metadata.storage_data if i.fqn == "optim.param_groups.0.lr")
    info = metadata.storage_data[index]
    shard = checkpoint / "dcp" / info.relative_path
    payload = BytesIO()
    torch.save(RunsCode(marker), payload)
    info.offset, info.length = shard.stat().st_size, len(payload.getvalue())
    with open(shard, "ab") as f:
        f.write(payload.getvalue())
    meta_path.write_bytes(pickle.dumps(metadata))
    for rel in ("dcp/.metadata", f"dcp/{info.relative_path}"):
        refresh_manifest(checkpoint, rel)


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory):
    """One FSDP run (strategy=fsdp, one process: its own process group), 2 steps, a sharded checkpoint."""
    root = tmp_path_factory.mktemp("sharded")
    data = make_shards(root / "data", n_files=3, rows=16)
    out = root / "out"
    run(train_cmd(out, data, "strategy=fsdp", "max_steps=2", "save_steps=2"), env_for_runs())
    checkpoint = next((out / "checkpoints").glob("checkpoint-*"))
    return {"data": data, "out": out, "checkpoint": checkpoint}


def crafted_copy(sharded_run, tmp_path: Path, craft) -> tuple[Path, Path]:
    """A copy of the run's output dir whose checkpoint is crafted, and the marker its code would create."""
    out = tmp_path / "out"
    shutil.copytree(sharded_run["out"], out)
    checkpoint = out / "checkpoints" / sharded_run["checkpoint"].name
    marker = tmp_path / "code-ran"
    craft(checkpoint, marker)
    return checkpoint, marker


@pytest.mark.slow
def test_a_crafted_dcp_metadata_is_refused_by_resume_from_gcs_generate_and_export(sharded_run, tmp_path,
                                                                                 gcs_emulator):
    """`--resume gs://...` downloads the checkpoint, then reads it as a local one does."""
    from utils.io.storage import make_client, upload_directory

    checkpoint, marker = crafted_copy(sharded_run, tmp_path, craft_metadata)
    url = f"gs://{gcs_emulator.bucket}/checkpoints/crafted/{checkpoint.name}"
    upload_directory(make_client(), checkpoint, url)
    env = {**env_for_runs(), "STORAGE_EMULATOR_HOST": gcs_emulator.url}
    commands = {
        "resume": train_cmd(tmp_path / "fresh", sharded_run["data"], "strategy=fsdp", "max_steps=4",
                            extra=("--resume", url)),
        "generate": [sys.executable, str(REPO_ROOT / "generate.py"), str(checkpoint), "--prompt", "x"],
        "export": [sys.executable, str(REPO_ROOT / "scripts" / "export_hf.py"), str(checkpoint), str(tmp_path / "hf")],
    }
    for what, cmd in commands.items():
        line = one_error_line(run(cmd, env, check=False))
        assert "dcp/.metadata names builtins.exec" in line and "refused" in line, (what, line)
        assert not marker.exists(), f"{what}: the crafted .metadata ran its code"
    assert not (tmp_path / "hf").exists()


@pytest.mark.slow
def test_a_crafted_dcp_value_is_refused_on_resume(sharded_run, tmp_path):
    checkpoint, marker = crafted_copy(sharded_run, tmp_path, craft_value)
    proc = run(train_cmd(checkpoint.parent.parent, sharded_run["data"], "strategy=fsdp", "max_steps=4",
                         extra=("--resume", str(checkpoint))), env_for_runs(), check=False)
    line = one_error_line(proc)
    assert "optim.param_groups.0.lr" in line and "refused" in line, line
    assert not marker.exists(), "the crafted value ran its code"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_metadata_of_every_kind_of_value_still_loads(tmp_path):
    """What our checkpoints hold passes the restricted reader: bf16, fp32 and int64 tensors, the optimizer's
    step counts and its hyperparameters (floats, a tuple, bools, None, parameter names)."""
    import torch.distributed.checkpoint as dcp

    from utils.checkpoint.sharded import SHARDED_DIR, MetadataReader, _dcp_load

    state = {"model": {"w": torch.randn(4, 3).bfloat16(), "b": torch.randn(3), "ids": torch.arange(5)},
             "optim": {"state": {"w": {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 3)}},
                       "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "foreach": None, "fused": False,
                                         "params": ["w", "b"]}]}}
    dcp.save(state, checkpoint_id=str(tmp_path / SHARDED_DIR), no_dist=True)
    assert (MetadataReader.checked(tmp_path).metadata.state_dict_metadata.keys()
            >= {"model.w", "optim.param_groups.0.lr"})
    back = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
            "optim": {"state": {"w": {"step": torch.tensor(0.0), "exp_avg": torch.zeros(4, 3)}},
                      "param_groups": [{"lr": 0.0, "betas": (0.0, 0.0), "foreach": True, "fused": True,
                                        "params": []}]}}
    _dcp_load(dcp, back, tmp_path)
    assert all(torch.equal(back["model"][k], state["model"][k]) for k in state["model"])
    assert back["optim"]["param_groups"] == state["optim"]["param_groups"]
    assert torch.equal(back["optim"]["state"]["w"]["exp_avg"], state["optim"]["state"]["w"]["exp_avg"])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_metadata_naming_a_shard_file_outside_dcp_is_refused(tmp_path):
    import torch.distributed.checkpoint as dcp

    from utils.checkpoint.format import CheckpointError
    from utils.checkpoint.sharded import SHARDED_DIR, MetadataReader

    dcp.save({"model": {"w": torch.ones(3)}}, checkpoint_id=str(tmp_path / SHARDED_DIR), no_dist=True)
    path = tmp_path / SHARDED_DIR / ".metadata"
    metadata = pickle.loads(path.read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = "../../secret.distcp"
    path.write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match=r"\.metadata names the shard file '\.\./\.\./secret\.distcp', outside"):
        MetadataReader.checked(tmp_path)


def test_torch_load_is_weights_only_everywhere():
    """The project's rule, checked in its own source: every torch.load passes weights_only=True."""
    import re

    offenders = []
    for path in REPO_ROOT.rglob("*.py"):
        if ".venv" in path.parts or path.name == Path(__file__).name:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"torch\.load\(", line) and "weights_only=True" not in line:
                offenders.append(f"{path.relative_to(REPO_ROOT)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


# ----------------------------------------------------------------- 2: paths a file names stay in its folder

def test_manifest_objects_and_symlinked_files_stay_in_the_checkpoint(tmp_path):
    from tests.e2e.test_one_line_errors import fake_checkpoint
    from utils.checkpoint.format import CheckpointError, read_checkpoint, verify_checkpoint

    torch.save({"secret": torch.ones(2)}, tmp_path / "outside.pt")
    checkpoint = fake_checkpoint(tmp_path / "ckpts", 2)
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    (checkpoint / "manifest.json").write_text(json.dumps({**manifest, "objects": ["../../outside", "rng"]}))
    with pytest.raises(CheckpointError, match=r"manifest.json names object '\.\./\.\./outside' in 'objects'"):
        read_checkpoint(checkpoint)

    (checkpoint / "manifest.json").write_text(json.dumps({**manifest, "objects": ["extra", "rng"]}))
    with pytest.raises(CheckpointError, match=r"names object 'extra' in 'objects', which is not a file it lists"):
        read_checkpoint(checkpoint)

    (checkpoint / "rng.pt").unlink()
    (checkpoint / "rng.pt").symlink_to(tmp_path / "outside.pt")
    refresh_manifest(checkpoint, "rng.pt")
    (checkpoint / "manifest.json").write_text(json.dumps(
        {**json.loads((checkpoint / "manifest.json").read_text()), "objects": ["rng"]}))
    with pytest.raises(CheckpointError, match=r"lists 'rng.pt', outside the checkpoint .*symlink"):
        verify_checkpoint(checkpoint)


def write_dataset(folder: Path, train: list[str], val: list[str], tokenizer_file: str = "tokenizer.json") -> Path:
    """A dataset.json (as prepare_data.py writes it) over shards already in `folder`."""
    entry = lambda rel: {"path": rel, "tokens": 1, "bytes": (folder / rel).stat().st_size, "crc32c": ""}  # noqa: E731
    (folder / "dataset.json").write_text(json.dumps({
        "format": "gpt-neox-shards", "version": 1, "dtype": "uint16", "documents": 2, "tokens": 2,
        "tokenizer": {"file": tokenizer_file, "vocab_size": 512, "eos_id": 0, "eos_token": "<eos>"},
        "shards": [entry(rel) for rel in train],
        "validation": {"documents": 1, "tokens": 1, "shards": [entry(rel) for rel in val]}}))
    return folder


def test_dataset_json_paths_stay_in_the_data_dir(tmp_path):
    from tests.trainkit import gpt2_style_tokenizer
    from utils.data.dataset_info import DatasetInfo, DatasetInfoError
    from utils.model.hf import ExportTokenizer

    outside = gpt2_style_tokenizer(tmp_path / "elsewhere" / "tokenizer.json")
    data = make_shards(tmp_path / "data", n_files=2, rows=8)
    train = sorted(p.relative_to(data).as_posix() for p in data.rglob("*.npz"))
    write_dataset(data, train, [], tokenizer_file=str(outside))
    with pytest.raises(DatasetInfoError, match=rf"dataset.json: tokenizer.file names '{outside}', which leaves"):
        ExportTokenizer.find(data)  # it used to be exported into final_model/

    (data / "tokenizer.json").symlink_to(outside)
    write_dataset(data, train, [])
    with pytest.raises(DatasetInfoError, match=r"tokenizer.file names 'tokenizer.json', which leaves .*symlink"):
        DatasetInfo.load(data)

    (data / "tokenizer.json").unlink()
    write_dataset(data, train, [])
    info = json.loads((data / "dataset.json").read_text())
    info["shards"][0]["path"] = "../elsewhere/x.npz"
    (data / "dataset.json").write_text(json.dumps(info))
    with pytest.raises(DatasetInfoError, match=r"shards names '\.\./elsewhere/x\.npz', which leaves"):
        DatasetInfo.load(data)


# --------------------------------------------------------------------- 3: symlink loops, nested datasets

def test_a_symlink_loop_in_the_data_dir_adds_nothing(tmp_path):
    from utils.data.index import ShardIndex

    data = make_shards(tmp_path / "data", n_files=4, rows=8)
    (data / "part-0" / "loop").symlink_to(data)  # 40 levels deep, followed blindly
    (data / "again").symlink_to(data / "part-1")  # a second link to a folder already walked
    index = ShardIndex.build(data, seq_len=64, vocab_size=512, log=lambda *_: None)
    assert [s.path for s in index.shards] == sorted(p.relative_to(data).as_posix() for p in data.rglob("*.npz"))
    assert len(index) == 4


def test_a_symlinked_shard_folder_is_followed_once(tmp_path):
    from utils.data.corpus import list_inputs
    from utils.data.index import ShardIndex

    data = make_shards(tmp_path / "data", n_files=2, rows=8)
    make_shards(tmp_path / "more", n_files=2, rows=8, seed=1)
    (data / "more").symlink_to(tmp_path / "more")
    (tmp_path / "more" / "back").symlink_to(data)
    assert len(ShardIndex.build(data, seq_len=64, vocab_size=512, log=lambda *_: None)) == 4

    corpus = tmp_path / "corpus"
    (corpus / "a").mkdir(parents=True)
    (corpus / "a" / "doc.txt").write_text("hello")
    (tmp_path / "linked").mkdir()
    (tmp_path / "linked" / "other.txt").write_text("world")
    (corpus / "linked").symlink_to(tmp_path / "linked")
    (corpus / "a" / "loop").symlink_to(corpus)
    assert [f.key for f in list_inputs([str(corpus)])] == ["a/doc.txt", "linked/other.txt"]


def test_a_folder_with_dataset_json_holds_exactly_the_shards_it_lists(tmp_path):
    """A dataset nested in another's folder adds nothing to it (its val/ shards used to become the outer
    one's training data); nested in a plain folder, it adds its training shards, never its validation."""
    from utils.data.index import ShardIndex

    def prepared(folder: Path, seed: int) -> Path:
        make_shards(folder / "part", n_files=2, rows=8, seed=seed)
        make_shards(folder / "val", n_files=1, rows=8, seed=seed + 1)
        rels = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.npz"))
        return write_dataset(folder, [r for r in rels if not r.startswith("val/")],
                             [r for r in rels if r.startswith("val/")])

    outer = prepared(tmp_path / "outer", 0)
    prepared(outer / "inner", 10)
    np.savez(outer / "stray.npz", input_ids=np.zeros((8, 64), np.uint16))
    said = []
    index = ShardIndex.build(outer, seq_len=64, vocab_size=512, log=said.append)
    listed = json.loads((outer / "dataset.json").read_text())
    train, val = index.split_paths([s["path"] for s in listed["validation"]["shards"]])
    assert [s.path for s in train.shards] == [s["path"] for s in listed["shards"]]
    assert [s.path for s in val.shards] == [s["path"] for s in listed["validation"]["shards"]]
    assert any("4 .npz file(s) under" in line and "not listed in its dataset.json" in line for line in said), said

    plain = tmp_path / "plain"
    make_shards(plain / "own", n_files=1, rows=8)
    prepared(plain / "inner", 20)
    said.clear()
    index = ShardIndex.build(plain, seq_len=64, vocab_size=512, log=said.append)
    inner = json.loads((plain / "inner" / "dataset.json").read_text())
    assert sorted(s.path for s in index.shards) == sorted(
        ["own/part-0/sub-0/shard-000.npz"] + [f"inner/{s['path']}" for s in inner["shards"]])
    assert any("inner/ holds its own dataset.json" in line and "validation split (1 shard(s)) is not" in line
               for line in said), said


# ------------------------------------------------------------------------ 4: a key other users can read

def test_a_key_other_users_can_read_is_said_once_never_its_contents(tmp_path, monkeypatch, capsys):
    from tests.unit.io.test_storage import fake_service_account
    from utils.io import storage

    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    key = fake_service_account(tmp_path / "key.json")  # a new path: nothing was said about it yet
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(key))
    os.chmod(key, 0o600)
    storage.make_client()
    assert "warning" not in capsys.readouterr().err
    os.chmod(key, 0o644)
    storage.make_client()
    storage.make_client()
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, err
    assert str(key) in warnings[0] and f"chmod 600 {key}" in warnings[0] and "mode 644" in warnings[0]
    assert "PRIVATE KEY" not in err and json.loads(key.read_text())["private_key_id"] not in err.replace(str(key), "")


def test_setup_makes_the_keys_in_credentials_private(tmp_path):
    """setup.sh's first step, on a copy of it: the key is chmod 600 and it says so (it then stops at the
    Python check: PYTHON names no interpreter)."""
    shutil.copy(REPO_ROOT / "setup.sh", tmp_path / "setup.sh")
    (tmp_path / "credentials").mkdir()
    key, private = tmp_path / "credentials" / "trainer.json", tmp_path / "credentials" / "other.json"
    for path, mode in ((key, 0o644), (private, 0o600)):
        path.write_text('{"type": "service_account", "private_key": "SECRET"}')
        os.chmod(path, mode)
    proc = subprocess.run(["bash", "setup.sh"], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHON": "/nonexistent/python3"})
    assert key.stat().st_mode & 0o777 == 0o600 and private.stat().st_mode & 0o777 == 0o600
    assert "credentials/trainer.json was readable by other users: chmod 600" in proc.stdout, proc.stdout
    assert "other.json" not in proc.stdout and "SECRET" not in proc.stdout + proc.stderr


# --------------------------------------------------------------------- 9: a full disk in a sharded save

@pytest.mark.slow
def test_a_full_disk_during_a_sharded_save_is_one_line_and_the_earlier_checkpoint_resumes(tmp_path):
    """Two FSDP ranks (the launcher, --cpu) on a 4 MB tmpfs: the step-2 checkpoint (2.4 MB) fits, the
    step-4 one does not. One error line (it was ~9 DCP tracebacks), the step-2 checkpoint verifies, and once
    there is room the run resumes from it and finishes."""
    from utils.checkpoint.format import list_checkpoints, verify_checkpoint

    data = make_shards(tmp_path / "data", n_files=4, rows=64)
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("needs root to mount a small tmpfs")
    try:
        out, env = mount / "out", env_for_runs()
        cmd = [str(REPO_ROOT / "start_training.sh"), "--config", "demo", "--cpu", "--gpus", "2", "--strategy", "fsdp",
               "--", "--output-dir", str(out), "--data-dir", str(data)]
        for s in TINY + ["max_steps=6", "save_steps=2"]:
            cmd += ["--set", s]
        line = one_error_line(run(cmd, env, check=False, timeout=600))
        assert f"no space left on {mount}" in line and "checkpoint-epoch0-step4" in line and "--resume auto" in line
        (kept,) = list_checkpoints(out / "checkpoints")
        assert kept.name.startswith("checkpoint-epoch0-step2-")
        verify_checkpoint(kept)
        assert not [p for p in (out / "checkpoints").iterdir() if p != kept], "a partial checkpoint was left"

        subprocess.run(["mount", "-o", "remount,size=32m", str(mount)], check=True)
        resumed = run(train_cmd(out, data, "strategy=fsdp", "max_steps=6", "save_steps=2", extra=("--resume", "auto")),
                      env)
        assert f"Resumed from {kept}" in resumed.stdout and "Traceback" not in resumed.stderr
        assert list_checkpoints(out / "checkpoints")[-1].name.startswith("checkpoint-epoch0-step6-")
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


# ------------------------------------------------- 6: every file a bucket may hold is checked once at read

def test_a_crafted_manifest_json_is_refused_naming_the_field(tmp_path):
    """manifest.json: a string where an int goes, a negative size, a list where an object goes, a path out of
    the checkpoint; in-process for each, and through generate.py (a real process: exit 2, one line)."""
    from tests.e2e.test_one_line_errors import fake_checkpoint
    from utils.checkpoint.format import CheckpointError, read_checkpoint

    checkpoint = fake_checkpoint(tmp_path / "ckpts", 2)
    good = json.loads((checkpoint / "manifest.json").read_text())
    rel = "model.safetensors"
    cases = [
        ({**good, "format_version": "1"}, r"manifest.json: format_version is '1', not a positive integer"),
        ({**good, "files": {**good["files"], rel: {**good["files"][rel], "size": -5}}},
         r"files\['model.safetensors'\].size is -5, not a non-negative integer"),
        ({**good, "files": {**good["files"], rel: {**good["files"][rel], "size": "12"}}},
         r"files\['model.safetensors'\].size is '12', not a non-negative integer"),
        ({**good, "files": {**good["files"], rel: {**good["files"][rel], "crc32c": 7}}},
         r"files\['model.safetensors'\].crc32c is 7, not a string"),
        ({**good, "files": list(good["files"])}, r"manifest.json: files is 'list', not an object of file entries"),
        ([good], r"manifest.json: the file is 'list', not an object"),
        ({**good, "files": {**good["files"], "../../x": {"size": 1, "crc32c": ""}}},
         r"lists '\.\./\.\./x', outside the checkpoint"),
    ]
    for crafted, message in cases:
        (checkpoint / "manifest.json").write_text(json.dumps(crafted))
        with pytest.raises(CheckpointError, match=message):
            read_checkpoint(checkpoint)
    (checkpoint / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)  # a parser's recursion
    with pytest.raises(CheckpointError, match=r"manifest.json is unreadable"):
        read_checkpoint(checkpoint)

    (checkpoint / "manifest.json").write_text(json.dumps({**good, "format_version": "1"}))
    line = one_error_line(run([sys.executable, str(REPO_ROOT / "generate.py"), str(checkpoint), "--prompt", "x"],
                              env_for_runs(), check=False))
    assert str(checkpoint) in line and "manifest.json: format_version is '1'" in line, line


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """A tiny GPT-NeoX as transformers saves it (config.json + model.safetensors)."""
    return tiny_hf_model(tmp_path_factory.mktemp("hf") / "tiny-neox")


def test_a_crafted_hf_config_json_is_refused_naming_the_field(hf_model, tmp_path):
    """config.json of an HF directory (init_from, generate.py, export): types, ranges, head divisibility,
    flags, token ids, and a shape its weight files cannot hold; in-process for each, and through generate.py."""
    from configs.model_config import ConfigError
    from utils.model.hf import load_hf_pretrained

    model = tmp_path / "model"
    shutil.copytree(hf_model, model)
    good = json.loads((hf_model / "config.json").read_text())
    load_hf_pretrained(model)  # as transformers saved it: fine
    cases = [
        ({"hidden_size": "64"}, r"hidden_size is '64', not a positive integer"),
        ({"num_hidden_layers": -2}, r"num_hidden_layers is -2, not a positive integer"),
        ({"vocab_size": 512.5}, r"vocab_size is 512.5, not a positive integer"),
        ({"num_attention_heads": 5}, r"hidden_size is 64, not a multiple of num_attention_heads \(5\)"),
        ({"layer_norm_eps": -1e-5}, r"layer_norm_eps is -1e-05, not a positive finite number"),
        ({"rotary_pct": 2.0}, r"rotary_pct is 2.0, not a number in \(0, 1\]"),
        ({"use_parallel_residual": "false"}, r"use_parallel_residual is 'false', not true or false"),
        ({"eos_token_id": 100_000}, r"eos_token_id is 100000, not a token id below vocab_size \(512\)"),
        ({"intermediate_size": 2**40}, r"intermediate_size is 1099511627776, not a positive integer below"),
        ({"hidden_size": 65536, "intermediate_size": 262144},
         r"has \d[\d,]+ parameters, more than its weight files' [\d,]+ bytes hold"),
    ]
    for change, message in cases:
        (model / "config.json").write_text(json.dumps({**good, **change}))
        with pytest.raises(ConfigError, match=rf"{model / 'config.json'}: .*{message}"):
            load_hf_pretrained(model)
    (model / "config.json").write_text(json.dumps({k: v for k, v in good.items() if k != "num_hidden_layers"}))
    with pytest.raises(ConfigError, match=r"config.json: num_hidden_layers is missing"):
        load_hf_pretrained(model)

    for change, said in (({"num_attention_heads": 5}, "not a multiple of num_attention_heads (5)"),
                         ({"hidden_size": 65536, "intermediate_size": 262144}, "more than its weight files'")):
        (model / "config.json").write_text(json.dumps({**good, **change}))
        line = one_error_line(run([sys.executable, str(REPO_ROOT / "generate.py"), str(model), "--prompt", "x"],
                                  env_for_runs(), check=False))
        assert f"{model / 'config.json'}:" in line and said in line, line


def test_a_crafted_plan_or_dataset_json_in_prepares_output_is_never_trusted(tmp_path):
    """prepare's staging plan.json counts only when it names this run's own plan digest (then the plan is
    this run's, never the file's); a crafted one (nested past the parser's depth, a list, a digest that is a
    number) is discarded and the dataset made afresh, and a crafted dataset.json under the plan's own
    fingerprint is one line naming the field, never a report of its numbers (real processes)."""
    from tests.e2e.test_prepare_data import bpe_tokenizer
    from utils.data.partition import staged_plan_digest

    assert staged_plan_digest(None) is None
    for crafted in (b"[" * 100_000, b"[1]", b'{"sha256": 5}', b'{"sha256": "../x"}', b"\xff"):
        assert staged_plan_digest(crafted) == "", crafted[:20]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i} " + "word " * 40}) + "\n" for i in range(60)))
    out = tmp_path / "data"
    staging = tmp_path / ".data.staging"
    staging.mkdir()
    (staging / "plan.json").write_text("[" * 100_000 + "]" * 100_000)
    prepare = [sys.executable, str(REPO_ROOT / "prepare_data.py"), "--no-progress", "--input", str(corpus),
               "--tokenizer", str(bpe_tokenizer(tmp_path / "tokenizer.json", vocab=300)), "--output", str(out),
               "--executor", "local", "--workers", "1"]
    proc = run(prepare, env_for_runs(), check=False)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    description = json.loads((out / "dataset.json").read_text())
    assert description["documents"] == 60

    description["documents"] = "60"  # the same fingerprint: the rerun reads it for its report
    (out / "dataset.json").write_text(json.dumps(description))
    line = one_error_line(run(prepare, env_for_runs(), check=False))
    assert f"{out / 'dataset.json'}: documents is '60', not a non-negative integer" in line, line


# ------------------------------------------- 7: issue 41: a completion record or a reused output's dataset.json

def small_prepare(tmp_path: Path, out: Path, *extra: str) -> list[str]:
    """prepare_data.py's command for a small corpus (one partition, no validation split unless `extra` asks)."""
    from tests.e2e.test_prepare_data import bpe_tokenizer

    corpus = tmp_path / "corpus.jsonl"
    if not corpus.exists():
        corpus.write_text("".join(json.dumps({"text": f"document {i} " + "word " * 40}) + "\n" for i in range(40)))
        bpe_tokenizer(tmp_path / "tokenizer.json", vocab=300)
    return [sys.executable, str(REPO_ROOT / "prepare_data.py"), "--no-progress", "--input", str(corpus), "--tokenizer",
            str(tmp_path / "tokenizer.json"), "--output", str(out), "--executor", "local", "--workers", "1",
            "--shard-tokens", "1024", *extra]


def staged_partition(out: Path, plan_json: bytes, record: dict, files_there: dict[str, Path]) -> Path:
    """A staging area as a killed prepare leaves it (plan.json, partition 0 done), whose completion record is
    `record` and whose partition folder holds `files_there` (name -> what it links to)."""
    staging = out.parent / f".{out.name}.staging"
    (staging / "p00000").mkdir(parents=True)
    (staging / "plan.json").write_bytes(plan_json)
    for name, target in files_there.items():
        (staging / "p00000" / name).symlink_to(target)
    (staging / "p00000" / "done.json").write_text(json.dumps(record))
    return staging


def test_a_completion_record_naming_a_symlink_publishes_and_uploads_nothing(tmp_path, gcs_emulator):
    """A completion record (under the run's own plan digest) whose shard, or validation piece, is a symlink to
    a file the preparing user can read: the merge refuses it in one line naming the file and the record to
    remove; nothing is published, and `--upload` sends nothing (real prepare_data.py processes, the GCS
    emulator). A partition folder that is itself a symlink out of the staging area holds no record of prepare's:
    the partition is made again, in a folder of its own, and the files the link led to stay where they are.
    Each published (and uploaded) the file the link named."""
    first = tmp_path / "first"
    run(small_prepare(tmp_path, first, "--val-fraction", "0"), env_for_runs())
    plan_json, done = (first / "plan.json").read_bytes(), json.loads((first / "dataset.json").read_text())
    assert done["partitions"] == 1
    secret = tmp_path / "secret.npz"  # any file the user can read, as a valid shard of the claimed size
    np.savez(secret, input_ids=np.arange(done["tokens"], dtype=np.uint16) % 300)
    entry = {"path": "shard-00000.npz", "tokens": done["tokens"], "bytes": secret.stat().st_size,
             "crc32c": file_crc32c(secret)}
    record = {"partition": 0, "plan": done["fingerprint"], "documents": done["documents"], "documents_empty": 0,
              "tokens": done["tokens"], "validation": {"documents": 0, "tokens": 0}, "shards": [entry]}
    val_record = {**record, "shards": [], "validation": {"documents": 1, "tokens": done["tokens"], "path": "val.npz",
                                                         "bytes": entry["bytes"], "crc32c": entry["crc32c"]}}
    for case, links, crafted in (("shard", {"shard-00000.npz": secret}, record),
                                 ("val", {"val.npz": secret}, val_record)):
        out = tmp_path / case / "data"
        staging = staged_partition(out, plan_json, crafted, links)
        upload = ["--upload", f"gs://{gcs_emulator.bucket}/{case}"]
        line = one_error_line(run(small_prepare(tmp_path, out, "--val-fraction", "0", *upload), env_for_runs(),
                                  check=False))
        named = staging / "p00000" / next(iter(links))
        assert f"{named}: missing, not a regular file" in line and f"{staging}/p00000/done.json" in line, line
        assert not out.exists(), f"{case}: published"
        assert not list(gcs_emulator.client().list_blobs(gcs_emulator.bucket)), f"{case}: uploaded"

    elsewhere = tmp_path / "elsewhere"  # a folder of the user's, holding a record and a shard file
    elsewhere.mkdir()
    shutil.copy(secret, elsewhere / "shard-00000.npz")
    (elsewhere / "done.json").write_text(json.dumps(record))
    out = tmp_path / "folder" / "data"
    staging = staged_partition(out, plan_json, record, {})
    shutil.rmtree(staging / "p00000")
    (staging / "p00000").symlink_to(elsewhere)
    run(small_prepare(tmp_path, out, "--val-fraction", "0"), env_for_runs())
    assert shard_bytes(out) == shard_bytes(first) and secret.read_bytes() not in shard_bytes(out)
    assert (elsewhere / "shard-00000.npz").read_bytes() == secret.read_bytes()
    assert json.loads((elsewhere / "done.json").read_text()) == record


def shard_bytes(out: Path) -> list[bytes]:
    """The training shards a prepared output lists, in order."""
    return [(out / entry["path"]).read_bytes() for entry in json.loads((out / "dataset.json").read_text())["shards"]]


def test_a_reused_prepare_output_is_checked_against_its_shard_list_and_counts(tmp_path):
    """A finished output whose dataset.json names this run's plan is reported done only when it is whole: its
    counts add up, its shards are the merge's names, each there, a regular file of its size. A crafted or
    damaged one is one line naming the problem (real processes); it was reported done, with its numbers."""
    out = tmp_path / "data"
    prepare = small_prepare(tmp_path, out)
    run(prepare, env_for_runs())
    assert "already holds this dataset" in run(prepare, env_for_runs()).stdout
    good = (out / "dataset.json").read_text()
    description = json.loads(good)
    first = out / description["shards"][0]["path"]
    kept = tmp_path / "kept.npz"
    shutil.copy(first, kept)
    said = {}
    for case in ("tokens", "renamed", "missing", "symlink"):
        crafted = json.loads(good)
        if case == "tokens":
            crafted["tokens"] += 1000
        elif case == "renamed":
            crafted["shards"][0]["path"] = "part-00000/shard-00009.npz"
        elif case == "missing":
            first.unlink()
        else:
            first.unlink()
            first.symlink_to(kept)
        (out / "dataset.json").write_text(json.dumps(crafted))
        said[case] = one_error_line(run(prepare, env_for_runs(), check=False))
        assert f"{out / 'dataset.json'}: " in said[case] and f"remove {out}" in said[case], said[case]
        if first.is_symlink() or not first.exists():
            first.unlink(missing_ok=True)
            shutil.copy(kept, first)
    assert "token counts do not add up" in said["tokens"]
    assert "shards[0].path is 'part-00000/shard-00009.npz', not 'part-00000/shard-00000.npz'" in said["renamed"]
    for case in ("missing", "symlink"):
        assert f"it lists {description['shards'][0]['path']}, which is missing, not a regular file" in said[case]


# ------------------------------------------------------ 8: issue 41: model files past their checks, in a real run

def one_line_of(argv: list, what: str) -> str:
    """The one error line of a real process (exit 2, no traceback) that must say `what`."""
    line = one_error_line(run([sys.executable, *map(str, argv)], env_for_runs(), check=False))
    assert what in line, line
    return line


@pytest.mark.slow
def test_an_hf_directory_crafted_past_its_config_check_is_one_line(hf_model, tmp_path):
    """config.json nested past the parser's depth, one position, a rope factor of "nan" or 0; weights of dtype
    int32 or holding NaN; a model.safetensors that is a symlink out of its directory: each one line naming the
    file (in-process, and through generate.py and init_from: real processes). Each was a traceback, a silent
    load, or init_from blaming the weights for the one position; the hub cache's links into blobs/ still load."""
    from safetensors.torch import load_file, save_file

    from utils.model.hf import check_weights, load_hf_pretrained

    good = json.loads((hf_model / "config.json").read_text())
    assert good["rope_parameters"]["rope_type"] == "default"

    def crafted(name: str, config=None, weights=None) -> Path:
        folder = tmp_path / name
        shutil.copytree(hf_model, folder)
        if config is not None:
            (folder / "config.json").write_text(config if isinstance(config, str) else json.dumps({**good, **config}))
        if weights is not None:
            save_file(weights(load_file(str(folder / "model.safetensors"))), str(folder / "model.safetensors"))
        return folder

    for name, config, said in (
            ("nested", "[" * 100_000 + "]" * 100_000, "config.json: cannot read it (nested too deeply to parse)"),
            ("one-position", {"max_position_embeddings": 1},
             "config.json: max_position_embeddings is 1, not at least 2"),
            ("factor-nan", {"rope_parameters": {**good["rope_parameters"], "factor": "nan"}},
             "config.json: rope_parameters.factor is 'nan', not a positive finite number"),
            ("factor-0", {"rope_parameters": {**good["rope_parameters"], "factor": 0}},
             "config.json: rope_parameters.factor is 0, not a positive finite number")):
        with pytest.raises(UserError, match=re.escape(f"{tmp_path / name}/{said}")):
            load_hf_pretrained(crafted(name, config))
    for name, weights, said in (
            ("int32", lambda w: {k: v.to(torch.int32) for k, v in w.items()}, "is torch.int32, not floating point"),
            ("nan", lambda w: {k: v.fill_(float("nan")) if "embed_in" in k else v for k, v in w.items()},
             "holds NaN or infinite values")):
        folder = crafted(name, weights=weights)
        spec, state = load_hf_pretrained(folder)
        with pytest.raises(UserError, match=rf"init_from {folder}: its weight gpt_neox.embed_in.weight {said}"):
            check_weights(spec, state, folder)
        one_line_of(["generate.py", folder, "--prompt", "x"], f"{folder}: its weight gpt_neox.embed_in.weight {said}")

    linked = crafted("linked")
    (tmp_path / "outside.safetensors").write_bytes((linked / "model.safetensors").read_bytes())
    (linked / "model.safetensors").unlink()
    (linked / "model.safetensors").symlink_to(tmp_path / "outside.safetensors")
    one_line_of(["generate.py", linked, "--prompt", "x"],
                f"{linked}: its weight file is 'model.safetensors', a symlink out of {linked}")
    repo = tmp_path / "hub" / "models--x--tiny"  # the hub cache: each file a link into blobs/
    (repo / "blobs").mkdir(parents=True)
    (repo / "snapshots" / "abc").mkdir(parents=True)
    for path in hf_model.iterdir():
        shutil.copy(path, repo / "blobs" / path.name)
        (repo / "snapshots" / "abc" / path.name).symlink_to(f"../../blobs/{path.name}")
    assert load_hf_pretrained(repo / "snapshots" / "abc")[1].keys() == load_hf_pretrained(hf_model)[1].keys()

    data = make_shards(tmp_path / "data", n_files=3, rows=16)
    one_line_of(["train.py", "--config", "demo", "--output-dir", tmp_path / "out", "--data-dir", data, "--set",
                 f"init_from={tmp_path / 'one-position'}", *[a for s in TINY for a in ("--set", s)]],
                f"{tmp_path / 'one-position'}/config.json: max_position_embeddings is 1, not at least 2")


def family_hf_model(preset: str, path: Path, **config) -> Path:
    """A tiny model of a family's test-size preset as transformers saves it, its config changed by `config`."""
    from configs.model_config import get_model_spec
    from utils.model.families import family_of

    spec = get_model_spec(preset)
    adapter = family_of(spec).hf()
    hf_config = adapter.hf_config(spec)
    for key, value in config.items():
        setattr(hf_config, key, value)
    adapter.causal_lm_class(spec)(hf_config).save_pretrained(path)
    return path


@pytest.mark.slow
def test_an_hf_directory_transformers_would_read_otherwise_or_not_at_all_is_one_line_everywhere(
        hf_model, tmp_path, capsys):
    """Issue 56's and 57's HF folders, read by the one HF reader every entry point uses: a NUL in a weight path
    of model.safetensors.index.json, a Gemma 3 sliding_window_pattern of 0 or -1 and a Qwen3 max_window_layers
    of -1 (no layer_types), a config.json symlinked out of the folder, yarn in rope_scaling beside a plain
    rope_parameters (what transformers applies): each one line naming the file, no traceback, exit 2, through
    generate.py and scripts/evaluate.py (in process) and init_from's reader; through train.py's init_from (a real
    process) for the NUL. A tied config whose weights hold a head of their own trains untied, as transformers
    loads it, said in one line, and exports so (a real train.py)."""
    from safetensors.torch import load_file, save_file

    import generate
    from scripts import evaluate
    from utils.model.hf import load_hf_pretrained

    def folder(name: str, source: Path, edit) -> Path:
        copy = tmp_path / name
        shutil.copytree(source, copy)
        edit(copy)
        return copy

    def config_edit(**change):
        def edit(copy: Path):
            config = json.loads((copy / "config.json").read_text()) | change
            (copy / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
        return edit

    def nul_in_index(copy: Path):
        (copy / "model.safetensors").rename(copy / "model-00001-of-00001.safetensors")
        weights = load_file(str(copy / "model-00001-of-00001.safetensors"))
        index = {"metadata": {}, "weight_map": {k: "model-00001-of-00001.safetensors\0x" for k in weights}}
        (copy / "model.safetensors.index.json").write_text(json.dumps(index))

    def config_outside(copy: Path):
        (copy / "config.json").rename(tmp_path / "outside-config.json")
        (copy / "config.json").symlink_to(tmp_path / "outside-config.json")

    gemma = family_hf_model("gemma3-tiny", tmp_path / "gemma3")
    qwen = family_hf_model("qwen3-tiny", tmp_path / "qwen3")
    cases = {
        "nul": (folder("nul", hf_model, nul_in_index),
                "model.safetensors.index.json: weight_map names 'model-00001-of-00001.safetensors\\x00x', not a "
                "file name"),
        "pattern-0": (folder("pattern-0", gemma, config_edit(layer_types=None, sliding_window_pattern=0)),
                      "config.json: sliding_window_pattern is 0, not a positive integer"),
        "pattern--1": (folder("pattern--1", gemma, config_edit(layer_types=None, sliding_window_pattern=-1)),
                       "config.json: sliding_window_pattern is -1, not a positive integer"),
        "window-layers--1": (folder("window-layers--1", qwen, config_edit(layer_types=None, max_window_layers=-1)),
                             "config.json: max_window_layers is -1, not an integer of at least 0"),
        "config-out": (folder("config-out", hf_model, config_outside),
                       "its config is 'config.json', a symlink out of"),
        "yarn-over": (folder("yarn-over", qwen, config_edit(rope_scaling={"rope_type": "yarn", "factor": 4.0})),
                      "config.json: rope scaling 'yarn' is not supported (from rope_scaling, which transformers "
                      "applies over rope_parameters)"),
    }
    task = tmp_path / "task.jsonl"
    task.write_text(json.dumps({"context": "a", "choices": [" b", " c"], "gold": 0}) + "\n")
    for name, (model, said) in cases.items():
        with pytest.raises(UserError) as refused:
            load_hf_pretrained(model)
        assert str(model) in str(refused.value) and said in str(refused.value), (name, str(refused.value))
        for entry, argv in (("generate", ["--prompt", "x"]), ("evaluate", ["--task", str(task)])):
            main = generate.main if entry == "generate" else evaluate.main
            assert main([str(model), *argv]) == 2, (name, entry)
            err = capsys.readouterr().err.strip().splitlines()
            assert err[-1].startswith(f"error: {model}") and said in err[-1], (name, entry, err)

    data = make_shards(tmp_path / "data", n_files=3, rows=16)
    train = ["train.py", "--config", "demo", "--data-dir", data, *[a for s in TINY for a in ("--set", s)],
             "--set", "max_steps=1"]
    one_line_of([*train, "--output-dir", tmp_path / "out-nul", "--set", f"init_from={cases['nul'][0]}"],
                f"init_from {cases['nul'][0]}/{cases['nul'][1]}")
    own_head = tmp_path / "own-head"  # tied, as the preset is, with a head of its own in the weights
    family_hf_model("llama-tiny", own_head)
    weights = load_file(str(own_head / "model.safetensors"))
    weights["lm_head.weight"] = torch.randn_like(weights["model.embed_tokens.weight"]) * 0.02
    save_file(weights, str(own_head / "model.safetensors"))
    proc = run([sys.executable, *map(str, [*train, "--output-dir", tmp_path / "out-head", "--set",
                                           f"init_from={own_head}"])], env_for_runs())
    warned = [line for line in proc.stderr.splitlines() if "the two stay apart" in line]
    assert len(warned) == 1 and warned[0].startswith(f"warning: init_from {own_head}: config.json ties"), proc.stderr
    exported = tmp_path / "out-head" / "final_model"
    assert json.loads((exported / "config.json").read_text())["tie_word_embeddings"] is False
    assert {"lm_head.weight", "model.embed_tokens.weight"} <= set(load_file(str(exported / "model.safetensors")))


def tiny_checkpoint(root: Path, model: dict | None = None, config: dict | None = None) -> Path:
    """A checkpoint of the tiny model (its weights as built, by the real writer) whose trainer_state.json holds
    `model` as the model record (default: the tiny model's) and `config` as the run's config."""
    from configs.model_config import get_model_spec
    from utils.checkpoint.format import CheckpointPayload, checkpoint_name, write_checkpoint
    from utils.model import build_model

    spec = get_model_spec("tiny")
    state = {"step": 1, "epoch": 0, "tokens": 8, "world_size": 1, "model": spec.to_dict() if model is None else model,
             **({} if config is None else {"config": config})}
    payload = CheckpointPayload(build_model(spec, seed=0).state_dict(), {"rng": [{}]}, state)
    return write_checkpoint(root, checkpoint_name(0, 1, 1), payload)


@pytest.mark.slow
def test_a_crafted_model_record_in_trainer_state_json_is_one_line(tmp_path, hf_model):
    """trainer_state.json's model record: heads not dividing the width, a NaN rotary share, a negative eps, an
    unknown activation, a string where a flag goes, one position, a vocabulary larger than the weights: one line
    naming the file and field, in-process and through generate.py (each was a traceback)."""
    from configs.model_config import get_model_spec
    from utils.model.hf import load_checkpoint_model

    tiny = get_model_spec("tiny").to_dict()
    tokenizer = hf_model.parent / "tokenizer.json"
    if not tokenizer.exists():
        from tests.e2e.test_prepare_data import bpe_tokenizer

        bpe_tokenizer(tokenizer, vocab=300)
    load_checkpoint_model(tiny_checkpoint(tmp_path / "good"))  # as the engine writes it: fine
    cases = [
        ({"num_attention_heads": 5}, "model.hidden_size is 64, not a multiple of num_attention_heads (5)"),
        ({"rotary_pct": float("nan")}, "model.rotary_pct is nan, not a number in (0, 1]"),
        ({"layer_norm_eps": -1e-5}, "model.layer_norm_eps is -1e-05, not a positive finite number"),
        ({"hidden_act": "bogus"}, "model.hidden_act is 'bogus', not an activation transformers knows"),
        ({"use_parallel_residual": "false"}, "model.use_parallel_residual is 'false', not true or false"),
        ({"max_position_embeddings": 1}, "model.max_position_embeddings is 1, not an integer of at least 2"),
        ({"vocab_size": 1000}, "its weights do not match its trainer_state.json's model record (wrong shape"),
    ]
    for i, (change, said) in enumerate(cases):
        checkpoint = tiny_checkpoint(tmp_path / str(i), tiny | change)
        with pytest.raises(UserError) as e:
            load_checkpoint_model(checkpoint)
        assert str(checkpoint) in str(e.value) and said in str(e.value), str(e.value)
        if i in (3, 6):
            one_line_of(["generate.py", checkpoint, "--prompt", "x", "--tokenizer", tokenizer], said)


@pytest.mark.slow
def test_a_crafted_config_or_optimizer_state_is_one_line_when_resuming(tmp_path):
    """trainer_state.json's "config": "x", and an optimizer.pt whose moments have another shape than their
    parameters (its manifest rewritten to match): a resume stops before step 3 in one line naming the file
    (real train.py runs). The first was a traceback; the second loaded, and failed at the first step."""
    data = make_shards(tmp_path / "data", n_files=3, rows=16)
    out = tmp_path / "out"
    run(train_cmd(out, data, "max_steps=2", "save_steps=2"), env_for_runs())
    (checkpoint,) = (out / "checkpoints").iterdir()
    resume = train_cmd(out, data, "max_steps=4", "save_steps=2", extra=("--resume", "latest"))
    saved = {name: (checkpoint / name).read_bytes() for name in ("trainer_state.json", "optimizer.pt", "manifest.json")}

    state = json.loads(saved["trainer_state.json"])
    (checkpoint / "trainer_state.json").write_text(json.dumps({**state, "config": "x"}))
    refresh_manifest(checkpoint, "trainer_state.json")
    line = one_error_line(run(resume, env_for_runs(), check=False))
    assert f"checkpoint {checkpoint}: trainer_state.json: config is 'x', not an object" in line, line

    for name, raw in saved.items():
        (checkpoint / name).write_bytes(raw)
    optimizer = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    first = optimizer["state"][0]
    first["exp_avg"] = torch.zeros(3, 3)
    torch.save(optimizer, checkpoint / "optimizer.pt")
    refresh_manifest(checkpoint, "optimizer.pt")
    proc = run(resume, env_for_runs(), check=False)
    line = one_error_line(proc)
    assert f"checkpoint {checkpoint}: its weights or optimizer state do not fit this model (the saved optimizer's " \
           f"exp_avg of gpt_neox.embed_in.weight has shape (3, 3), the parameter (512, 64))" in line, line
    assert "Step 3" not in proc.stdout


# -------------------------------------------------------------- 9: issue 41: a dataset's files past their checks

@pytest.mark.slow
def test_a_crafted_dataset_json_or_a_changed_tokenizer_is_one_line_before_step_1(tmp_path, gcs_emulator):
    """dataset.json nested past the parser's depth (in a folder, and streamed from gs://), a shard path holding
    a NUL, a tokenizer.json that is not the one its dataset.json records (sha256): one line naming the file,
    before step 1 (in-process, and real train.py runs against the GCS emulator). The first two were tracebacks;
    the third trained to the end with ids that meant other text."""
    from tests.e2e.test_prepare_data import bpe_tokenizer
    from tests.unit.data.test_streaming import upload
    from utils.data.dataset_info import DatasetInfo, DatasetInfoError
    from utils.data.prepare import PrepareOptions, prepare

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i} " + "word " * 40}) + "\n" for i in range(60)))
    data = tmp_path / "data"
    prepare([str(corpus)], str(bpe_tokenizer(tmp_path / "tokenizer.json", vocab=300)), data,
            PrepareOptions(shard_tokens=1024))
    good = (data / "dataset.json").read_text()
    nested = tmp_path / "nested"
    shutil.copytree(data, nested)
    (nested / "dataset.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(DatasetInfoError, match=re.escape(f"{nested / 'dataset.json'} is not a readable dataset "
                                                         f"description (ValueError: nested too deeply to parse)")):
        DatasetInfo.load(nested)
    url = upload(nested, f"gs://{gcs_emulator.bucket}/nested")

    def train(data_dir) -> list[str]:
        return train_cmd(tmp_path / "out", data_dir, "max_steps=2", "seq_len=32", f"data_cache_dir={tmp_path / 'c'}")

    line = one_error_line(run(train(url), env_for_runs(), check=False))
    assert f"{url}/dataset.json is not a readable dataset description (ValueError: nested too deeply" in line, line

    crafted = json.loads(good)
    crafted["shards"][0]["path"] = "part-00000/a\0b.npz"
    (nested / "dataset.json").write_text(json.dumps(crafted))
    with pytest.raises(DatasetInfoError, match=r"shards\[0\].path is 'part-00000/a\\x00b.npz', not the relative path"):
        DatasetInfo.load(nested)

    # another tokenizer, in place of the one the shards were made with
    bpe_tokenizer(data / "tokenizer.json", vocab=320)
    proc = run(train(data), env_for_runs(), check=False)
    line = one_error_line(proc)
    recorded = json.loads(good)["tokenizer"]["sha256"]
    assert f"{data / 'tokenizer.json'} has sha256 " in line and f"not the {recorded[:16]}... that " \
           f"{data / 'dataset.json'} records: the shards were made with another tokenizer" in line, line
    assert "Step 1" not in proc.stdout and not (tmp_path / "out" / "checkpoints").exists()


# ------------------------------------------------- 10: issue 56: a FIFO, a socket or a device named like a file

def non_regular(path: Path, kind: str) -> Path:
    """A FIFO, a socket or a character device (a link to /dev/zero, endless) at `path`: none needs root."""
    import stat

    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "device":
        path.symlink_to("/dev/zero")
    else:
        os.mknod(path, 0o644 | (stat.S_IFIFO if kind == "fifo" else stat.S_IFSOCK))
    return path


def ends_within(seconds: float, fifos=()):
    """A context in which a blocking call (open() of a FIFO waits for a writer for good) fails the test after
    `seconds` instead of hanging the suite: SIGALRM interrupts the main thread's system call, and a reader
    blocked on one of `fifos` in another thread (the index scans on a pool) is released by a writer's open."""
    import contextlib
    import signal

    @contextlib.contextmanager
    def bounded():
        def expire(_signum, _frame):
            for fifo in fifos:
                try:
                    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # the blocked reader's open() returns
                except OSError:
                    pass  # nobody reads it
            raise TimeoutError(f"still blocked after {seconds} s")

        previous = signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)

    return bounded()


@pytest.mark.parametrize("kind", ["fifo", "socket", "device"])
def test_a_non_regular_file_named_like_a_shard_is_one_line_at_once(tmp_path, kind):
    """A FIFO named like a shard hung the run for good after `data: validating N shard file(s)`, before step 1
    (no watchdog looks there): the index checks each file's type before any open(), found by the walk or
    listed in a dataset.json."""
    from utils.data.index import ShardIndex
    from utils.data.shards import ShardError

    words = {"fifo": "a FIFO (named pipe)", "socket": "a socket", "device": "a character device"}[kind]
    data = make_shards(tmp_path / "data", n_files=3, rows=8)
    special = non_regular(data / "part-1" / "shard-999.npz", kind)
    with ends_within(20, [special]), pytest.raises(ShardError) as caught:
        ShardIndex.build(data, seq_len=64, vocab_size=512, log=lambda *_: None)
    assert str(caught.value) == f"{special} is {words}, not a regular file; remove it or put the file there"

    if kind == "device":
        return  # listed in a dataset.json, a link out of the folder is refused as such (test_dataset_json_paths_...)
    listed = make_shards(tmp_path / "listed", n_files=2, rows=8)
    rels = sorted(p.relative_to(listed).as_posix() for p in listed.rglob("*.npz"))
    write_dataset(listed, rels, [])
    (listed / rels[0]).unlink()
    non_regular(listed / rels[0], kind)
    with ends_within(20, [listed / rels[0]]), \
            pytest.raises(ShardError, match=re.escape(f"{listed / rels[0]} is {words}, not")):
        ShardIndex.build(listed, seq_len=64, vocab_size=512, log=lambda *_: None)


def test_every_reader_of_a_file_found_in_a_folder_refuses_a_fifo_at_once(tmp_path):
    """The same for the other readers of files a folder holds: dataset.json itself and the tokenizer it names,
    a tokenizer, a checkpoint's files (resume's newest one is skipped), a prepare input, a task file, the
    crc32c of any file: one UserError naming the file, within seconds, nothing opened."""
    from tests.e2e.test_one_line_errors import fake_checkpoint
    from utils.checkpoint.format import CheckpointError, find_latest_local, verify_checkpoint
    from utils.data.corpus import PrepareError, list_inputs
    from utils.data.dataset_info import DatasetInfo, DatasetInfoError
    from utils.data.tokenizer import TokenizerError, read_tokenizer
    from utils.errors import NotAFileError
    from utils.evals.tasks import TaskFileError, load_task

    data = make_shards(tmp_path / "data", n_files=2, rows=8)
    non_regular(data / "dataset.json", "fifo")
    fifo = non_regular(tmp_path / "fifo", "fifo")
    older = fake_checkpoint(tmp_path / "checkpoints", 2)
    newest = fake_checkpoint(tmp_path / "checkpoints", 4)
    (newest / "trainer_state.json").unlink()
    non_regular(newest / "trainer_state.json", "fifo")
    described = make_shards(tmp_path / "described", n_files=2, rows=8)
    write_dataset(described, sorted(p.relative_to(described).as_posix() for p in described.rglob("*.npz")), [])
    raw = json.loads((described / "dataset.json").read_text())
    raw["tokenizer"]["sha256"] = "0" * 64
    (described / "dataset.json").write_text(json.dumps(raw))
    non_regular(described / "tokenizer.json", "fifo")
    said = []
    with ends_within(30):
        with pytest.raises(DatasetInfoError, match=r"dataset.json is not a readable dataset description "
                                                   r"\(NotAFileError: .*dataset.json is a FIFO"):
            DatasetInfo.load(data)
        with pytest.raises(DatasetInfoError, match=r"names the tokenizer .*tokenizer.json, which cannot be read "
                                                   r"\(.*is a FIFO"):
            DatasetInfo.load(described)
        with pytest.raises(TokenizerError, match=f"--tokenizer {fifo} is a FIFO"):
            read_tokenizer(fifo)
        with pytest.raises(CheckpointError, match="trainer_state.json is not a regular file; the checkpoint is"):
            verify_checkpoint(newest)
        assert find_latest_local(tmp_path / "checkpoints", log=said.append) == older
        with pytest.raises(PrepareError, match=f"--input {fifo}: not a regular file or folder"):
            list_inputs([str(fifo)])
        with pytest.raises(TaskFileError, match=f"task file {fifo}: cannot read it \\(.* is a FIFO"):
            load_task(fifo)
        with pytest.raises(NotAFileError):
            file_crc32c(fifo)
    assert said and f"skipping checkpoint {newest.name}" in said[0]


@pytest.mark.slow
def test_train_py_with_a_fifo_named_like_a_shard_ends_in_seconds(tmp_path):
    """The probe's case through train.py: one line naming the FIFO, exit 2, long before any watchdog."""
    import time

    data = make_shards(tmp_path / "data", n_files=3, rows=8)
    fifo = non_regular(data / "part-0" / "shard-009.npz", "fifo")
    started = time.monotonic()
    proc = run(train_cmd(tmp_path / "out", data, "max_steps=2"), env_for_runs(), timeout=120, check=False)
    assert f"error: {fifo} is a FIFO (named pipe), not a regular file" in one_error_line(proc)
    assert time.monotonic() - started < 60 and "Step 1" not in proc.stdout


# --------------------------------------- 11: issue 56: a dataset.json that lists a shard twice, or a wrong crc32c

def test_a_dataset_json_listing_a_shard_twice_or_in_both_splits_is_refused(tmp_path):
    """Listed twice, a shard trained twice an epoch; in both splits, it was validated on after training on it;
    neither said a word. prepare_data.py never writes either: one line naming the file and both fields (the same
    check reads a streamed dataset's dataset.json)."""
    from utils.data.dataset_info import DatasetInfo, DatasetInfoError
    from utils.data.index import ShardIndex

    data = make_shards(tmp_path / "data", n_files=3, rows=8)
    rels = sorted(p.relative_to(data).as_posix() for p in data.rglob("*.npz"))
    write_dataset(data, [rels[0], rels[1], rels[0]], [rels[2]])
    with pytest.raises(DatasetInfoError, match=re.escape(f"dataset.json: shards[2].path names {rels[0]}, which "
                                                         f"shards[0].path names too: a shard is listed once")):
        ShardIndex.build(data, seq_len=64, vocab_size=512, log=lambda *_: None)
    write_dataset(data, rels[:2], [rels[1], rels[2]])
    with pytest.raises(DatasetInfoError, match=re.escape(f"validation.shards[0].path names {rels[1]}, which "
                                                         f"shards[1].path names too")):
        DatasetInfo.load(data)
    write_dataset(data, rels[:2], [rels[2]])
    assert len(ShardIndex.build(data, seq_len=64, vocab_size=512, log=lambda *_: None)) == 3


def test_a_local_shard_whose_crc32c_or_size_is_not_its_dataset_json_s_is_one_line(tmp_path):
    """Local shards were never checked against their dataset.json (a bucket's are, on download): now the size at
    every start (a stat), the crc32c on the file's first scan (which reads it whole anyway) and from the index's
    cache after that, so a changed dataset.json is caught without reading a byte of data again."""
    from utils.data import index as data_index
    from utils.data.index import ShardIndex
    from utils.data.shards import ShardError

    data = make_shards(tmp_path / "data", n_files=3, rows=8)
    rels = sorted(p.relative_to(data).as_posix() for p in data.rglob("*.npz"))
    write_dataset(data, rels, [])
    described = json.loads((data / "dataset.json").read_text())
    for entry in described["shards"]:
        entry["crc32c"] = file_crc32c(data / entry["path"])
    (data / "dataset.json").write_text(json.dumps(described))
    assert len(ShardIndex.build(data, seq_len=64, vocab_size=512, log=lambda *_: None)) == 3
    cached = json.loads((data / data_index.CACHE_NAME).read_text())["files"]
    assert [cached[rel]["crc32c"] for rel in rels] == [e["crc32c"] for e in described["shards"]]

    listed = described["shards"][1]["crc32c"]
    described["shards"][1]["crc32c"] = "AAAAAA=="
    (data / "dataset.json").write_text(json.dumps(described))
    reads = []
    real_crc = data_index.file_crc32c
    data_index.file_crc32c = lambda path: reads.append(path) or real_crc(path)
    try:
        with pytest.raises(ShardError) as caught:
            ShardIndex.build(data, seq_len=64, vocab_size=512, log=lambda *_: None)
    finally:
        data_index.file_crc32c = real_crc
    assert str(caught.value) == (f"{data / rels[1]}: has crc32c {listed}, but {data / 'dataset.json'} lists AAAAAA==; "
                                 f"it is not the shard prepare_data.py wrote (corrupt, or replaced): download it again "
                                 f"(download_training_data.py verifies each file) or prepare the data again")
    assert reads == [], "the cached crc32c answers without reading the data"
    (data / data_index.CACHE_NAME).unlink()
    with pytest.raises(ShardError, match=r"has crc32c .*, but .* lists AAAAAA=="):  # found by the first scan too
        ShardIndex.build(data, seq_len=64, vocab_size=512, log=lambda *_: None)

    described["shards"][1]["crc32c"] = listed
    described["shards"][2]["bytes"] += 1
    (data / "dataset.json").write_text(json.dumps(described))
    with pytest.raises(ShardError, match=re.escape(f"{data / rels[2]}: has bytes {(data / rels[2]).stat().st_size}, "
                                                   f"but {data / 'dataset.json'} lists ")):
        ShardIndex.build(data, seq_len=64, vocab_size=512, log=lambda *_: None)


@pytest.mark.slow
def test_train_py_on_a_shard_whose_crc32c_is_not_its_dataset_json_s_stops_before_step_1(tmp_path):
    """The probe's case through train.py: a prepared dataset whose dataset.json lists another crc32c for one
    shard (it trained and exported without a word): one line naming the shard and both checksums, exit 2."""
    from tests.e2e.test_prepare_data import bpe_tokenizer
    from utils.data.prepare import PrepareOptions, prepare

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i} " + "word " * 40}) + "\n" for i in range(60)))
    data = tmp_path / "data"
    prepare([str(corpus)], str(bpe_tokenizer(tmp_path / "tokenizer.json", vocab=300)), data,
            PrepareOptions(shard_tokens=1024))
    described = json.loads((data / "dataset.json").read_text())
    described["shards"][0]["crc32c"] = "AAAAAA=="
    (data / "dataset.json").write_text(json.dumps(described))
    proc = run(train_cmd(tmp_path / "out", data, "max_steps=2", "seq_len=32"), env_for_runs(), check=False)
    line = one_error_line(proc)
    assert f"{data / described['shards'][0]['path']}: has crc32c " in line and "lists AAAAAA==" in line, line
    assert "Step 1" not in proc.stdout and not (tmp_path / "out" / "final_model").exists()
