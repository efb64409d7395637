"""Memory profiles, the bf16-moment AdamW they use, and the precision preflight."""
import pytest
import torch

from configs import ConfigError, get_model_spec, get_training_config
from configs.profiles import PROFILES, apply_profile, choose_profile, resolve_profile
from utils.model import build_model
from utils.model.preflight import preflight_problem
from utils.training.optim.adamw import BF16MomentAdamW


@pytest.mark.parametrize("gib, name", [(23.6, "conservative"), (39.4, "balanced"), (79.1, "aggressive"),
                                       (139.8, "aggressive"), (11.0, "conservative")])
def test_auto_choice_by_device_memory(gib, name):
    assert choose_profile(gib).name == name


def test_profiles_keep_the_per_process_batch():
    cfg = get_training_config("production")  # micro 4 x accumulation 4
    for profile in PROFILES.values():
        out = apply_profile(cfg, profile)
        assert out.per_device_train_batch_size * out.gradient_accumulation_steps == 16
        assert out.activation_checkpointing == profile.activation_checkpointing
    assert apply_profile(cfg, PROFILES["conservative"]).optimizer_state_dtype == "bf16"


@pytest.mark.parametrize("model, length", [("llama-3.2-1b", 8192), ("qwen2.5-0.5b", 8192), ("qwen2.5-1.5b", 8192),
                                           ("smollm2-135m", 8192), ("gpt-neox-1.2b", 2048), ("demo", 128)])
def test_a_run_and_the_memory_plan_take_one_default_length(model, length):
    """seq_len unset: the model's positions, at most 8,192 (Llama 3.2: its 8,192-token context before rope
    scaling, of 131,072 positions; Qwen2.5: 32,768 and 131,072 capped); the memory plan counts the same."""
    from configs.profiles import RunShape, memory_plan

    spec = get_model_spec(model)
    assert get_training_config("demo", {"model": model}).seq_len_for(spec) == length
    assert memory_plan(spec) == memory_plan(spec, RunShape(seq_len=length))


def test_the_default_length_is_a_model_s_context_before_rope_scaling():
    from dataclasses import replace

    spec = replace(get_model_spec("llama-3.2-1b"), rope_scaling=(8.0, 1.0, 4.0, 4096))
    assert get_training_config("demo").seq_len_for(spec) == 4096
    assert get_training_config("demo", {"model": "llama-3.2-1b", "seq_len": 16384}).seq_len_for(spec) == 16384


def test_auto_is_a_no_op_on_cpu_and_off_keeps_config():
    cfg = get_training_config("production")
    assert resolve_profile(cfg, "cpu", None) == (cfg, None)
    off = get_training_config("production", {"profile": "off"})
    assert resolve_profile(off, "cuda", 80.0) == (off, None)
    out, profile = resolve_profile(cfg, "cuda", 23.5)
    assert profile.name == "conservative" and out.per_device_train_batch_size == 2


def test_profile_that_cannot_divide_the_batch_is_a_clear_error():
    cfg = get_training_config("production", {"per_device_train_batch_size": 3, "gradient_accumulation_steps": 3})
    with pytest.raises(ConfigError, match="does not divide the per-process batch 9"):
        apply_profile(cfg, PROFILES["conservative"])


def test_bf16_moment_adamw_tracks_torch_adamw():
    torch.manual_seed(0)
    a = build_model(get_model_spec("tiny"), seed=0)
    b = build_model(get_model_spec("tiny"), seed=0)
    opt_a = torch.optim.AdamW(a.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    opt_b = BF16MomentAdamW(b.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    ids = torch.randint(0, 512, (4, 32))
    for _ in range(5):
        for model, opt in ((a, opt_a), (b, opt_b)):
            model(ids).backward()
            opt.step()
            opt.zero_grad()
    init = build_model(get_model_spec("tiny"), seed=0).state_dict()
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        moved = (pa - init[name]).norm()
        if moved > 0:
            assert ((pa - pb).norm() / moved).item() < 0.05, name  # same updates within bf16 moment rounding
    state = next(iter(opt_b.state.values()))
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
    restored = BF16MomentAdamW(b.parameters(), lr=1e-3)
    restored.load_state_dict(opt_b.state_dict())
    assert torch.equal(next(iter(restored.state.values()))["exp_avg"], state["exp_avg"])


class _Broken(torch.nn.Module):
    def __init__(self, value):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3))
        self.value = value

    def forward(self, ids):
        return (self.w * self.value).sum()


def test_preflight_reports_nonfinite_loss_and_leaves_no_gradients():
    model = build_model(get_model_spec("tiny"), seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert preflight_problem(model, [torch.randint(0, 512, (2, 16))] * 2) is None
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert "the loss is nan" in preflight_problem(_Broken(float("nan")), [torch.zeros(1)])
    assert "the loss is inf" in preflight_problem(_Broken(float("inf")), [torch.zeros(1)])
