"""CUDA-only checks (skipped without a GPU): bf16 + compile training, MFU reported, preflight, and the
conservative profile's memory bound for the 1.2B model."""
from __future__ import annotations

import pytest

from tests.trainkit import make_shards, run, train_cmd, train_rows

pytestmark = pytest.mark.gpu


def test_bf16_compiled_training_reports_mfu(tmp_path, subprocess_env):
    data = make_shards(tmp_path / "data", n_files=4, rows=256, seq_len=64)
    out = tmp_path / "out"
    proc = run(train_cmd(out, data, "mixed_precision=bf16", "compile_model=true", "max_steps=20",
                         "per_device_train_batch_size=8", "logging_steps=10", "save_steps=10"), subprocess_env,
               timeout=900)
    assert "Preflight: 2 forward/backward pass(es) in bf16 precision" in proc.stdout
    rows = train_rows(out)
    assert rows[20]["loss"] < rows[10]["loss"] + 1.0
    import torch

    name = torch.cuda.get_device_name(0)
    if any(k in name for k in ("H100", "H200", "A100")):
        assert rows[20]["mfu"] is not None and rows[20]["mfu"] > 0
    assert rows[20]["peak_mem_gb"] > 0


def test_conservative_profile_fits_22_gib_for_1p2b(tmp_path, subprocess_env):
    """The 24 GB-card profile: 1.2B model, seq 2048, a few optimizer steps, peak allocated <= 22 GiB."""
    data = make_shards(tmp_path / "data", n_files=3, rows=64, seq_len=2048, vocab=50257)
    out = tmp_path / "out"
    run(train_cmd(out, data, "model=gpt-neox-1.2b", "profile=conservative", "mixed_precision=bf16",
                  "compile_model=true", "max_steps=3", "logging_steps=1", "save_steps=1000",
                  "per_device_train_batch_size=4", "gradient_accumulation_steps=4", "preflight_steps=1",
                  "eval_batches=1"), subprocess_env, timeout=1800)
    rows = train_rows(out)
    assert max(r["peak_mem_gb"] for r in rows.values()) <= 22.0


def test_fp8_trains_and_checkpoints_plain_weights_on_hopper(tmp_path, subprocess_env):
    """torchao float8 on a Hopper/Ada GPU: finite losses, a checkpoint of plain fp32 weights, and a resume in
    bf16 from it."""
    import torch

    if torch.cuda.get_device_capability(0) < (8, 9):
        pytest.skip("float8 needs compute capability >= 8.9")
    data = make_shards(tmp_path / "data", n_files=4, rows=256, seq_len=64)
    out = tmp_path / "out"
    proc = run(train_cmd(out, data, "mixed_precision=fp8", "compile_model=true", "max_steps=10",
                         "per_device_train_batch_size=8", "logging_steps=5", "save_steps=5"), subprocess_env,
               timeout=900)
    assert "Linear layers run float8 matmuls" in proc.stdout
    rows = train_rows(out)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows.values())
    from safetensors.torch import load_file

    from utils.checkpoint.format import list_checkpoints

    weights = load_file(str(list_checkpoints(out / "checkpoints")[-1] / "model.safetensors"))
    assert all(t.dtype == torch.float32 for t in weights.values())
    run(train_cmd(out, data, "mixed_precision=bf16", "compile_model=true", "max_steps=12",
                  "per_device_train_batch_size=8", "logging_steps=2", extra=("--resume", "latest")), subprocess_env,
        timeout=900)
    assert max(train_rows(out)) == 12


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_fsdp_on_one_gpu_trains_checkpoints_and_resumes(tmp_path, subprocess_env, precision):
    """strategy=fsdp on one GPU: bf16 parameters with fp32 reduction (and torchao's float8 all-gather under
    fp8), a sharded checkpoint, and a resume from it."""
    import torch

    if precision == "fp8" and torch.cuda.get_device_capability(0) < (8, 9):
        pytest.skip("float8 needs compute capability >= 8.9")
    data = make_shards(tmp_path / "data", n_files=4, rows=256, seq_len=64)
    out = tmp_path / "out"
    sets = ("strategy=fsdp", f"mixed_precision={precision}", "compile_model=true", "per_device_train_batch_size=8",
            "logging_steps=5", "save_steps=5")
    proc = run(train_cmd(out, data, *sets, "max_steps=10"), subprocess_env, timeout=900)
    assert "strategy fsdp, world size 1" in proc.stdout
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in train_rows(out).values())
    run(train_cmd(out, data, *sets, "max_steps=12", extra=("--resume", "latest")), subprocess_env, timeout=900)
    assert max(train_rows(out)) == 12


def test_document_masking_flex_attention_matches_sdpa_with_gradients_compiled():
    """The CUDA path of attention=document: FlexAttention's block mask inside regionally compiled blocks
    gives SDPA's dense-mask loss and gradients (bf16 autocast tolerance)."""
    from dataclasses import replace

    import torch

    from configs import get_model_spec
    from utils.model import build_model

    spec = replace(get_model_spec("tiny"), hidden_size=128, num_attention_heads=4, max_position_embeddings=256)
    ids = torch.randint(1, spec.vocab_size, (2, 256), device="cuda")
    ids[:, ::37] = 0  # EOS every 37 tokens
    grads = []
    for flex in (False, True):
        model = build_model(spec, seed=1).cuda()
        model.use_document_masking(0, position_reset=True, flex=flex)
        model.compile_blocks()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids)
        loss.backward()
        grads.append((loss.detach(), [p.grad.float() for p in model.parameters()]))
    assert torch.allclose(grads[0][0], grads[1][0], rtol=2e-2)
    for a, b in zip(grads[0][1], grads[1][1]):
        assert torch.allclose(a, b, atol=2e-2, rtol=5e-2)
