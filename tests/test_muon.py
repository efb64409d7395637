"""optimizer=muon: torch's Muon for the blocks' matrices + AdamW for the rest, in one optimizer object that
checkpoints and resumes bitwise, and trains alike on 1 process, 2 DDP ranks and 2 FSDP ranks."""
from __future__ import annotations

import math

import pytest
import torch

from configs import get_model_spec, get_training_config
from configs.profiles import memory_plan
from tests.trainkit import REPO_ROOT, TINY, load_weights, make_shards, run, train_cmd, train_rows
from utils.model import build_model
from utils.muon import MuonWithAdamW, muon_parameters
from utils.optim import BF16MomentAdamW, build_optimizer

SPEC = get_model_spec("tiny")


def _batches(n=4):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, SPEC.vocab_size, (2, 16), generator=g) for _ in range(n)]


def _train(model, opt, batches):
    for x in batches:
        model(x).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_muon_is_torchs_muon_for_block_matrices_and_adamw_for_the_rest():
    cfg = get_training_config("demo", {"model": "tiny", "optimizer": "muon"})
    model = build_model(SPEC, seed=0)
    opt = build_optimizer(model, cfg, fused=False)
    assert isinstance(opt, MuonWithAdamW)
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
                                  momentum=cfg.muon_momentum, adjust_lr_fn="match_rms_adamw")
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


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_state_dict_round_trip_continues_bitwise(state_dtype):
    cfg = get_training_config("demo", {"model": "tiny", "optimizer": "muon", "optimizer_state_dtype": state_dtype})
    batches = _batches(6)
    straight = build_model(SPEC, seed=1)
    opt = build_optimizer(straight, cfg, fused=False)
    _train(straight, opt, batches)

    first = build_model(SPEC, seed=1)
    opt1 = build_optimizer(first, cfg, fused=False)
    _train(first, opt1, batches[:3])
    saved_model, saved_opt = first.state_dict(), opt1.state_dict()
    second = build_model(SPEC, seed=99)
    second.load_state_dict(saved_model)
    opt2 = build_optimizer(second, cfg, fused=False)
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
    adamw, muon = memory_plan(spec), memory_plan(spec, optimizer="muon")
    h, i, L = spec.hidden_size, spec.intermediate_size, spec.num_hidden_layers
    assert math.isclose(adamw.optimizer - muon.optimizer, 4 * L * (4 * h * h + 2 * h * i))  # one buffer, not two
    from utils.run_report import optimizer_state_bytes

    cfg = get_training_config("demo", {"model": "tiny", "optimizer": "muon"})
    model = build_model(SPEC, seed=0)
    weights = sum(p.numel() * 4 for p in model.parameters())
    matrices = sum(p.numel() * 4 for p in muon_parameters(model))
    assert optimizer_state_bytes(model, cfg, weights)[0] == 2 * weights - matrices
    opt = build_optimizer(model, cfg, fused=False)
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
    Newton-Schulz) train alike; the FSDP checkpoint resumes on one process.

    Step 1 (the same weights) agrees within 1e-6. After it, the gradients of the three differ in their last
    fp32 bits (sums in another order: one batch of 4, two of 2 all-reduced, reduce-scattered), and torch's
    Newton-Schulz rounds its input to bfloat16, so such a difference can flip an element's bf16 rounding
    (2^-8 relative): measured, the losses then differ by up to 5e-6 relative (AdamW's in tests/test_fsdp.py:
    under 1e-5). The bound here is 2e-5 relative per step, and 2% of the distance training moved the weights
    for the final weights."""
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
        assert _close(r1[step]["loss"], r2[step]["loss"], 2e-5), (step, r1[step]["loss"], r2[step]["loss"])
        assert _close(r2[step]["loss"], r3[step]["loss"], 2e-5), (step, r2[step]["loss"], r3[step]["loss"])
        assert r1[step]["z_loss"] > 0 and _close(r1[step]["z_loss"], r3[step]["z_loss"], 2e-5)
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
    assert moved > 0.1 and max(apart) < 0.02, (moved, apart)
    # the FSDP run's sharded checkpoint at step 3 resumes on one process, and continues as the FSDP run did
    resumed = tmp_path / "resumed"
    ckpt = next((fsdp / "checkpoints").glob("checkpoint-*-step3-*"))
    run(train_cmd(resumed, data, *sets, "per_device_train_batch_size=4", extra=("--resume", str(ckpt))),
        subprocess_env)
    r4 = train_rows(resumed)
    for step in range(4, 7):
        assert _close(r4[step]["loss"], r3[step]["loss"], 2e-5), (step, r4[step]["loss"], r3[step]["loss"])
