"""A toy Llama (grouped-query attention, tied embeddings) through the engine's seam: activation-checkpointing
policies give `none`'s gradients, `attention=document` gives a packed document its logits alone, the memory
plan counts it; and in real processes: train.py learns, 2 DDP ranks equal 1 process, 2 FSDP ranks equal DDP,
an FSDP checkpoint resumes on 1 process, tied embeddings stay tied through FSDP, checkpoints and export,
`init_from` an HF Llama directory, and the demo with `model=llama-demo` learns."""
from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from configs import get_model_spec
from configs.training_config import ACTIVATION_CHECKPOINTING
from tests.trainkit import REPO_ROOT, TINY, make_shards, metrics, run, train_cmd, train_rows
from utils.model import build_model
from utils.model.activation_checkpointing import apply_activation_checkpointing, parameter_fqn

SPEC = replace(get_model_spec("llama-tiny"), num_hidden_layers=4)
LLAMA = ["model=llama-tiny"]
STEPS = ("max_steps=6", "save_steps=3", "save_total_limit=3")


def close(a: float, b: float, rel: float = 1e-5) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-7)


@pytest.mark.parametrize("impl", ["native", "hf"])
def test_every_policy_gives_the_gradients_of_none(impl):
    x = torch.randint(0, SPEC.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    grads = {}
    for policy in ACTIVATION_CHECKPOINTING:
        model = build_model(SPEC, seed=3, impl=impl)
        wrapped = apply_activation_checkpointing(model, policy, every=2)
        assert wrapped == {"none": 0, "full": 4, "every_k": 2, "selective": 4}[policy]
        model(x).backward()
        grads[policy] = {parameter_fqn(n): p.grad.clone() for n, p in model.named_parameters()}
    for policy in ACTIVATION_CHECKPOINTING:
        assert grads[policy].keys() == grads["none"].keys()
        for name, g in grads["none"].items():
            assert torch.allclose(grads[policy][name], g, atol=1e-6, rtol=0), (policy, name)


@torch.no_grad()
def test_a_packed_document_has_its_logits_alone():
    eos = 0

    def doc(n, seed):
        body = torch.randint(1, SPEC.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))
        return torch.cat([body, torch.tensor([eos])])

    a, b = doc(9, 1), doc(12, 2)
    plain = build_model(SPEC, seed=1).eval()
    masked = build_model(SPEC, seed=1).eval()
    masked.use_document_masking(eos, position_reset=True, flex=False)
    logits = masked.logits(torch.cat([a, b])[None])[0]
    assert torch.allclose(logits[len(a):], plain.logits(b[None])[0], atol=1e-5, rtol=0)
    assert not torch.allclose(plain.logits(torch.cat([a, b])[None])[0, len(a):], plain.logits(b[None])[0], atol=1e-3)


def test_memory_plan_counts_a_llama_preset():
    from configs.profiles import memory_plan

    spec = get_model_spec("llama-3.2-1b")
    with torch.device("meta"):
        total = sum(p.numel() for p in build_model(spec, seed=0).parameters())
    plan = memory_plan(spec, strategy="ddp", micro_batch=1, seq_len=2048)
    assert abs(plan.weights / 4 / total - 1) < 1e-5  # fp32 weights: the model's own parameter count
    fsdp = memory_plan(spec, strategy="fsdp", world_size=8, micro_batch=1, seq_len=2048)
    assert math.isclose(fsdp.state * 8, plan.state)
    out = __import__("subprocess").run([str(REPO_ROOT / ".venv" / "bin" / "python"),
                                        str(REPO_ROOT / "scripts" / "memory_plan.py"), "--model", "llama-3.2-1b"],
                                       capture_output=True, text=True)
    assert out.returncode in (0, 1) and "weights (fp32)" in out.stdout, out.stdout + out.stderr


def launch(out: Path, data: Path, gpus: int, strategy: str, *sets: str, env=None):
    cmd = [str(REPO_ROOT / "start_training.sh"), "--config", "demo", "--cpu", "--gpus", str(gpus),
           "--strategy", strategy, "--", "--output-dir", str(out), "--data-dir", str(data)]
    for s in TINY + LLAMA + list(sets):
        cmd += ["--set", s]
    return run(cmd, env, timeout=600)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Global batch 4, 6 steps, checkpoints at 3 and 6. fsdp2: 2 FSDP ranks (micro 1 x accumulation 2);
    ddp2: 2 DDP ranks (the same); one: 1 process (micro 2 x accumulation 2)."""
    root = tmp_path_factory.mktemp("llama")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    data = make_shards(root / "data")
    out = {"root": root, "data": data, "env": env}
    for name, gpus, strategy in (("fsdp2", 2, "fsdp"), ("ddp2", 2, "ddp")):
        out[name] = root / name
        launch(out[name], data, gpus, strategy, *STEPS, "per_device_train_batch_size=1",
               "gradient_accumulation_steps=2", env=env)
    out["one"] = root / "one"
    run(train_cmd(out["one"], data, *LLAMA, *STEPS, "per_device_train_batch_size=2", "gradient_accumulation_steps=2"),
        env)
    return out


def checkpoint(out: Path, step: int) -> Path:
    return next((out / "checkpoints").glob(f"checkpoint-epoch*-step{step}-files*"))


@pytest.mark.slow
def test_one_process_learns_and_ranks_and_strategies_agree(runs):
    one, ddp2, fsdp2 = (train_rows(runs[k]) for k in ("one", "ddp2", "fsdp2"))
    assert sorted(one) == sorted(ddp2) == sorted(fsdp2) == list(range(1, 7))
    assert one[6]["loss"] < one[1]["loss"] - 0.1, (one[1]["loss"], one[6]["loss"])  # it learns
    for step in range(1, 7):
        for other in (ddp2, fsdp2):
            assert close(other[step]["loss"], one[step]["loss"]), (step, other[step]["loss"], one[step]["loss"])
            assert close(other[step]["grad_norm"], one[step]["grad_norm"]), step


@pytest.mark.slow
def test_tied_embeddings_stay_tied_through_fsdp_checkpoints_and_export(runs):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    weights = {k: load_file(str(runs[k] / "final_model" / "model.safetensors")) for k in ("one", "fsdp2")}
    for state in weights.values():
        assert "lm_head.weight" not in state and "model.embed_tokens.weight" in state  # tied: one tensor on disk
    assert weights["one"].keys() == weights["fsdp2"].keys()
    for k, v in weights["one"].items():
        assert torch.allclose(weights["fsdp2"][k], v, atol=1e-5, rtol=0), k
    model = AutoModelForCausalLM.from_pretrained(runs["fsdp2"] / "final_model").eval()
    config = json.loads((runs["fsdp2"] / "final_model" / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    native = build_model(get_model_spec("llama-tiny"), seed=0)
    native.load_state_dict(weights["fsdp2"], strict=False)
    native.tie_weights()
    x = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (model(input_ids=x).logits - native.logits(x)).abs().max().item() <= 1e-5


@pytest.mark.slow
def test_an_fsdp_checkpoint_resumes_on_one_process(runs, tmp_path):
    out = tmp_path / "resumed"
    proc = run(train_cmd(out, runs["data"], *LLAMA, *STEPS, "per_device_train_batch_size=2",
                         "gradient_accumulation_steps=2", extra=("--resume", str(checkpoint(runs["fsdp2"], 3)))),
               runs["env"])
    assert "checkpoint written by 2 processes (fsdp), now 1 (ddp)" in proc.stdout
    rows, expected = train_rows(out), train_rows(runs["one"])
    assert sorted(rows) == [4, 5, 6]
    for step in rows:
        assert close(rows[step]["loss"], expected[step]["loss"]), (step, rows[step], expected[step])


@pytest.mark.slow
def test_init_from_an_hf_llama_directory(runs, tmp_path):
    """A transformers-written Llama directory (loud weights: its loss is far from a fresh model's) starts
    the run; the export is a Llama directory again."""
    spec = get_model_spec("llama-tiny")
    from utils.model.families import family

    fam = family("llama")
    hf = fam.causal_lm_class(spec)(fam.hf_config(spec))
    with torch.no_grad():
        hf.model.norm.weight.fill_(30.0)  # confident, wrong predictions: a loss far above log(512)
    hf.save_pretrained(tmp_path / "hf-llama")
    out = tmp_path / "from-hf"
    proc = run(train_cmd(out, runs["data"], "max_steps=2", "save_steps=2", f"init_from={tmp_path / 'hf-llama'}",
                         "per_device_train_batch_size=2"), runs["env"])
    assert "init_from" in proc.stdout + proc.stderr
    rows = train_rows(out)
    fresh = train_rows(runs["one"])[1]["loss"]
    assert fresh < 7 and rows[1]["loss"] > 20, (fresh, rows[1]["loss"])
    config = json.loads((out / "final_model" / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_key_value_heads"] == 2


@pytest.mark.slow
def test_demo_with_the_llama_preset_learns(tmp_path, subprocess_env):
    out = tmp_path / "out"
    env = {k: v for k, v in subprocess_env.items() if k != "OMP_NUM_THREADS"}
    cmd = [str(REPO_ROOT / "start_training.sh"), "--config", "demo", "--", "--output-dir", str(out),
           "--data-dir", str(tmp_path / "data"), "--set", "model=llama-demo"]
    run(cmd, env, timeout=1500)
    evals = [r for r in metrics(out) if "val_loss" in r]
    first, last = evals[0], evals[-1]
    drop = 1 - last["val_loss"] / first["val_loss"]
    print(f"llama demo: val_loss {first['val_loss']:.3f} -> {last['val_loss']:.3f} ({100 * drop:.1f}% lower)")
    assert first["step"] == 0 and drop >= 0.40, (first, last)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "final_model")
    assert model.config.model_type == "llama" and model.config.vocab_size == 2048
