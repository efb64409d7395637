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
