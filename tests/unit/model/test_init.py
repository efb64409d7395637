"""`init=neox`: GPT-NeoX's small_init + wang_init, measured on the 1.2B shape."""
import math

import pytest
import torch

from configs import get_model_spec, get_training_config
from configs.model_config import ConfigError
from utils.model import build_model
from utils.model.init import init_weights, planned_stds


def test_neox_init_stds_on_the_1_2b_shape():
    """Every kind of weight of the 1.2B shape drawn with its formula's std (within 2%): the whole model is
    built on the meta device (names and shapes), two of its blocks, the embedding and the head are drawn."""
    spec = get_model_spec("gpt-neox-1.2b")
    d, L = spec.hidden_size, spec.num_hidden_layers
    with torch.device("meta"):
        full = build_model(spec, seed=0)
    plan = planned_stds(full, d, L)
    small, wang = math.sqrt(2 / (5 * d)), 2 / (L * math.sqrt(d))
    wang_names = {n for n, s in plan.items() if s == wang}
    assert len(wang_names) == 2 * L and all(n.endswith(("attention.dense.weight", "mlp.dense_4h_to_h.weight"))
                                            for n in wang_names)
    assert {n for n, s in plan.items() if s == small} == set(plan) - wang_names
    assert "lm_head.weight" in plan and "gpt_neox.embed_in.weight" in plan
    full.gpt_neox.layers = full.gpt_neox.layers[:2]  # the other blocks are the same shapes, drawn alike
    model = full.to_empty(device="cpu")
    torch.manual_seed(0)
    init_weights(model, "neox", d, L)
    kinds = {"embed_in": model.gpt_neox.embed_in.weight,
             "query_key_value": model.gpt_neox.layers[1].attention.query_key_value.weight,
             "dense_h_to_4h": model.gpt_neox.layers[0].mlp.dense_h_to_4h.weight, "lm_head": model.lm_head.weight,
             "attention.dense": model.gpt_neox.layers[1].attention.dense.weight,
             "dense_4h_to_h": model.gpt_neox.layers[0].mlp.dense_4h_to_h.weight}
    expected = {"attention.dense": wang, "dense_4h_to_h": wang}
    for kind, weight in kinds.items():
        want = expected.get(kind, small)
        std = weight.float().std().item()
        assert abs(std / want - 1) < 0.02, (kind, std, want)
        assert abs(weight.float().mean().item()) < 0.02 * want, kind
    layer = model.gpt_neox.layers[0]
    assert torch.all(layer.attention.query_key_value.bias == 0) and torch.all(layer.mlp.dense_4h_to_h.bias == 0)
    assert torch.all(layer.input_layernorm.weight == 1) and torch.all(model.gpt_neox.final_layer_norm.bias == 0)


def test_init_field_reaches_the_model_and_hf_is_unchanged():
    spec = get_model_spec("tiny")
    hf = build_model(spec, seed=3)
    assert torch.equal(build_model(spec, seed=3, init="hf").lm_head.weight, hf.lm_head.weight)
    neox = build_model(spec, seed=3, init="neox")
    want = 2 / (spec.num_hidden_layers * math.sqrt(spec.hidden_size))
    assert not torch.equal(neox.lm_head.weight, hf.lm_head.weight)
    assert torch.equal(neox.lm_head.weight, build_model(spec, seed=3, init="neox").lm_head.weight)  # seeded
    dense = torch.cat([b.attention.dense.weight.flatten() for b in neox.gpt_neox.layers])
    assert abs(dense.std().item() / want - 1) < 0.1
    with pytest.raises(ConfigError, match="init='xavier' is not valid"):
        get_training_config("demo", {"init": "xavier"})


def test_neox_init_finds_each_family_s_residual_outputs():
    """The residual-stream outputs come from the family (its RESIDUAL_OUTPUTS): a Llama's o_proj and
    down_proj get wang_init, its other matrices small_init."""
    spec = get_model_spec("llama-tiny")
    model = build_model(spec, seed=0)
    d, L = spec.hidden_size, spec.num_hidden_layers
    plan = planned_stds(model, d, L)
    wang = {n for n, s in plan.items() if s == 2 / (L * math.sqrt(d))}
    assert len(wang) == 2 * L and all(n.endswith(("o_proj.weight", "down_proj.weight")) for n in wang), wang
