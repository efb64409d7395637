"""The LR schedule and the optimizer's parameter groups."""
import math

import torch

from configs import get_training_config
from utils.model import build_model
from configs import get_model_spec
from utils.optim import build_optimizer, build_scheduler, lr_at, schedule_from_config


def test_lr_at_shape():
    kw = dict(peak_lr=1.0, warmup_steps=10, max_steps=110, min_lr_ratio=0.1)
    assert lr_at(1, **kw) == 0.1 and lr_at(5, **kw) == 0.5 and lr_at(10, **kw) == 1.0
    assert math.isclose(lr_at(60, **kw), 0.55)  # half way through the cosine: (1 + 0.1) / 2
    assert math.isclose(lr_at(110, **kw), 0.1) and math.isclose(lr_at(500, **kw), 0.1)
    values = [lr_at(s, **kw) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_scheduler_follows_lr_at_one_step_per_optimizer_step():
    cfg = get_training_config("demo", {"model": "tiny", "warmup_steps": 3, "max_steps": 12})
    model = torch.nn.Linear(4, 4)
    opt = build_optimizer(model, cfg, fused=False)
    sched = build_scheduler(opt, cfg)
    schedule = schedule_from_config(cfg)
    for step in range(1, 13):
        assert math.isclose(opt.param_groups[0]["lr"], schedule(step), rel_tol=1e-12)
        opt.step()
        sched.step()


def test_weight_decay_only_on_matrices():
    cfg = get_training_config("demo", {"model": "tiny"})
    model = build_model(get_model_spec("tiny"), seed=0)
    opt = build_optimizer(model, cfg, fused=False)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == cfg.weight_decay and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
