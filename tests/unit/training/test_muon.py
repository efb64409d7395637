"""optimizer=muon: torch's Muon for the blocks' matrices + AdamW for the rest, in one optimizer object that
checkpoints and resumes bitwise; across ranks each rank orthogonalises its share of the matrices and every rank
gets the update one process would have made, so 1 process, DDP and FSDP ranks train alike."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz

from configs import get_model_spec, get_training_config
from configs.profiles import RunShape, memory_plan
from configs.training_config import ConfigError
from tests.conftest import free_port
from tests.trainkit import REPO_ROOT, TINY, load_weights, make_shards, run, train_cmd, train_rows
from utils.model import build_model
from utils.model.families import family_of
from utils.training.optim import OptimizerSettings, build_optimizer
from utils.training.optim.adamw import BF16MomentAdamW
from utils.training.optim.muon import NS_COEFFICIENTS, NS_EPS, NS_STEPS, MuonWithAdamW, muon_parameters, newton_schulz
from utils.training.optim.muon_ranks import assign_by_cost, buckets_of, newton_schulz_flops

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


def test_matrices_go_to_ranks_balanced_by_newton_schulz_cost_in_buckets_of_rounds():
    spec = get_model_spec("gpt-neox-1.2b")
    shapes = [shape for _ in range(spec.num_hidden_layers) for shape in family_of(spec).muon_matrices(spec).values()]
    costs = [newton_schulz_flops(shape) for shape in shapes]
    assert sum(costs) == pytest.approx(5.8e13, rel=0.01)  # the figure for the 1.2B
    m, n = 2048, 8192  # the MLP's matrices: 5 steps of X X^T (2 m^2 n), its square (2 m^3), times X (2 m^2 n)
    assert newton_schulz_flops((n, m)) == newton_schulz_flops((m, n)) == 5 * (4 * m * m * n + 2 * m ** 3)
    for world in (2, 4, 8):
        owners = assign_by_cost(costs, world)
        assert owners == assign_by_cost(costs, world)  # every rank works it out alike
        load = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(world)]
        assert max(load) <= 1.02 * sum(costs) / world, (world, load)  # 96 matrices of 3 sizes: near even
    owners = assign_by_cost(costs, 8)
    sizes = [a * b for a, b in shapes]
    big = buckets_of(owners, costs, sizes, 8, limit=2**24)
    assert all(sum(map(len, bucket)) == 8 for bucket in big)  # a round a bucket: 8 x 16.8M values > 2^24
    assert sorted(i for bucket in big for matrices in bucket for i in matrices) == list(range(len(shapes)))
    for bucket in big:  # each rank's matrix of a round is its own; the round's matrices alike in cost
        assert [owners[i] for matrices in bucket for i in matrices] == list(range(8))
        assert len({costs[i] for matrices in bucket for i in matrices}) == 1
    (one,) = buckets_of(owners, costs, sizes, 8, limit=10**12)  # small matrices: one bucket, two collectives
    assert [sorted(matrices) for matrices in one] == [sorted(i for i, o in enumerate(owners) if o == r)
                                                      for r in range(8)]
    assert assign_by_cost([5, 1], 4) == [0, 1] and buckets_of([0, 1], [5, 1], [1, 1], 4, 10) == [[[0], [1], [], []]]


def _ranks_step_as_one_process(out: str) -> None:
    """One rank of test_each_rank_orthogonalises_its_share_and_its_update_is_one_process_s (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT in the environment): FSDP2 and DDP models on this rank's batches, each with a
    model stepped by one process's Muon (the same optimizer without ranks) on the very gradients the ranks
    step on; what each rank found goes to `out`.rank.json."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import utils.training.optim.muon as muon
    import utils.training.optim.muon_ranks as muon_ranks
    from utils.training.optim import spread_over_replicas

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    calls = []
    orthogonalise = muon.newton_schulz

    def counted(update, *args):
        calls.append(tuple(update.shape))
        return orthogonalise(update, *args)

    muon.newton_schulz = counted
    found = {}
    for strategy, sets, bucket in (("fsdp", {"muon_ns_dtype": "bf16", "optimizer_state_dtype": "bf16",
                                             "cautious_weight_decay": True}, muon_ranks.BUCKET_VALUES),
                                   ("ddp", {}, 1)):  # DDP: a bucket a round
        muon_ranks.BUCKET_VALUES = bucket
        settings = OptimizerSettings.of(get_training_config("demo", {"model": "tiny", "optimizer": "muon", **sets}))
        model, alone = build_model(SPEC, seed=0), build_model(SPEC, seed=0)
        if strategy == "fsdp":
            mesh = init_device_mesh("cpu", (world,))
            for block in model.blocks():
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        opt, opt_alone = build_optimizer(model, settings, False), build_optimizer(alone, settings, False)
        if strategy == "ddp":
            spread_over_replicas(opt)
        calls.clear()
        g = torch.Generator().manual_seed(rank)
        for _ in range(3):
            model(torch.randint(0, SPEC.vocab_size, (2, 16), generator=g)).backward()
            for p, q in zip(model.parameters(), alone.parameters()):
                if strategy == "ddp":
                    dist.all_reduce(p.grad)
                q.grad = p.grad.full_tensor() if strategy == "fsdp" else p.grad.clone()
            ranks_calls = len(calls)
            opt_alone.step()
            del calls[ranks_calls:]  # one process's own orthogonalisations are not the ranks'
            opt.step()
            opt.zero_grad(set_to_none=True)
            opt_alone.zero_grad(set_to_none=True)
        whole = {n: p.full_tensor() if strategy == "fsdp" else p for n, p in model.named_parameters()}
        found[strategy] = {"differ": [n for n, q in alone.named_parameters() if not torch.equal(whole[n], q)],
                           "calls": calls[:], "flops": opt.newton_schulz_flops(),
                           "moved": sum((whole[n] - p).abs().sum().item() for n, p in
                                        build_model(SPEC, seed=0).named_parameters())}
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(found, f)


@pytest.mark.slow
def test_each_rank_orthogonalises_its_share_and_its_update_is_one_process_s(tmp_path, subprocess_env):
    """3 gloo ranks (64-row matrices split 22, 21, 21), 3 steps: under FSDP2 (torch's bf16 Newton-Schulz, bf16
    momentum, cautious decay; the matrices in one bucket) and DDP (fp32; a bucket a round) every weight equals,
    bit for bit, that of one process stepping on the same gradients, and each rank orthogonalised only the
    matrices it owns, each matrix once, the ranks' Newton-Schulz FLOPs within the costliest matrix's."""
    world, out = 3, tmp_path / "rank"
    env = dict(subprocess_env, WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    code = f"from tests.unit.training.test_muon import _ranks_step_as_one_process as main; main({str(out)!r})"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=dict(env, RANK=str(r)), cwd=REPO_ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-4000:]
    found = [json.loads(open(f"{out}.{r}.json").read()) for r in range(world)]
    model = build_model(SPEC, seed=0)
    shapes = [tuple(p.shape) for p in muon_parameters(model)]
    costs = [newton_schulz_flops(s) for s in shapes]
    for strategy in ("fsdp", "ddp"):
        assert all(f[strategy]["differ"] == [] for f in found), [f[strategy]["differ"] for f in found]
        assert found[0][strategy]["moved"] > 0.1  # the steps moved the weights
        calls = [[tuple(c) for c in f[strategy]["calls"]] for f in found]
        assert sorted(c for rank in calls for c in rank) == sorted(shapes * 3), calls  # each matrix once a step
        load = [sum(newton_schulz_flops(c) for c in rank) // 3 for rank in calls]
        assert load == found[0][strategy]["flops"] and sum(load) == sum(costs)
        assert max(load) - min(load) <= max(costs), load


def test_memory_plan_and_describe_count_muon_state():
    spec = get_model_spec("gpt-neox-1.2b")
    adamw, muon = memory_plan(spec), memory_plan(spec, RunShape(optimizer="muon"))
    h, i, L = spec.hidden_size, spec.intermediate_size, spec.num_hidden_layers
    assert math.isclose(adamw.optimizer - muon.optimizer, 4 * L * (4 * h * h + 2 * h * i))  # one buffer, not two
    # what its step holds besides (bf16 Newton-Schulz), the MLP's h x i matrices the largest: one process, its fp32
    # update and Newton-Schulz's workspace; 8 DDP ranks, every result of a round (8 matrices) besides; 8 FSDP
    # ranks, 1/8 of a round's rows (fp32 and a bf16 copy, and as many back) and its own matrix thrice
    v, workspace = h * i, 2 * (2 * h * i + 2 * h * h)
    assert adamw.muon_step == 0 and muon.muon_step == 4 * v + workspace
    assert memory_plan(spec, RunShape("ddp", 8, optimizer="muon")).muon_step == 4 * v + 2 * 8 * v + workspace
    assert memory_plan(spec, RunShape("fsdp", 8, optimizer="muon")).muon_step == 8 * v + 6 * v + workspace
    assert math.isclose(muon.total - adamw.total, muon.muon_step - (adamw.optimizer - muon.optimizer))
    out = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "memory_plan.py"), "--optimizer", "muon",
                          "--strategy", "fsdp", "--world-size", "8"], capture_output=True, text=True, cwd=REPO_ROOT)
    assert out.returncode == 0 and "muon state in fp32" in out.stdout and "Muon's step" in out.stdout, out.stdout
    assert "Muon's Newton-Schulz: 57,724 GFLOP a step, 7,216 on the busiest of 8 rank(s)" in out.stdout, out.stdout
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
def test_muon_on_ddp_and_fsdp_ranks_follows_one_process(tmp_path, subprocess_env):
    """fp32, 8 steps, global batch 4: 1 process, 2 DDP ranks, 2 and 4 FSDP ranks (each rank orthogonalising its
    share of the matrices, which the runs' first lines state) train alike, 1e-6 relative per step (the issue
    asks 1e-5); the 2 FSDP ranks' checkpoint resumes on one process and continues as they did.

    The gradients of the runs differ in their last fp32 bits (sums in another order: one batch of 4, two of 2
    all-reduced or reduce-scattered, four of 1). fp32 runs do Newton-Schulz in fp32 (muon_ns_dtype=auto), which
    keeps such differences at fp32's scale; torch's bf16 Newton-Schulz (muon_ns_dtype=bf16) flips elements'
    bf16 rounding (2^-8 relative) and the losses then differ by up to 5e-6 relative."""
    data = make_shards(tmp_path / "data")
    sets = ("max_steps=8", "save_steps=4", "optimizer=muon", "z_loss=1e-4")
    one, ddp, fsdp, fsdp4 = tmp_path / "one", tmp_path / "ddp", tmp_path / "fsdp", tmp_path / "fsdp4"
    run(train_cmd(one, data, *sets, "per_device_train_batch_size=4"), subprocess_env)
    _launch(ddp, data, 2, "ddp", *sets, "per_device_train_batch_size=2", env=subprocess_env)
    _launch(fsdp, data, 2, "fsdp", *sets, "per_device_train_batch_size=2", env=subprocess_env)
    _launch(fsdp4, data, 4, "fsdp", *sets, "per_device_train_batch_size=1", env=subprocess_env)
    rows = {out.name: train_rows(out) for out in (one, ddp, fsdp, fsdp4)}
    r1 = rows["one"]
    assert all(sorted(r) == list(range(1, 9)) for r in rows.values())
    for name, r in rows.items():
        for step in range(1, 9):
            assert _close(r1[step]["loss"], r[step]["loss"], 1e-6), (name, step, r1[step]["loss"], r[step]["loss"])
            assert r[step]["z_loss"] > 0 and _close(r1[step]["z_loss"], r[step]["z_loss"], 1e-6), (name, step)
    assert r1[8]["loss"] < r1[1]["loss"]
    # the runs' first lines: Newton-Schulz's FLOPs a step, and each rank's share of them
    total = SPEC.num_hidden_layers * sum(newton_schulz_flops(s) for s in family_of(SPEC).muon_matrices(SPEC).values())
    for out, world in ((one, 1), (ddp, 2), (fsdp, 2), (fsdp4, 4)):
        line = next(x for x in (out / "logs" / "training.log").read_text().splitlines() if "Newton-Schulz" in x)
        shares = [float(x) for x in line.split(": ")[-1].removesuffix(" GFLOP").split(", ")] if world > 1 else []
        assert f"Newton-Schulz {total / 1e9:.4g} GFLOP a step" in line, line
        assert ("all on this process" in line) if world == 1 else (
            len(shares) == world and abs(sum(shares) * 1e9 - total) < 1e-3 * total), line
    w1, w2, w3, w4 = (load_weights(out / "final_model" / "model.safetensors") for out in (one, ddp, fsdp, fsdp4))
    demo = get_training_config("demo", {})
    init = build_model(SPEC, seed=demo.seed, init=demo.init).state_dict()  # the runs' starting weights
    init["embed_out.weight"] = init.pop("lm_head.weight")
    flat = lambda w: torch.cat([w[k].flatten() for k in sorted(w1)])  # noqa: E731
    moved = (flat(w1) - flat(init)).norm()
    # the runs' weights differ by a small fraction of how far training moved them (a matrix orthogonalised
    # by shards rather than whole would move it differently: another update altogether)
    apart = [((flat(w1) - flat(w)).norm() / moved).item() for w in (w2, w3, w4)]
    # measured: 3e-4 of the distance moved (AdamW's normalised steps carry the last-bit differences into
    # the embeddings and norms), 1e-3 the bound
    assert moved > 0.1 and max(apart) < 1e-3, (moved, apart)
    # the 2 FSDP ranks' sharded checkpoint at step 4 resumes on one process, and continues as they did
    resumed = tmp_path / "resumed"
    ckpt = next((fsdp / "checkpoints").glob("checkpoint-*-step4-*"))
    run(train_cmd(resumed, data, *sets, "per_device_train_batch_size=4", extra=("--resume", str(ckpt))),
        subprocess_env)
    r3, r4 = rows["fsdp"], train_rows(resumed)
    for step in range(5, 9):
        assert _close(r4[step]["loss"], r3[step]["loss"], 1e-6), (step, r4[step]["loss"], r3[step]["loss"])
