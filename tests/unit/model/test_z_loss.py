"""z-loss inside the chunked LM-head loss: the same value and gradients as autograd of the plain formula."""
import pytest
import torch

from configs import get_model_spec, get_training_config
from configs.model_config import ConfigError
from utils.model import build_model, lm_loss
from utils.model.lm_loss import ChunkedLMHeadLoss, set_z_loss


def plain(hidden, weight, targets, z):
    logits = hidden @ weight.t()
    lse = torch.logsumexp(logits, dim=-1)
    ce = torch.nn.functional.cross_entropy(logits, targets)
    return ce + z * lse.square().mean(), z * lse.square().mean()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_z_loss_gradient_equals_autograd_of_the_formula(monkeypatch, dtype):
    monkeypatch.setattr(lm_loss, "LOSS_CHUNK_ROWS", 7)  # several chunks, the last one short
    g = torch.Generator().manual_seed(0)
    hidden = (torch.randn(30, 16, generator=g, dtype=torch.float64) * 3).to(dtype).requires_grad_()
    weight = torch.randn(50, 16, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    targets = torch.randint(0, 50, (30,), generator=g)
    z = 1e-2  # large enough that the z term's share of the gradient is far above the tolerance
    loss, z_term = ChunkedLMHeadLoss.apply(hidden, weight, targets, dtype, z)
    loss.backward()
    got = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    want, want_z = plain(hidden, weight, targets, z)
    want.backward()
    assert abs(loss.item() - want.item()) <= 1e-6 * max(1, abs(want.item()))
    assert abs(z_term.item() - want_z.item()) <= 1e-6 * max(1, want_z.item()) and want_z.item() > 1e-3
    for mine, ref in zip(got, (hidden.grad, weight.grad)):
        assert (mine - ref).abs().max().item() <= 1e-6, (mine - ref).abs().max().item()
    # and the z term's part of the gradient is not negligible: without it the gradients differ
    hidden.grad = weight.grad = None
    plain(hidden, weight, targets, 0.0)[0].backward()
    assert (got[0] - hidden.grad).abs().max().item() > 1e-4


def test_model_returns_ce_plus_z_and_keeps_the_z_term():
    model = build_model(get_model_spec("tiny"), seed=1)
    x = torch.randint(0, model.spec.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    ce = model(x).item()
    heads = set_z_loss(model, 1e-3)
    assert heads == [model.lm_head]
    total = model(x)
    z_term = model.lm_head.last_z_loss
    logits = model.logits(x)[:, :-1].float()
    lse2 = torch.logsumexp(logits, dim=-1).square().mean().item()
    assert abs(z_term.item() - 1e-3 * lse2) <= 1e-6 and abs(total.item() - ce - z_term.item()) <= 1e-5
    with torch.no_grad():  # evaluation: the cross-entropy alone
        assert abs(model(x).item() - ce) <= 1e-6
    with pytest.raises(ConfigError, match="z_loss=0.0001 needs model_impl=native"):
        get_training_config("demo", {"z_loss": 1e-4, "model_impl": "hf"})
