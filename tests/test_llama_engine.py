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
    # its default plan: the length a run trains at unset (8,192 tokens, not 131,072), which fits an 80 GiB GPU
    assert out.returncode == 0 and "weights (fp32)" in out.stdout, out.stdout + out.stderr
    assert "micro-batch 1 x seq_len 8,192 (the training default)" in out.stdout and "fits a 80 GiB GPU" in out.stdout


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
           "--data-dir", str(tmp_path / "data"), "--set", "model=llama-demo", "--set", "max_steps=200"]
    run(cmd, env, timeout=1500)
    evals = [r for r in metrics(out) if "val_loss" in r]
    first, last = evals[0], evals[-1]
    drop = 1 - last["val_loss"] / first["val_loss"]
    print(f"llama demo: val_loss {first['val_loss']:.3f} -> {last['val_loss']:.3f} ({100 * drop:.1f}% lower)")
    # half the demo's 400 steps (the suite's time): 38% lower there (2026-11-26); the full demo's >= 40% is test_demo's
    assert first["step"] == 0 and last["step"] == 200 and drop >= 0.33, (first, last)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "final_model")
    assert model.config.model_type == "llama" and model.config.vocab_size == 2048


@pytest.mark.slow
def test_regional_compile_changes_nothing():
    x = torch.randint(0, SPEC.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    grads = []
    for compiled in (False, True):
        model = build_model(SPEC, seed=4)
        if compiled:
            model.compile_blocks()
        model(x).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], atol=1e-6, rtol=1e-4), name


@pytest.mark.slow
def test_fp8_with_document_attention_trains_a_llama(runs, tmp_path):
    """torchao's float8 training (emulated on the CPU) converts the Llama's Linear layers, with attention=document."""
    pytest.importorskip("torchao")
    out = tmp_path / "fp8"
    proc = run(train_cmd(out, runs["data"], *LLAMA, "mixed_precision=fp8", "attention=document", "eos_id=0", "max_steps=2",
                         "save_steps=2", "preflight_steps=0", "per_device_train_batch_size=2"),
               runs["env"] | {"NEOX_FP8_EMULATE": "1"})
    import re

    assert re.search(r"fp8: 14 Linear layers run float8 matmuls", proc.stdout), proc.stdout[-2000:]  # 2 x (4 + 3)
    assert "attention: document" in proc.stdout
    assert all(math.isfinite(r["loss"]) for r in train_rows(out).values())


@pytest.mark.slow
def test_a_checkpoint_of_the_engine_before_the_seam_resumes_bitwise(tmp_path, subprocess_env):
    """A GPT-NeoX run of the engine before the model seam (5d01e6f), stopped at step 2 and resumed by
    today's: steps 3-4 and the exported weights are bit for bit those of the old engine's uninterrupted run."""
    import sys

    from safetensors.torch import load_file

    from tests.trainkit import engine_at

    old = engine_at("5d01e6f", tmp_path / "old-engine")
    data = make_shards(tmp_path / "data")
    sets = ["per_device_train_batch_size=4", "save_steps=2"]
    old_env = dict(subprocess_env, PYTHONPATH=str(old))
    out, straight = tmp_path / "out", tmp_path / "straight"
    run([sys.executable, str(old / "train.py")] + train_cmd(out, data, *sets, "max_steps=2")[2:], old_env)
    proc = run(train_cmd(out, data, *sets, "max_steps=4", extra=("--resume", "latest")), subprocess_env)
    assert "Resumed from" in proc.stdout and "at step 2" in proc.stdout
    run([sys.executable, str(old / "train.py")] + train_cmd(straight, data, *sets, "max_steps=4")[2:], old_env)
    resumed, reference = train_rows(out), train_rows(straight)
    for step in (3, 4):
        assert resumed[step]["loss"] == reference[step]["loss"], (step, resumed[step], reference[step])
    a = load_file(str(out / "final_model" / "model.safetensors"))
    b = load_file(str(straight / "final_model" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_evaluate_py_equals_lm_evaluation_harness_on_an_exported_llama(tmp_path, subprocess_env):
    """lm-eval's CLI (`--model hf`) and scripts/evaluate.py on the same exported toy Llama: equal acc and
    acc_norm, each log-likelihood within 1e-4."""
    import random
    import sys

    from tests.test_evals import sentence, train_briefly
    from utils.data.demo import read_stdlib_corpus, train_tokenizer
    from utils.evals.demo_task import build_next_line_task
    from utils.model.hf import export_hf

    (tmp_path / "tokenizer").mkdir()
    tokenizer = train_tokenizer(read_stdlib_corpus(300_000)[1], 512)
    tokenizer.save(str(tmp_path / "tokenizer" / "tokenizer.json"))
    spec = replace(get_model_spec("llama-tiny"), max_position_embeddings=128)
    rng = random.Random(0)
    model = train_briefly(build_model(spec, seed=0), tokenizer, [sentence(rng, 5, 30) + "." for _ in range(3000)])
    export_hf(model.state_dict(), spec, tmp_path / "model", tokenizer=tmp_path / "tokenizer")
    task = tmp_path / "next_line.jsonl"
    build_next_line_task(task, count=40)
    yamls = tmp_path / "lm_eval_tasks"
    yamls.mkdir()
    (yamls / "next_line.yaml").write_text(
        f"task: toy_next_line\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {task}\n"
        f"test_split: test\noutput_type: multiple_choice\ndoc_to_text: \"{{{{context}}}}\"\ndoc_to_choice: choices\n"
        f"doc_to_target: gold\ntarget_delimiter: \"\"\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    env = subprocess_env | {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                            "HF_HOME": str(tmp_path / "hf_home"), "HF_DATASETS_CACHE": str(tmp_path / "hf_datasets")}
    run([str(Path(sys.executable).parent / "lm_eval"), "run", "--model", "hf", "--model_args",
         f"pretrained={tmp_path / 'model'},dtype=float32", "--tasks", "toy_next_line", "--include_path", str(yamls),
         "--device", "cpu", "--batch_size", "16", "--log_samples", "--output_path", str(tmp_path / "lm_eval_out")],
        env, timeout=600)
    results = json.loads(next((tmp_path / "lm_eval_out").rglob("results_*.json")).read_text())["results"]
    rows = sorted((json.loads(line) for line in
                   next((tmp_path / "lm_eval_out").rglob("samples_toy_next_line_*.jsonl")).read_text().splitlines()),
                  key=lambda r: r["doc_id"])
    theirs = [[float(resp[0]) for resp in row["filtered_resps"]] for row in rows]
    evaluated = run([sys.executable, str(REPO_ROOT / "scripts" / "evaluate.py"), str(tmp_path / "model"), "--json",
                     "--batch-size", "7", "--samples", str(tmp_path / "samples.jsonl"), f"--task=next_line={task}"],
                    subprocess_env)
    ours = json.loads(evaluated.stdout)["next_line"]
    mine = [json.loads(line)["loglikelihoods"] for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(mine) == len(theirs) == ours["examples"] == 40
    worst = max(abs(a - b) for m, t in zip(mine, theirs) for a, b in zip(m, t))
    assert worst < 1e-4, worst
    for metric in ("acc", "acc_norm"):
        assert ours[metric] == results["toy_next_line"][f"{metric},none"], metric


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
    fam.causal_lm_class(spec)(fam.hf_config(spec)).save_pretrained(tmp_path / "llama-131k")
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
