"""optimizer=muon: torch's Muon for the blocks' matrices + AdamW for the rest, in one optimizer object that
checkpoints and resumes bitwise, and trains alike on 1 process, 2 DDP ranks and 2 FSDP ranks."""
from __future__ import annotations

import math

import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz

from configs import get_model_spec, get_training_config
from configs.profiles import RunShape, memory_plan
from configs.training_config import ConfigError
from tests.trainkit import REPO_ROOT, TINY, load_weights, make_shards, run, train_cmd, train_rows
from utils.model import build_model
from utils.training.optim import OptimizerSettings, build_optimizer
from utils.training.optim.adamw import BF16MomentAdamW
from utils.training.optim.muon import NS_COEFFICIENTS, NS_EPS, NS_STEPS, MuonWithAdamW, muon_parameters, newton_schulz

SPEC = get_model_spec("tiny")


def _batches(n=4):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, SPEC.vocab_size, (2, 16), generator=g) for _ in range(n)]


def _train(model, opt, batches):
    for x in batches:
        model(x).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("scale, adjust_lr_fn", [("moonlight", "match_rms_adamw"), ("original", "original")])
def test_muon_is_torchs_muon_for_block_matrices_and_adamw_for_the_rest(scale, adjust_lr_fn):
    """muon_scale names torch's adjust_lr_fn: moonlight (the default) its match_rms_adamw, original its own."""
    cfg = get_training_config("demo", {"model": "tiny", "optimizer": "muon", "muon_ns_dtype": "bf16",
                                       "muon_scale": scale})
    model = build_model(SPEC, seed=0)
    opt = build_optimizer(model, OptimizerSettings.of(cfg), fused=False)
    assert isinstance(opt, MuonWithAdamW) and opt.ns_dtype == torch.bfloat16
    muon = {id(p) for g in opt.param_groups if g.get("muon") for p in g["params"]}
    names = {n for n, p in model.named_parameters() if id(p) in muon}
    assert names == {n for n, p in model.named_parameters() if ".layers." in n and p.dim() == 2}
    assert len(names) == 4 * SPEC.num_hidden_layers  # qkv, dense, h_to_4h, 4h_to_h per block
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))
    _train(model, opt, _batches())

    ref = build_model(SPEC, seed=0)
    matrices = muon_parameters(ref)
    ids = {id(p) for p in matrices}
    rest = [p for p in ref.parameters() if id(p) not in ids]
    torch_muon = torch.optim.Muon(matrices, lr=cfg.learning_rate, weight_decay=cfg.weight_decay,
                                  momentum=cfg.muon_momentum, adjust_lr_fn=adjust_lr_fn)
    adamw = torch.optim.AdamW([{"params": [p for p in rest if p.dim() >= 2], "weight_decay": cfg.weight_decay},
                               {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}],
                              lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
    for x in _batches():
        ref(x).backward()
        torch_muon.step()
        adamw.step()
        ref.zero_grad(set_to_none=True)
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), name
    with pytest.raises(ConfigError, match="muon_scale='rms'"):
        get_training_config("demo", {"optimizer": "muon", "muon_scale": "rms"})


def test_newton_schulz_precision_follows_the_run_and_fp32_does_not_amplify_last_bit_differences():
    def ns_dtype(**sets):
        return build_optimizer(build_model(SPEC, seed=0), OptimizerSettings.of(get_training_config(
            "demo", {"model": "tiny", "optimizer": "muon", **sets})), fused=False).ns_dtype
    assert ns_dtype(mixed_precision="no") == torch.float32  # auto: fp32 runs
    assert ns_dtype(mixed_precision="bf16") == torch.bfloat16  # auto: mixed precision, torch's bf16
    assert ns_dtype(mixed_precision="bf16", muon_ns_dtype="fp32") == torch.float32
    assert ns_dtype(mixed_precision="no", muon_ns_dtype="bf16") == torch.bfloat16
    with pytest.raises(ConfigError, match="muon_ns_dtype='fp16'"):
        get_training_config("demo", {"optimizer": "muon", "muon_ns_dtype": "fp16"})

    g = torch.randn(256, 192, generator=torch.Generator().manual_seed(0))
    nudged = g * (1 + 2 ** -23 * torch.randn(g.shape, generator=torch.Generator().manual_seed(1)))  # last bits
    args = (NS_COEFFICIENTS, NS_STEPS, NS_EPS)
    kept = g.clone()
    fp32 = newton_schulz(g, *args, dtype=torch.float32)
    assert fp32.dtype == torch.float32 and torch.equal(g, kept)  # on a copy: the momentum buffer is untouched
    assert torch.equal(newton_schulz(g, *args, dtype=torch.bfloat16), _zeropower_via_newtonschulz(g, *args))
    # the same iteration: fp32 and torch's bf16 results agree to bf16's precision
    bf16 = _zeropower_via_newtonschulz(g, *args).float()
    assert (fp32 - bf16).abs().max() < 0.05 * fp32.abs().max()
    # fp32 keeps a last-bit difference in the input small; bf16 rounding flips elements
    fp32_apart = (newton_schulz(nudged, *args, dtype=torch.float32) - fp32).abs().max().item()
    bf16_apart = (_zeropower_via_newtonschulz(nudged, *args).float() - bf16).abs().max().item()
    assert fp32_apart < 1e-5 and bf16_apart > 100 * fp32_apart, (fp32_apart, bf16_apart)


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_state_dict_round_trip_continues_bitwise(state_dtype):
    cfg = get_training_config("demo", {"model": "tiny", "optimizer": "muon", "optimizer_state_dtype": state_dtype})
    batches = _batches(6)
    straight = build_model(SPEC, seed=1)
    opt = build_optimizer(straight, OptimizerSettings.of(cfg), fused=False)
    _train(straight, opt, batches)

    first = build_model(SPEC, seed=1)
    opt1 = build_optimizer(first, OptimizerSettings.of(cfg), fused=False)
    _train(first, opt1, batches[:3])
    saved_model, saved_opt = first.state_dict(), opt1.state_dict()
    second = build_model(SPEC, seed=99)
    second.load_state_dict(saved_model)
    opt2 = build_optimizer(second, OptimizerSettings.of(cfg), fused=False)
    opt2.load_state_dict(saved_opt)
    assert isinstance(opt2.adamw, BF16MomentAdamW) == (state_dtype == "bf16")
    want = torch.bfloat16 if state_dtype == "bf16" else torch.float32
    bufs = [opt2.state[p]["momentum_buffer"] for g in opt2.param_groups if g.get("muon") for p in g["params"]]
    assert bufs and all(b.dtype == want for b in bufs)
    assert opt2.adamw.state is opt2.state and opt2.adamw.param_groups[0] is opt2.param_groups[0]
    _train(second, opt2, batches[3:])
    for (name, a), b in zip(straight.named_parameters(), second.parameters()):
        assert torch.equal(a, b), name


def test_memory_plan_and_describe_count_muon_state():
    spec = get_model_spec("gpt-neox-1.2b")
    adamw, muon = memory_plan(spec), memory_plan(spec, RunShape(optimizer="muon"))
    h, i, L = spec.hidden_size, spec.intermediate_size, spec.num_hidden_layers
    assert math.isclose(adamw.optimizer - muon.optimizer, 4 * L * (4 * h * h + 2 * h * i))  # one buffer, not two
    from utils.run.report import optimizer_state_bytes

    cfg = get_training_config("demo", {"model": "tiny", "optimizer": "muon"})
    model = build_model(SPEC, seed=0)
    weights = sum(p.numel() * 4 for p in model.parameters())
    matrices = sum(p.numel() * 4 for p in muon_parameters(model))
    assert optimizer_state_bytes(model, cfg, weights)[0] == 2 * weights - matrices
    opt = build_optimizer(model, OptimizerSettings.of(cfg), fused=False)
    assert opt.muon_state_bytes() == matrices


def _run_rows(out):
    return train_rows(out)


COMMON = ("per_device_train_batch_size=4", "gradient_accumulation_steps=2", "max_steps=6", "save_steps=3",
          "optimizer=muon", "learning_rate=3e-3")


@pytest.mark.slow
def test_resumed_muon_run_is_bitwise_the_uninterrupted_one_and_another_optimizer_is_refused(tmp_path,
                                                                                            subprocess_env):
    data = make_shards(tmp_path / "data")
    straight, split = tmp_path / "straight", tmp_path / "split"
    run(train_cmd(straight, data, *COMMON), subprocess_env)
    run(train_cmd(split, data, *COMMON, "stop_at_step=3"), subprocess_env)
    refused = run(train_cmd(split, data, *COMMON[:-2], "optimizer=adamw", extra=("--resume", "latest")),
                  subprocess_env, check=False)
    assert refused.returncode == 2
    lines = [line for line in refused.stderr.splitlines() + refused.stdout.splitlines() if "optimizer=muon" in line]
    assert lines and "optimizer=adamw" in lines[0] and "Traceback" not in refused.stderr
    second = run(train_cmd(split, data, *COMMON, extra=("--resume", "latest")), subprocess_env)
    assert "Resumed from" in second.stdout and "at step 3" in second.stdout
    a, b = train_rows(straight), train_rows(split)
    assert sorted(b) == list(range(1, 7))
    for step in range(1, 7):
        assert a[step]["loss"] == b[step]["loss"], (step, a[step]["loss"], b[step]["loss"])
    wa, wb = (load_weights(out / "final_model" / "model.safetensors") for out in (straight, split))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert a[6]["loss"] < a[1]["loss"]


def _launch(out, data, gpus: int, strategy: str, *sets: str, env=None):
    cmd = [str(REPO_ROOT / "start_training.sh"), "--config", "demo", "--cpu", "--gpus", str(gpus),
           "--strategy", strategy, "--", "--output-dir", str(out), "--data-dir", str(data)]
    for s in TINY + list(sets):
        cmd += ["--set", s]
    return run(cmd, env, timeout=600)


def _close(a: float, b: float, rel: float) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-9)


@pytest.mark.slow
def test_muon_on_two_ddp_ranks_equals_one_process_and_two_fsdp_ranks_equal_ddp(tmp_path, subprocess_env):
    """fp32, 6 steps, global batch 4: 1 process, 2 DDP ranks and 2 FSDP ranks (each matrix gathered for
    Newton-Schulz) train alike, 1e-6 relative per step; the FSDP checkpoint resumes on one process.

    The gradients of the three differ in their last fp32 bits (sums in another order: one batch of 4, two of
    2 all-reduced, reduce-scattered). fp32 runs do Newton-Schulz in fp32 (muon_ns_dtype=auto), which keeps
    such differences at fp32's scale; torch's bf16 Newton-Schulz (muon_ns_dtype=bf16) flips elements'
    bf16 rounding (2^-8 relative) and the losses then differ by up to 5e-6 relative."""
    data = make_shards(tmp_path / "data")
    sets = ("max_steps=6", "save_steps=3", "optimizer=muon", "z_loss=1e-4")
    one, ddp, fsdp = tmp_path / "one", tmp_path / "ddp", tmp_path / "fsdp"
    run(train_cmd(one, data, *sets, "per_device_train_batch_size=4"), subprocess_env)
    _launch(ddp, data, 2, "ddp", *sets, "per_device_train_batch_size=2", env=subprocess_env)
    _launch(fsdp, data, 2, "fsdp", *sets, "per_device_train_batch_size=2", env=subprocess_env)
    r1, r2, r3 = train_rows(one), train_rows(ddp), train_rows(fsdp)
    assert sorted(r1) == sorted(r2) == sorted(r3) == list(range(1, 7))
    assert abs(r1[1]["loss"] - r2[1]["loss"]) <= 1e-6 and abs(r2[1]["loss"] - r3[1]["loss"]) <= 1e-6
    for step in range(1, 7):
        assert _close(r1[step]["loss"], r2[step]["loss"], 1e-6), (step, r1[step]["loss"], r2[step]["loss"])
        assert _close(r2[step]["loss"], r3[step]["loss"], 1e-6), (step, r2[step]["loss"], r3[step]["loss"])
        assert r1[step]["z_loss"] > 0 and _close(r1[step]["z_loss"], r3[step]["z_loss"], 1e-6)
    assert r1[6]["loss"] < r1[1]["loss"]
    w1, w2, w3 = (load_weights(out / "final_model" / "model.safetensors") for out in (one, ddp, fsdp))
    demo = get_training_config("demo", {})
    init = build_model(SPEC, seed=demo.seed, init=demo.init).state_dict()  # the runs' starting weights
    init["embed_out.weight"] = init.pop("lm_head.weight")
    flat = lambda w: torch.cat([w[k].flatten() for k in sorted(w1)])  # noqa: E731
    moved = (flat(w1) - flat(init)).norm()
    # the runs' weights differ by a small fraction of how far training moved them (a matrix orthogonalised
    # by shards rather than whole would move it differently: another update altogether)
    apart = [((flat(a) - flat(b)).norm() / moved).item() for a, b in ((w1, w2), (w2, w3))]
    # measured: 3e-4 of the distance moved (AdamW's normalised steps carry the last-bit differences into
    # the embeddings and norms), 1e-3 the bound
    assert moved > 0.1 and max(apart) < 1e-3, (moved, apart)
    # the FSDP run's sharded checkpoint at step 3 resumes on one process, and continues as the FSDP run did
    resumed = tmp_path / "resumed"
    ckpt = next((fsdp / "checkpoints").glob("checkpoint-*-step3-*"))
    run(train_cmd(resumed, data, *sets, "per_device_train_batch_size=4", extra=("--resume", str(ckpt))),
        subprocess_env)
    r4 = train_rows(resumed)
    for step in range(4, 7):
        assert _close(r4[step]["loss"], r3[step]["loss"], 1e-6), (step, r4[step]["loss"], r3[step]["loss"])
