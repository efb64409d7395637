"""HF directories in and out and the engine's older checkpoints, whatever the family: init_from's reader (both
GPT-NeoX head names, buffers of older files, a weight index naming files out of its folder), init_from
starting at the HF model's own loss, scripts/export_hf.py, checkpoints of earlier engines resuming on today's
(the transformers-backed one, the one before the family seam, a3d8304 before the family bundles: bitwise, and
the same HF export byte for byte), fp8 refused off Hopper and switching precision on resume."""
from __future__ import annotations

import json
import re
import shutil
import sys
from dataclasses import replace

import pytest
import torch

from configs.model_config import ConfigError, ModelSpec, get_model_spec
from tests.trainkit import REPO_ROOT, earlier_engine_cmd, engine_at, make_shards, metrics, run, train_cmd, train_rows
from utils.checkpoint.format import list_checkpoints
from utils.model import build_model
from utils.model.hf import load_hf_pretrained, to_transformers

BASE = ModelSpec("toy", vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=128, max_position_embeddings=32)


def test_load_hf_pretrained_takes_both_head_names_and_refuses_others(tmp_path):
    from safetensors.torch import load_file, save_file

    spec = replace(BASE, pad_vocab_multiple=1)
    to_transformers(build_model(spec, seed=7, impl="hf").state_dict(), spec).save_pretrained(tmp_path / "a")
    _, from_embed_out = load_hf_pretrained(tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    tensors = load_file(str(tmp_path / "b" / "model.safetensors"))
    assert "embed_out.weight" in tensors  # what transformers writes for GPT-NeoX
    tensors["lm_head.weight"] = tensors.pop("embed_out.weight")
    tensors["gpt_neox.layers.0.attention.bias"] = torch.ones(1, 1, 32, 32)  # an old file's mask buffer
    save_file(tensors, str(tmp_path / "b" / "model.safetensors"), metadata={"format": "pt"})
    loaded_spec, from_lm_head = load_hf_pretrained(tmp_path / "b")
    assert from_lm_head.keys() == from_embed_out.keys()
    assert all(torch.equal(from_lm_head[k], from_embed_out[k]) for k in from_lm_head)
    assert loaded_spec.padded_vocab_size == 300 and loaded_spec.name == "b"

    config = json.loads((tmp_path / "a" / "config.json").read_text())
    (tmp_path / "mamba").mkdir()
    (tmp_path / "mamba" / "config.json").write_text(json.dumps(config | {"model_type": "mamba"}))
    with pytest.raises(ConfigError, match=r"mamba.*config.json: model_type is 'mamba'; the engine loads"):
        load_hf_pretrained(tmp_path / "mamba")
    with pytest.raises(ConfigError, match="no config.json there"):
        load_hf_pretrained(tmp_path / "nowhere")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny GPT-NeoX saved by transformers' save_pretrained, the way a Pythia checkpoint is."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    path = tmp_path_factory.mktemp("hf") / "tiny-neox"
    torch.manual_seed(11)
    config = GPTNeoXConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=256, max_position_embeddings=64, rotary_pct=0.5,
                           use_parallel_residual=False, tie_word_embeddings=False)
    model = GPTNeoXForCausalLM(config)
    with torch.no_grad():  # trained-looking weights: no zero bias that any update would move
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


@pytest.mark.slow
def test_init_from_starts_at_the_hf_models_loss_and_keeps_its_weights(hf_dir, tmp_path, subprocess_env):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    data = make_shards(tmp_path / "data")
    out = tmp_path / "out"
    proc = run(train_cmd(out, data, f"init_from={hf_dir}", "model=demo", "max_steps=1", "learning_rate=1e-30",
                         "warmup_steps=0", "min_lr_ratio=1.0", "weight_decay=0", "eval_batches=2",
                         "per_device_train_batch_size=4"), subprocess_env)
    assert f"init_from {hf_dir}: architecture from its config.json" in proc.stdout
    assert "the model field ('demo') is ignored" in proc.stdout
    val0 = next(r["val_loss"] for r in metrics(out) if r.get("val_loss") is not None and r["step"] == 0)
    # the same batches through transformers' own model: the last file's first 2 batches of 4
    from utils.data.dataset import TokenSequenceDataset
    from utils.data.index import ShardIndex
    from utils.data.loader import build_eval_batches

    val_set = TokenSequenceDataset(ShardIndex.build(data, seq_len=64, vocab_size=512, log=lambda *_: None).split(1)[1])
    reference = AutoModelForCausalLM.from_pretrained(hf_dir)
    with torch.no_grad():
        losses = [reference(input_ids=b, labels=b).loss.item() for b in build_eval_batches(val_set, 4, 0, 1, 2)]
    assert abs(val0 - sum(losses) / len(losses)) <= 1e-5
    before, after = (load_file(str(hf_dir / "model.safetensors")),
                     load_file(str(out / "final_model" / "model.safetensors")))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.slow
def test_a_checkpoint_of_the_hf_backed_engine_resumes_on_the_native_model(tmp_path, subprocess_env):
    """A checkpoint written by the engine before the native model (commit 1674d40, transformers' class
    inside) resumes on today's default, the native model, weights and AdamW state included, and continues
    the old engine's uninterrupted run (also across the max_steps change: the restored schedule is this
    run's, see utils/training/lr_scheduler.py StepSchedule)."""
    old = engine_at("1674d40", tmp_path / "old-engine")
    data = make_shards(tmp_path / "data")
    out = tmp_path / "out"
    sets = ["per_device_train_batch_size=4", "save_steps=2"]
    old_env = dict(subprocess_env, PYTHONPATH=str(old))
    cmd = earlier_engine_cmd(old, out, data, *sets, "max_steps=2")
    run(cmd, old_env)
    from safetensors.torch import load_file

    saved = list_checkpoints(out / "checkpoints")[-1]
    assert "lm_head.weight" in load_file(str(saved / "model.safetensors"))  # transformers' in-memory names
    proc = run(train_cmd(out, data, *sets, "max_steps=4", extra=("--resume", "latest")), subprocess_env)
    assert "Resumed from" in proc.stdout and "at step 2" in proc.stdout
    # the same 4 steps without the interruption, on the old engine: the resumed losses continue its curve
    straight = tmp_path / "straight"
    run(earlier_engine_cmd(old, straight, data, *sets, "max_steps=4"), old_env)
    resumed, reference = train_rows(out), train_rows(straight)
    for step in (3, 4):
        assert abs(resumed[step]["loss"] - reference[step]["loss"]) <= 1e-4, step


@pytest.mark.slow
def test_fp8_is_refused_off_hopper_in_one_line(tmp_path, subprocess_env):
    """On the CPU; on a CUDA machine too, its GPUs hidden (a Hopper GPU would run it)."""
    data = make_shards(tmp_path / "data")
    env = dict(subprocess_env, CUDA_VISIBLE_DEVICES="")
    proc = run(train_cmd(tmp_path / "out", data, "mixed_precision=fp8", "max_steps=1"), env, check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr
    assert "mixed_precision=fp8 needs an NVIDIA Hopper or Ada GPU" in errors[0]


@pytest.mark.slow
def test_fp8_trains_checkpoints_plain_weights_and_switches_precision_on_resume(tmp_path, subprocess_env):
    """torchao's float8 training in emulation (the CPU has no float8 tensor cores): the same checkpoint
    format as bf16, and a run may switch between bf16 and fp8 when it resumes."""
    pytest.importorskip("torchao")
    data = make_shards(tmp_path / "data")
    env = dict(subprocess_env, NEOX_FP8_EMULATE="1")
    out = tmp_path / "out"
    sets = ["per_device_train_batch_size=4", "save_steps=2", "preflight_steps=0"]
    proc = run(train_cmd(out, data, *sets, "mixed_precision=fp8", "max_steps=2"), env)
    assert re.search(r"fp8: \d+ Linear layers run float8 matmuls", proc.stdout)
    fp8_ckpt = list_checkpoints(out / "checkpoints")[-1]
    bf16 = tmp_path / "bf16"
    run(train_cmd(bf16, data, *sets, "mixed_precision=bf16", "max_steps=2"), env)
    from safetensors.torch import load_file

    a, b = (load_file(str(fp8_ckpt / "model.safetensors")),
            load_file(str(list_checkpoints(bf16 / "checkpoints")[-1] / "model.safetensors")))
    assert a.keys() == b.keys() and all(a[k].dtype == b[k].dtype == torch.float32 for k in a)
    run(train_cmd(out, data, *sets, "mixed_precision=bf16", "max_steps=3", extra=("--resume", "latest")), env)
    run(train_cmd(bf16, data, *sets, "mixed_precision=fp8", "max_steps=3", extra=("--resume", "latest")), env)
    assert max(train_rows(out)) == 3 and max(train_rows(bf16)) == 3
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in train_rows(bf16).values())


@pytest.mark.slow
def test_export_script_converts_a_checkpoint(tmp_path, subprocess_env):
    data = make_shards(tmp_path / "data")
    out = tmp_path / "out"
    run(train_cmd(out, data, "max_steps=2", "save_steps=2", "per_device_train_batch_size=4"), subprocess_env)
    ckpt = list_checkpoints(out / "checkpoints")[-1]
    script = [sys.executable, str(REPO_ROOT / "scripts" / "export_hf.py")]
    proc = run(script + [str(ckpt), str(tmp_path / "hf")], subprocess_env)
    assert "exported" in proc.stdout
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    final = AutoModelForCausalLM.from_pretrained(out / "final_model")  # the same step-2 weights
    assert all(torch.equal(p, q) for p, q in zip(model.state_dict().values(), final.state_dict().values()))
    again = run(script + [str(ckpt), str(tmp_path / "hf")], subprocess_env, check=False)
    assert again.returncode == 2 and "already exists and is not empty" in again.stderr
    bad = run(script + [str(tmp_path / "nope"), str(tmp_path / "x")], subprocess_env, check=False)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "error:" in bad.stderr


def test_an_hf_weight_index_naming_a_file_out_of_its_directory_is_refused(tmp_path):
    """A sharded HF directory whose model.safetensors.index.json names ../x.safetensors, an absolute path, or
    a symlink out of the directory: one line naming the index and the entry (each was read). The hub cache's
    own layout (snapshots/REV/ files linking to ../../blobs/) still loads."""
    from utils.errors import UserError

    spec = replace(BASE, pad_vocab_multiple=1)
    model = to_transformers(build_model(spec, seed=7, impl="hf").state_dict(), spec)
    model.save_pretrained(tmp_path / "real", max_shard_size="200KB")
    index = json.loads((tmp_path / "real" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    _, weights = load_hf_pretrained(tmp_path / "real")
    outside = tmp_path / "outside.safetensors"
    shutil.copy(tmp_path / "real" / shards[0], outside)

    def crafted(name: str, entry: str, link: bool = False):
        folder = tmp_path / name
        shutil.copytree(tmp_path / "real", folder)
        (folder / shards[0]).unlink()
        if link:
            (folder / entry).symlink_to(outside)
        crafted_index = json.loads(json.dumps(index))
        crafted_index["weight_map"] = {k: entry if v == shards[0] else v for k, v in index["weight_map"].items()}
        (folder / "model.safetensors.index.json").write_text(json.dumps(crafted_index))
        return folder

    for folder, entry, said in [(crafted("dotdot", "../outside.safetensors"), "../outside.safetensors",
                                 "absolute or '..'"),
                                (crafted("absolute", str(outside)), str(outside), "absolute or '..'"),
                                (crafted("link", "w.safetensors", link=True), "w.safetensors", "a symlink out of")]:
        with pytest.raises(UserError) as e:
            load_hf_pretrained(folder)
        line = str(e.value)
        assert "\n" not in line and "model.safetensors.index.json: weight_map names" in line, line
        assert repr(entry) in line and said in line, line

    repo = tmp_path / "hub" / "models--x--tiny"  # the hub cache: every file a link into blobs/
    (repo / "blobs").mkdir(parents=True)
    (repo / "snapshots" / "abc").mkdir(parents=True)
    for path in (tmp_path / "real").iterdir():
        shutil.copy(path, repo / "blobs" / path.name)
        (repo / "snapshots" / "abc" / path.name).symlink_to(f"../../blobs/{path.name}")
    _, cached = load_hf_pretrained(repo / "snapshots" / "abc")
    assert cached.keys() == weights.keys() and all(torch.equal(cached[k], weights[k]) for k in weights)



def resumed_from_an_older_engine(commit: str, tmp_path, env: dict, sets: list[str], before_resume=None):
    """`commit`'s engine trains 2 steps (a checkpoint at step 2), `before_resume(checkpoint, out)` looks at them,
    today's engine resumes that checkpoint to step 4, and the old engine runs the 4 steps without the
    interruption: then steps 3-4 and the exported weights are bit for bit the same (asserted here)."""
    from safetensors.torch import load_file

    old = engine_at(commit, tmp_path / "old-engine")
    data = make_shards(tmp_path / "data")
    old_env = dict(env, PYTHONPATH=str(old))
    out, straight = tmp_path / "out", tmp_path / "straight"
    run(earlier_engine_cmd(old, out, data, *sets, "max_steps=2"), old_env)
    saved = list_checkpoints(out / "checkpoints")[-1]
    if before_resume is not None:
        before_resume(saved, out)
    proc = run(train_cmd(out, data, *sets, "max_steps=4", extra=("--resume", "latest")), env)
    assert "Resumed from" in proc.stdout and "at step 2" in proc.stdout
    run(earlier_engine_cmd(old, straight, data, *sets, "max_steps=4"), old_env)
    resumed, reference = train_rows(out), train_rows(straight)
    for step in (3, 4):
        assert resumed[step]["loss"] == reference[step]["loss"], (step, resumed[step], reference[step])
    a = load_file(str(out / "final_model" / "model.safetensors"))
    b = load_file(str(straight / "final_model" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return saved, list_checkpoints(out / "checkpoints")[-1]


@pytest.mark.slow
def test_a_checkpoint_of_the_engine_before_the_seam_resumes_bitwise(tmp_path, subprocess_env):
    """A GPT-NeoX run of the engine before the model seam (5d01e6f), stopped at step 2 and resumed by
    today's: steps 3-4 and the exported weights are bit for bit those of the old engine's uninterrupted run."""
    resumed_from_an_older_engine("5d01e6f", tmp_path, subprocess_env, ["per_device_train_batch_size=4", "save_steps=2"])


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny", "llama-tiny"])
def test_a_checkpoint_of_a3d8304_resumes_bitwise_and_exports_byte_for_byte(model, tmp_path, subprocess_env):
    """The engine before the family bundles and shared blocks (a3d8304) trains 2 steps; today's
    scripts/export_hf.py writes, from its checkpoint, the very files the old engine exported for those weights
    (model.safetensors, config.json, generation_config.json: byte for byte); today's engine resumes the
    checkpoint, continues the old engine's uninterrupted run bit for bit, and writes model.safetensors with
    the keys the old one wrote."""
    from safetensors.torch import load_file

    def export_again(saved, out):
        run([sys.executable, str(REPO_ROOT / "scripts" / "export_hf.py"), str(saved), str(tmp_path / "new-export")],
            subprocess_env)
        for name in ("model.safetensors", "config.json", "generation_config.json"):
            assert (tmp_path / "new-export" / name).read_bytes() == (out / "final_model" / name).read_bytes(), name

    sets = [f"model={model}", "per_device_train_batch_size=4", "save_steps=2"]
    old, newest = resumed_from_an_older_engine("a3d8304", tmp_path, subprocess_env, sets, before_resume=export_again)
    assert load_file(str(newest / "model.safetensors")).keys() == load_file(str(old / "model.safetensors")).keys()


@pytest.mark.slow
def test_init_from_a_131072_position_llama_trains_at_its_original_context_and_exports_every_position(
        tmp_path, subprocess_env):
    """A Llama 3.2-shaped config (131,072 positions, llama3 rope scaling from an 8,192-token original context)
    with ordinary 1-D token-stream shards and no seq_len: the run trains at 8,192 tokens a sequence, says so in
    its first lines, and final_model/ keeps the 131,072 positions and the rope scaling."""
    import numpy as np

    from utils.model.families import family

    spec = replace(get_model_spec("llama-tiny"), max_position_embeddings=131072,
                   rope_scaling=(32.0, 1.0, 4.0, 8192))
    fam = family("llama")
    fam.hf().causal_lm_class(spec)(fam.hf().hf_config(spec)).save_pretrained(tmp_path / "llama-131k")
    rng = np.random.default_rng(0)
    for i in range(3):  # two for training, the last held out: streams as prepare_data.py writes them
        (tmp_path / "data").mkdir(exist_ok=True)
        np.savez(tmp_path / "data" / f"shard-{i:05d}.npz", input_ids=rng.integers(0, 512, 20_000).astype(np.uint16))
    out = tmp_path / "out"
    proc = run(train_cmd(out, tmp_path / "data", "max_steps=2", "save_steps=2", "per_device_train_batch_size=1",
                         "eval_batches=1", f"init_from={tmp_path / 'llama-131k'}"), subprocess_env, timeout=600)
    first_lines = proc.stdout.splitlines()[:12]
    assert any("seq_len not set: training at 8,192 tokens a sequence" in line and "131,072 positions" in line
               for line in first_lines), "\n".join(first_lines)
    rows = train_rows(out)
    assert rows[2]["tokens"] == 2 * 8192, rows[2]
    config = json.loads((out / "final_model" / "config.json").read_text())
    rope = config.get("rope_parameters") or config["rope_scaling"]
    assert config["max_position_embeddings"] == 131072
    assert rope["rope_type"] == "llama3" and rope["original_max_position_embeddings"] == 8192 and rope["factor"] == 32
