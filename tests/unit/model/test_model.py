"""The loss wrapper and the FLOP count MFU is built on."""
import math

import pytest
import torch

from configs import get_model_spec
from utils.model import build_model, lm_loss
from utils.model.hf import to_transformers


@pytest.mark.parametrize("impl", ["native", "hf"])
def test_loss_equals_transformers_causal_lm_loss(impl):
    model = build_model(get_model_spec("tiny"), seed=1, impl=impl)
    ids = torch.randint(0, 512, (3, 32), generator=torch.Generator().manual_seed(0))
    ours = model(ids)
    theirs = to_transformers(model.state_dict(), get_model_spec("tiny"))(input_ids=ids, labels=ids).loss
    assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    assert math.isclose(ours.item(), math.log(512), rel_tol=0.1)  # near-uniform at init


@pytest.mark.parametrize("impl", ["native", "hf"])
def test_same_seed_same_weights(impl):
    a = build_model(get_model_spec("tiny"), seed=3, impl=impl).state_dict()
    b = build_model(get_model_spec("tiny"), seed=3, impl=impl).state_dict()
    c = build_model(get_model_spec("tiny"), seed=4, impl=impl).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


@pytest.mark.parametrize("impl", ["native", "hf"])
def test_flops_per_token_1p2b(impl):
    spec = get_model_spec("gpt-neox-1.2b")
    with torch.device("meta"):
        model = build_model(spec, seed=0, impl=impl)
    total, matmul = model.parameter_counts()
    assert 1.3e9 < total < 1.5e9  # 1.2B in the blocks + untied 50304 x 2048 input and output embeddings
    assert total - matmul == 50304 * 2048
    fpt = model.flops_per_token(2048)
    assert fpt == 6 * matmul + 12 * 24 * 16 * 128 * 2048
    assert 9.0e9 < fpt < 9.2e9
    # The target: ~54,500 tokens/s on one H100 (989 TFLOP/s dense bf16) is 50% MFU.
    from utils.observe.metrics import mfu
    assert math.isclose(mfu(54_500, fpt, 989e12, 1), 0.50, abs_tol=0.005)


def test_chunked_loss_equals_the_plain_one(monkeypatch):
    """Several chunks (and a ragged last one) give the same loss and gradients as full logits."""
    monkeypatch.setattr(lm_loss, "LOSS_CHUNK_ROWS", 7)  # the chunked loss lives in utils/model/lm_loss.py
    model = build_model(get_model_spec("tiny"), seed=3)
    x = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(0))
    loss = model(x)
    loss.backward()
    chunked = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    logits = model.logits(x)[:, :-1].float()
    plain = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))
    plain.backward()
    assert abs(loss.item() - plain.item()) <= 1e-6
    for name, p in model.named_parameters():
        assert torch.allclose(chunked[name], p.grad, atol=1e-7, rtol=1e-5), name
    # under no_grad (eval) the loss-only path: the same value without the two gradient matmuls
    calls = []
    monkeypatch.setattr(lm_loss.ChunkedLMHeadLoss, "forward", lambda *a: calls.append(a))
    with torch.no_grad():
        assert abs(model(x).item() - plain.item()) <= 1e-6
    assert calls == []
