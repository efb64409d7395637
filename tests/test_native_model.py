"""The native GPT-NeoX against transformers' GPTNeoXForCausalLM, both ways: same logits, loss and gradients
on every architecture variant, HF weights in (`init_from`) and out (`final_model/`, scripts/export_hf.py),
old checkpoints resuming on it, fp8 (torchao emulation on the CPU)."""
from __future__ import annotations

import json
import re
import shutil
import sys
from dataclasses import replace

import pytest
import torch

from configs.model_config import ConfigError, ModelSpec
from tests.trainkit import REPO_ROOT, engine_at, make_shards, metrics, run, train_cmd, train_rows
from utils.checkpoint.format import list_checkpoints
from utils.model import build_model
from utils.model import gpt_neox, lm_loss
from utils.model.hf import export_hf, load_hf_pretrained, to_transformers

BASE = ModelSpec("toy", vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=128, max_position_embeddings=32)
VARIANTS = {
    "pythia-like": {},
    "full-rotary-sequential": {"rotary_pct": 1.0, "use_parallel_residual": False},
    "no-biases": {"attention_bias": False},
    "base-eps-act": {"rotary_pct": 0.5, "rotary_emb_base": 500.0, "layer_norm_eps": 1e-6, "hidden_act": "gelu_new"},
    "tied-unpadded": {"tie_word_embeddings": True, "pad_vocab_multiple": 1},
}


def ids(batch=3, length=32, vocab=300, seed=0):
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_native_equals_transformers_logits_loss_and_gradients(variant):
    spec = replace(BASE, **VARIANTS[variant])
    hf = build_model(spec, seed=1, impl="hf")
    native = build_model(spec, seed=2)
    assert [n for n, _ in native.named_parameters()] == [n for n, _ in hf.named_parameters()]  # names and order
    native.load_state_dict(hf.state_dict())
    x = ids()
    reference = to_transformers(hf.state_dict(), spec)  # transformers' own class, untouched
    with torch.no_grad():
        theirs = reference(input_ids=x).logits
        assert (native.logits(x) - theirs).abs().max().item() <= 1e-5
        assert abs(native(x).item() - reference(input_ids=x, labels=x).loss.item()) <= 1e-5
    native(x).backward()
    hf(x).backward()
    grads = dict(hf.named_parameters())
    for name, p in native.named_parameters():
        assert torch.allclose(p.grad, grads[name].grad, atol=1e-6, rtol=1e-4), name


def test_chunked_loss_equals_the_plain_one(monkeypatch):
    """Several chunks (and a ragged last one) give the same loss and gradients as full logits."""
    monkeypatch.setattr(lm_loss, "LOSS_CHUNK_ROWS", 7)  # the chunked loss lives in utils/model/lm_loss.py
    model = build_model(BASE, seed=3)
    x = ids(batch=2, length=20)
    loss = model(x)
    loss.backward()
    chunked = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    logits = model.logits(x)[:, :-1].float()
    plain = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))
    plain.backward()
    assert abs(loss.item() - plain.item()) <= 1e-6
    for name, p in model.named_parameters():
        assert torch.allclose(chunked[name], p.grad, atol=1e-7, rtol=1e-5), name
    # under no_grad (eval) the loss-only path: the same value without the two gradient matmuls
    calls = []
    monkeypatch.setattr(lm_loss.ChunkedLMHeadLoss, "forward", lambda *a: calls.append(a))
    with torch.no_grad():
        assert abs(model(x).item() - plain.item()) <= 1e-6
    assert calls == []


@pytest.mark.slow
def test_regional_compile_changes_nothing():  # activation checkpointing: tests/test_activation_checkpointing.py
    x = ids(batch=2, length=16)
    grads = []
    for compiled in (False, True):
        model = build_model(BASE, seed=4)
        if compiled:
            model.compile_blocks()
        model(x).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for other in grads[1:]:
        for name in grads[0]:
            assert torch.allclose(grads[0][name], other[name], atol=1e-6, rtol=1e-4), name


def test_import_then_export_is_bit_for_bit(tmp_path):
    spec = replace(BASE, pad_vocab_multiple=1)
    hf = to_transformers(build_model(spec, seed=5, impl="hf").state_dict(), spec)
    hf.save_pretrained(tmp_path / "in")
    loaded_spec, weights = load_hf_pretrained(tmp_path / "in")
    native = build_model(loaded_spec, seed=6)
    native.load_state_dict(weights)
    export_hf(native.state_dict(), loaded_spec, tmp_path / "out")
    from safetensors.torch import load_file

    before, after = load_file(str(tmp_path / "in" / "model.safetensors")), load_file(str(tmp_path / "out" / "model.safetensors"))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "gpt_neox"
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    x = ids(vocab=300)
    with torch.no_grad():
        assert abs(reloaded(input_ids=x, labels=x).loss.item() - native(x).item()) <= 1e-5


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
    before, after = load_file(str(hf_dir / "model.safetensors")), load_file(str(out / "final_model" / "model.safetensors"))
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
    cmd = [sys.executable, str(old / "train.py")] + train_cmd(out, data, *sets, "max_steps=2")[2:]
    run(cmd, old_env)
    from safetensors.torch import load_file

    saved = list_checkpoints(out / "checkpoints")[-1]
    assert "lm_head.weight" in load_file(str(saved / "model.safetensors"))  # transformers' in-memory names
    proc = run(train_cmd(out, data, *sets, "max_steps=4", extra=("--resume", "latest")), subprocess_env)
    assert "Resumed from" in proc.stdout and "at step 2" in proc.stdout
    # the same 4 steps without the interruption, on the old engine: the resumed losses continue its curve
    straight = tmp_path / "straight"
    run([sys.executable, str(old / "train.py")] + train_cmd(straight, data, *sets, "max_steps=4")[2:], old_env)
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

    a, b = load_file(str(fp8_ckpt / "model.safetensors")), load_file(str(list_checkpoints(bf16 / "checkpoints")[-1] / "model.safetensors"))
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

    for folder, entry, said in [(crafted("dotdot", "../outside.safetensors"), "../outside.safetensors", "absolute or '..'"),
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
