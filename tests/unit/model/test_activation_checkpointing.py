"""Activation checkpointing policies (utils/model/activation_checkpointing.py), applied by the parallelism
seam: every policy gives `none`'s gradients (one process, and 2 real processes under DDP and FSDP through
`make_parallelism`), keeps less activation memory in the order full < every_k < selective < none, and
the memory plan counts them in the same order."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from dataclasses import replace

import pytest
import torch

from configs import get_model_spec
from configs.training_config import ACTIVATION_CHECKPOINTING
from tests.conftest import REPO_ROOT, free_port, make_subprocess_env
from utils.model import build_model
from utils.model.activation_checkpointing import (
    CheckpointingSettings,
    apply_activation_checkpointing,
    parameter_fqn,
    saved_activation_bytes,
)

SPEC = replace(get_model_spec("tiny"), num_hidden_layers=4)


def grads_and_bytes(policy: str, impl: str = "native", compiled: bool = False):
    model = build_model(SPEC, seed=3, impl=impl)
    wrapped = apply_activation_checkpointing(model, policy, every=2)
    if compiled:
        model.compile_blocks()
    x = torch.randint(0, SPEC.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    kept = saved_activation_bytes(model, x)  # runs the backward too
    return wrapped, kept, {parameter_fqn(n): p.grad.clone() for n, p in model.named_parameters()}


def assert_same_grads(a: dict, b: dict, atol: float = 1e-6):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name], b[name], atol=atol, rtol=0), name


@pytest.mark.parametrize("impl", ["native", "hf"])
def test_every_policy_gives_the_gradients_of_none_and_keeps_less(impl):
    results = {p: grads_and_bytes(p, impl) for p in ACTIVATION_CHECKPOINTING}
    assert [results[p][0] for p in ("none", "full", "every_k", "selective")] == [0, 4, 2, 4]  # blocks wrapped
    for policy in ACTIVATION_CHECKPOINTING:
        assert_same_grads(results["none"][2], results[policy][2])
    kept = {p: r[1] for p, r in results.items()}
    assert kept["full"] < kept["every_k"] < kept["none"] and kept["full"] < kept["selective"] < kept["none"], kept


def test_state_dict_names_and_loading_are_unchanged_by_the_wrapper():
    plain, wrapped = build_model(SPEC, seed=3), build_model(SPEC, seed=4)
    apply_activation_checkpointing(wrapped, "selective")
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    wrapped.load_state_dict(plain.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(wrapped.state_dict().values(), plain.state_dict().values()))


def test_regional_compile_with_selective_checkpointing_changes_nothing():
    _, _, eager = grads_and_bytes("none")
    _, _, compiled = grads_and_bytes("selective", compiled=True)
    assert_same_grads(eager, compiled, atol=1e-5)  # compiled kernels may round differently


def test_gradient_checkpointing_true_still_means_full():
    from configs import get_training_config

    assert CheckpointingSettings.of(get_training_config("demo", {"gradient_checkpointing": True})).policy[0] == "full"
    cfg = get_training_config("demo", {"activation_checkpointing": "every_k", "activation_checkpointing_every": 3})
    assert CheckpointingSettings.of(cfg).policy == ("every_k", 3)


def test_memory_plan_counts_the_policies_in_order():
    from configs.profiles import RunShape, memory_plan

    spec = get_model_spec("gpt-neox-1.2b")
    plans = {p: memory_plan(spec, RunShape(micro_batch=4, checkpointing=p)).activations
             for p in ACTIVATION_CHECKPOINTING}
    assert plans["full"] < plans["every_k"] < plans["none"] and plans["full"] < plans["selective"] < plans["none"]
    out = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "memory_plan.py"),
                          "--activation-checkpointing", "selective"], capture_output=True, text=True)
    assert out.returncode == 0 and "activation checkpointing selective" in out.stdout


WORKER = textwrap.dedent('''
    import json, sys
    import torch
    from accelerate import Accelerator
    from configs import get_training_config
    from configs.model_config import get_model_spec
    from dataclasses import replace
    from utils.model.activation_checkpointing import parameter_fqn
    from utils.training.optim import OptimizerSettings, build_optimizer
    from utils.parallel.strategies import ParallelSettings, make_parallelism

    class Log:
        def info(self, msg): pass

    strategy, out = sys.argv[1], sys.argv[2]
    spec = replace(get_model_spec("tiny"), num_hidden_layers=4)
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    results = {}
    for policy in ("none", "full", "every_k", "selective"):
        cfg = get_training_config("demo", {"model": "tiny", "strategy": strategy, "mixed_precision": "no",
                                           "compile_model": False, "activation_checkpointing": policy})
        parallel = make_parallelism(ParallelSettings.of(cfg), accelerator)
        model = parallel.build_model(spec, None, Log())
        model, _ = parallel.prepare(model, build_optimizer(model, OptimizerSettings.of(cfg), fused=False))
        x = torch.randint(0, spec.vocab_size, (2, 32), generator=torch.Generator().manual_seed(10 + rank))
        accelerator.backward(model(x))
        grads = {}
        for name, p in accelerator.unwrap_model(model).named_parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[parameter_fqn(name)] = g.flatten().tolist()
        results[policy] = grads
    if rank == 0:
        json.dump(results, open(out, "w"))
''')


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_policies_give_the_same_gradients_on_two_processes(strategy, tmp_path):
    script, out = tmp_path / "worker.py", tmp_path / "grads.json"
    script.write_text(WORKER)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), str(script), strategy, str(out)],
                          env=make_subprocess_env(), capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {p: {k: torch.tensor(v) for k, v in g.items()} for p, g in json.loads(out.read_text()).items()}
    assert set(results) == set(ACTIVATION_CHECKPOINTING)
    for _policy, grads in results.items():
        assert_same_grads(results["none"], grads)
    assert any(g.abs().sum() > 0 for g in results["none"].values())
