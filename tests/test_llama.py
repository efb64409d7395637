"""The llama family (utils/model/llama/) against transformers' LlamaForCausalLM and Qwen2ForCausalLM, both
ways, at toy size in fp32: logits, loss and gradients within 1e-5; HF weights in (`init_from`) and out
(`final_model/`) are the same tensors; the published presets' parameter counts."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from configs.model_config import ConfigError, ModelSpec, get_model_spec
from utils.model import build_model
from utils.model.families import family
from utils.model.hf import export_hf, load_hf_pretrained, to_transformers

BASE = ModelSpec("toy-llama", vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=96, max_position_embeddings=64, family="llama", num_key_value_heads=2,
                 rotary_pct=1.0, use_parallel_residual=False, attention_bias=False, hidden_act="silu",
                 tie_word_embeddings=True, pad_vocab_multiple=1)
VARIANTS = {
    "gqa-tied": {},
    "mha-untied-llama3-rope-bias": {"num_key_value_heads": 4, "tie_word_embeddings": False, "attention_bias": True,
                                    "rotary_emb_base": 500000.0, "rope_scaling": (8.0, 1.0, 4.0, 16)},
    "qwen2-qkv-bias": {"qkv_bias": True, "num_key_value_heads": 1, "layer_norm_eps": 1e-6,
                       "rotary_emb_base": 1000000.0},
}


def ids(batch=3, length=32, vocab=300, seed=0):
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def reference_model(spec: ModelSpec, seed: int):
    """transformers' own class for `spec` with random weights, norms and biases included (not 1 and 0)."""
    torch.manual_seed(seed)
    fam = family("llama")
    model = fam.hf().causal_lm_class(spec)(fam.hf().hf_config(spec, attn_implementation="eager")).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if name.endswith("norm.weight") else 0.0))
    return model


@pytest.mark.parametrize("variant", VARIANTS)
def test_native_equals_transformers_logits_loss_and_gradients(variant):
    spec = replace(BASE, **VARIANTS[variant])
    reference = reference_model(spec, seed=1)
    expected_class = "Qwen2ForCausalLM" if spec.qkv_bias else "LlamaForCausalLM"
    assert type(reference).__name__ == expected_class
    native = build_model(spec, seed=2)
    hf_names = [n for n, _ in reference.named_parameters()]
    assert [n for n, _ in native.named_parameters()] == hf_names  # names and order (a tied head is one parameter)
    native.load_state_dict(family("llama").hf().from_hf_state(reference.state_dict()))
    if spec.tie_word_embeddings:
        assert native.lm_head.weight is native.model.embed_tokens.weight
    x = ids()
    theirs = reference(input_ids=x, labels=x)
    mine = native.logits(x)
    assert (mine - theirs.logits).abs().max().item() <= 1e-5
    loss = native(x)
    assert abs(loss.item() - theirs.loss.item()) <= 1e-5
    loss.backward()
    theirs.loss.backward()
    grads = dict(reference.named_parameters())
    for name, p in native.named_parameters():
        assert (p.grad - grads[name].grad).abs().max().item() <= 1e-5, name
    # model_impl=hf: the same class with the engine's interface, the same loss
    hf = build_model(spec, seed=3, impl="hf")
    hf.load_state_dict(reference.state_dict())
    assert type(hf).__name__ == f"HF{expected_class}" and len(hf.blocks()) == spec.num_hidden_layers
    with torch.no_grad():
        assert abs(hf(x).item() - theirs.loss.item()) <= 1e-5
    assert hf.flops_per_token(32) == native.flops_per_token(32)


def test_llama3_rope_scaling_equals_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from utils.model.common.rotary import spec_inv_freq as llama_inv_freq

    spec = get_model_spec("llama-3.2-1b")
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](family("llama").hf().hf_config(spec))
    assert torch.allclose(llama_inv_freq(spec), theirs, rtol=1e-6, atol=0)
    assert not torch.allclose(llama_inv_freq(replace(spec, rope_scaling=())), theirs)  # the scaling does something


@pytest.mark.parametrize("variant", ["gqa-tied", "qwen2-qkv-bias", "mha-untied-llama3-rope-bias"])
def test_hf_weights_in_and_out_are_the_same_tensors(tmp_path, variant):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    spec = replace(BASE, **VARIANTS[variant])
    reference_model(spec, seed=4).save_pretrained(tmp_path / "in")
    loaded_spec, weights = load_hf_pretrained(tmp_path / "in")
    assert replace(loaded_spec, name=spec.name) == spec  # the architecture, read back from config.json
    native = build_model(loaded_spec, seed=5)
    native.load_state_dict(weights, strict=not loaded_spec.tie_word_embeddings)
    native.tie_weights()
    export_hf(native.state_dict(), loaded_spec, tmp_path / "out")
    before = load_file(str(tmp_path / "in" / "model.safetensors"))
    after = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert ("lm_head.weight" in after) != spec.tie_word_embeddings  # a tied file has no separate head
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == ("qwen2" if spec.qkv_bias else "llama")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    x = ids()
    with torch.no_grad():
        assert (reloaded(input_ids=x).logits - native.logits(x)).abs().max().item() <= 1e-5
    # and to_transformers (generate.py) holds the same weights
    again = to_transformers(native.state_dict(), loaded_spec)
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in reloaded.state_dict().items())


def test_unsupported_llama_configs_are_one_line(tmp_path):
    from utils.model.hf import spec_from_hf_config

    config = family("llama").hf().hf_config(BASE).to_dict()
    for change, says in (({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "yarn"),
                         ({"mlp_bias": True}, "mlp_bias"), ({"hidden_act": "gelu"}, "hidden_act"),
                         ({"head_dim": 32}, "head_dim")):
        with pytest.raises(ConfigError, match=f"x/config.json: .*{says}"):
            spec_from_hf_config(config | change, name="x", source="x/config.json")
    transformers4 = {k: v for k, v in config.items() if k != "rope_parameters"} | {
        "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    spec = spec_from_hf_config(transformers4, name="x")
    assert spec.rotary_emb_base == 5e5 and spec.rope_scaling == (32.0, 1.0, 4.0, 8192)


# Published parameter counts (tied embeddings counted once).
PUBLISHED = {"llama-3.2-1b": 1_235_814_400, "smollm2-135m": 134_515_008, "smollm2-360m": 361_821_120,
             "smollm2-1.7b": 1_711_376_384, "qwen2.5-0.5b": 494_032_768, "qwen2.5-1.5b": 1_543_714_304}


@pytest.mark.parametrize("name", PUBLISHED)
def test_presets_have_the_published_shapes(name):
    spec = get_model_spec(name)
    assert spec.family == "llama" and spec.padded_vocab_size == spec.vocab_size
    with torch.device("meta"):
        model = build_model(spec, seed=0)
    total = sum(p.numel() for p in model.parameters())
    assert total == PUBLISHED[name]
    # the memory plan's formula counts the same blocks
    embed = spec.padded_vocab_size * spec.hidden_size
    assert family("llama").parameters(spec) == total
