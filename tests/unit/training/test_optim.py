"""The LR schedule and the optimizer's parameter groups."""
import math

import pytest
import torch

from configs import get_model_spec, get_training_config, training_config
from configs.model_config import ConfigError
from utils.model import build_model
from utils.training import schedules
from utils.training.lr_scheduler import build_scheduler
from utils.training.optim import OptimizerSettings, build_optimizer
from utils.training.schedules import ScheduleSettings, lr_at


def test_lr_at_shape():
    kw = dict(peak_lr=1.0, warmup_steps=10, max_steps=110, min_lr_ratio=0.1)
    assert lr_at(1, **kw) == 0.1 and lr_at(5, **kw) == 0.5 and lr_at(10, **kw) == 1.0
    assert math.isclose(lr_at(60, **kw), 0.55)  # half way through the cosine: (1 + 0.1) / 2
    assert math.isclose(lr_at(110, **kw), 0.1) and math.isclose(lr_at(500, **kw), 0.1)
    values = [lr_at(s, **kw) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_scheduler_follows_lr_at_one_step_per_optimizer_step():
    cfg = get_training_config("demo", {"model": "tiny", "optimizer": "adamw", "warmup_steps": 3, "max_steps": 12})
    model = torch.nn.Linear(4, 4)
    opt = build_optimizer(model, OptimizerSettings.of(cfg), fused=False)
    sched = build_scheduler(opt, ScheduleSettings.of(cfg))
    schedule = ScheduleSettings.of(cfg).lr
    for step in range(1, 13):
        assert math.isclose(opt.param_groups[0]["lr"], schedule(step), rel_tol=1e-12)
        opt.step()
        sched.step()


def test_weight_decay_only_on_matrices():
    cfg = get_training_config("demo", {"model": "tiny", "optimizer": "adamw"})
    model = build_model(get_model_spec("tiny"), seed=0)
    opt = build_optimizer(model, OptimizerSettings.of(cfg), fused=False)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == cfg.weight_decay and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def wsd_formula(step, peak, warmup, max_steps, decay, ratio, shape):
    """WSD written out independently: warmup line, flat peak, then the decay shape down to peak * ratio."""
    if step <= warmup:
        return peak * step / warmup
    start = max_steps - decay
    if step <= start:
        return peak
    t = min(1.0, (step - start) / decay)
    f = {"linear": 1 - t, "cosine": (1 + math.cos(math.pi * t)) / 2, "sqrt": 1 - math.sqrt(t)}[shape]
    return peak * ratio + (peak - peak * ratio) * f


@pytest.mark.parametrize("shape", ["linear", "cosine", "sqrt"])
def test_wsd_follows_its_formula(shape):
    kw = dict(peak_lr=3e-4, warmup_steps=10, max_steps=100, min_lr_ratio=0.1, schedule="wsd", decay_steps=20,
              decay_shape=shape)
    for step in list(range(1, 121)):
        expected = wsd_formula(step, 3e-4, 10, 100, 20, 0.1, shape)
        assert abs(lr_at(step, **kw) - expected) <= 1e-12, (step, lr_at(step, **kw), expected)
    assert lr_at(10, **kw) == 3e-4 and lr_at(50, **kw) == 3e-4 and lr_at(80, **kw) == 3e-4  # warmup end, stable
    assert lr_at(81, **kw) < 3e-4 and math.isclose(lr_at(100, **kw), 3e-5)  # decay starts right after 80
    values = [lr_at(s, **kw) for s in range(80, 101)]
    assert all(a > b for a, b in zip(values, values[1:]))


def test_linear_and_constant_schedules():
    kw = dict(peak_lr=1.0, warmup_steps=10, max_steps=110, min_lr_ratio=0.1)
    assert lr_at(10, schedule="linear", **kw) == 1.0 and math.isclose(lr_at(60, schedule="linear", **kw), 0.55)
    assert (math.isclose(lr_at(110, schedule="linear", **kw), 0.1)
            and math.isclose(lr_at(200, schedule="linear", **kw), 0.1))
    assert lr_at(5, schedule="constant", **kw) == 0.5 and lr_at(110, schedule="constant", **kw) == 1.0


def test_wsd_decay_fraction_and_config_checks():
    cfg = get_training_config("demo", {"model": "tiny", "optimizer": "adamw", "lr_schedule": "wsd", "warmup_steps": 5,
                                       "max_steps": 200, "decay_fraction": 0.25})
    schedule = ScheduleSettings.of(cfg).lr
    assert schedule(150) == cfg.learning_rate and schedule(151) < cfg.learning_rate  # decay: the last 50 steps
    assert math.isclose(schedule(200), cfg.learning_rate * cfg.min_lr_ratio)
    with pytest.raises(ConfigError, match="lr_schedule='wsdd' is not valid"):
        get_training_config("demo", {"lr_schedule": "wsdd"})
    with pytest.raises(ConfigError, match="decay_shape='exp' is not valid"):
        get_training_config("demo", {"decay_shape": "exp"})
    assert training_config.LR_SCHEDULES == tuple(schedules.SCHEDULES)  # the config's choices are the registry


def test_wsd_resume_with_more_steps_extends_the_stable_phase():
    """A run planned for 100 steps (decay over the last 30) resumed at step 60 with max_steps=300: the LR
    stays at the peak until step 270, then decays to the minimum at 300."""
    base = {"model": "tiny", "optimizer": "adamw", "lr_schedule": "wsd", "warmup_steps": 5, "decay_steps": 30}
    short = get_training_config("demo", dict(base, max_steps=100))
    long = get_training_config("demo", dict(base, max_steps=300))
    opt = build_optimizer(torch.nn.Linear(4, 4), OptimizerSettings.of(short), fused=False)
    sched = build_scheduler(opt, ScheduleSettings.of(short))
    for _ in range(60):
        opt.step()
        sched.step()
    saved = sched.state_dict()

    opt2 = build_optimizer(torch.nn.Linear(4, 4), OptimizerSettings.of(long), fused=False)
    opt2.load_state_dict(opt.state_dict())
    sched2 = build_scheduler(opt2, ScheduleSettings.of(long))
    sched2.load_state_dict(saved)
    peak, seen = long.learning_rate, {}
    for step in range(61, 301):
        seen[step] = opt2.param_groups[0]["lr"]
        opt2.step()
        sched2.step()
    assert all(seen[s] == peak for s in range(61, 271))
    for step in range(271, 301):
        assert abs(seen[step] - wsd_formula(step, peak, 5, 300, 30, long.min_lr_ratio, "linear")) <= 1e-12
    assert seen[271] < peak and math.isclose(seen[300], peak * long.min_lr_ratio)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_a_loaded_state_no_run_can_continue_from_is_named(optimizer):
    """state_problem (the Checkpointer runs it on every resume): a `step` that is NaN, inf, negative or not whole,
    a non-finite moment or a negative second moment is said naming the parameter (each made every later update
    NaN, which the run blamed on the learning rate); the state of real steps passes, Muon's bf16 momentum too."""
    from utils.training.optim import state_problem

    cfg = get_training_config("demo", {"model": "tiny", "optimizer": optimizer, "optimizer_state_dtype": "bf16"})
    model = build_model(get_model_spec("tiny"), seed=0)
    opt = build_optimizer(model, OptimizerSettings.of(cfg), fused=False)
    for _ in range(2):
        model(torch.randint(0, 512, (2, 16))).backward()
        opt.step()
    names = {id(p): n for n, p in model.named_parameters()}

    def problem():
        return state_problem((names[id(p)], opt.state.get(p, {})) for g in opt.param_groups for p in g["params"])

    assert problem() is None
    bias = model.gpt_neox.final_layer_norm.bias  # in AdamW's part under Muon too
    state = opt.state[bias]
    saved = {k: v.clone() for k, v in state.items()}
    for step, shown in ((math.nan, "nan"), (math.inf, "inf"), (-3.0, "-3.0"), (2.5, "2.5")):
        state["step"] = torch.tensor(step)
        assert problem() == f"gpt_neox.final_layer_norm.bias's step is {shown}, not a whole number of steps " \
                            f"(at least 0)"
    state["step"] = saved["step"]
    state["exp_avg"][0] = math.nan
    assert problem() == "gpt_neox.final_layer_norm.bias's exp_avg holds a non-finite value (NaN or inf)"
    state["exp_avg"], state["exp_avg_sq"][0] = saved["exp_avg"], -1.0
    assert problem() == "gpt_neox.final_layer_norm.bias's exp_avg_sq holds a negative value (a second moment is a " \
                        "mean of squares)"
