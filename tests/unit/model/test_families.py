"""The contract every registered model family keeps (utils/model/families.py), one test per promise,
parametrized over the registry: a family joins by being registered and giving its entry in CASES (its
test-size preset, the variants checked against transformers, its published parameter counts, the config.json
values its adapter refuses).

In process, at toy size in fp32: the native model is transformers' class (names and order, logits, loss and
gradients within 1e-5, every variant), an HF directory comes in and goes out as the same tensors and the same
class, the presets have their published counts, the memory plan counts what the built model holds (Muon's
matrices too), every activation-checkpointing policy gives `none`'s gradients, a packed document has its
logits alone (FlexAttention's block mask equal to SDPA's dense one, sliding windows included). In real
processes (slow): train.py learns, 2 DDP ranks equal 1 process, 2 FSDP ranks equal DDP, a resume is bitwise
the uninterrupted run, an FSDP checkpoint resumes on one process, tied embeddings stay tied through FSDP and
export, fp8 (emulated) trains with document masking, `init_from` an HF directory trains and exports the same
class, and scripts/evaluate.py scores each choice as lm-evaluation-harness does (1e-4).
"""
from __future__ import annotations

import json
import math
import os
import re
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import torch

from configs import get_model_spec
from configs.model_config import ConfigError, ModelSpec
from configs.training_config import ACTIVATION_CHECKPOINTING
from tests.trainkit import REPO_ROOT, TINY, make_shards, run, train_cmd, train_rows
from utils.model import build_model
from utils.model.activation_checkpointing import apply_activation_checkpointing, parameter_fqn
from utils.model.families import FAMILIES, family
from utils.model.hf import export_hf, load_hf_pretrained, to_transformers


@dataclass(frozen=True)
class FamilyCase:
    preset: str  # the family's test-size preset: what the engine runs train.py with
    variants: dict[str, dict]  # name -> ModelSpec changes from the preset, each checked against transformers
    published: dict[str, int]  # preset -> its published parameter count (a tied head counted once)
    fits_80gib: str  # a published preset whose memory plan at a 4096-token training length fits an 80 GiB GPU
    refused: list[tuple[dict, str]] = field(default_factory=list)  # config.json changes -> what the line says
    accepted: list[tuple[dict, dict]] = field(default_factory=list)  # config.json changes -> the spec's fields
    # config.json changes the engine reads as transformers' config class does (its precedence and defaults): each,
    # and each `accepted`, builds the model transformers loads from the same directory (logits within 1e-5)
    as_transformers: list[dict] = field(default_factory=list)


ABSENT = "<absent>"  # a config.json change's value that removes the key: transformers' default applies
YARN_OVER = ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},  # beside rope_parameters: transformers' choice
             "rope scaling 'yarn' is not supported (from rope_scaling, which transformers applies over "
             "rope_parameters)")


def changed(config: dict, change: dict) -> dict:
    return {k: v for k, v in (config | change).items() if v != ABSENT}


CASES = {
    "gpt_neox": FamilyCase(
        "tiny",
        {"pythia-like": {"vocab_size": 300},
         "sequential-full-rotary": {"rotary_pct": 1.0, "use_parallel_residual": False},
         "no-biases-base-eps-act": {"attention_bias": False, "rotary_pct": 0.5, "rotary_emb_base": 500.0,
                                    "layer_norm_eps": 1e-6, "hidden_act": "gelu_new"},
         "tied-unpadded": {"tie_word_embeddings": True, "pad_vocab_multiple": 1, "vocab_size": 300}},
        {"pythia-160m": 162_322_944, "pythia-410m": 405_334_016, "pythia-1b": 1_011_781_632,
         "pythia-1.4b": 1_414_647_808, "pythia-2.8b": 2_775_208_960, "pythia-6.9b": 6_857_302_016}, "gpt-neox-1.2b",
        [({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}, "linear"), YARN_OVER],
        [({"rope_parameters": None, "rotary_pct": 0.5, "rotary_emb_base": 500.0},  # transformers 4's keys
          {"rotary_pct": 0.5, "rotary_emb_base": 500.0})],
        [{"rope_scaling": {"rope_type": "default", "rope_theta": 500.0}},  # read over rope_parameters' 10,000
         {"rotary_pct": 0.5, "tie_word_embeddings": ABSENT}]),
    "llama": FamilyCase(
        "llama-tiny",
        {"gqa-tied": {},
         "mha-untied-llama3-rope-bias": {"num_key_value_heads": 4, "tie_word_embeddings": False,
                                         "attention_bias": True, "rotary_emb_base": 500000.0,
                                         "rope_scaling": (8.0, 1.0, 4.0, 16)},
         "qwen2-qkv-bias": {"qkv_bias": True, "num_key_value_heads": 1, "layer_norm_eps": 1e-6,
                            "rotary_emb_base": 1000000.0},
         "qk-norm-exports-as-qwen3": {"qk_norm": True}},
        {"llama-3.2-1b": 1_235_814_400, "smollm2-135m": 134_515_008, "smollm2-360m": 361_821_120,
         "smollm2-1.7b": 1_711_376_384, "qwen2.5-0.5b": 494_032_768, "qwen2.5-1.5b": 1_543_714_304}, "llama-3.2-1b",
        [({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "yarn"), YARN_OVER,
         ({"mlp_bias": True}, "mlp_bias"), ({"hidden_act": "gelu"}, "hidden_act"), ({"head_dim": 32}, "head_dim"),
         ({"model_type": "qwen2", "use_sliding_window": True, "max_window_layers": 1}, "sliding-window layers")],
        [({"rope_parameters": None, "rope_theta": 5e5,  # transformers 4's keys
           "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192}},
          {"rotary_emb_base": 5e5, "rope_scaling": (32.0, 1.0, 4.0, 8192)}),
         ({"model_type": "qwen2", "use_sliding_window": False}, {"qkv_bias": True})],
        [{"rope_scaling": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 16}},  # over plain rotary
         {"model_type": "qwen2", "use_sliding_window": True},  # its window from layer 28 on: none of these slide
         {"head_dim": ABSENT, "num_key_value_heads": ABSENT, "tie_word_embeddings": ABSENT}]),
    "qwen3": FamilyCase(
        "qwen3-tiny",
        {"head-dim-32-sliding": {},
         "untied-biases-full-attention": {"tie_word_embeddings": False, "attention_bias": True, "layer_types": (),
                                          "sliding_window": 0, "num_key_value_heads": 4},
         "llama3-rope-mqa": {"rope_scaling": (8.0, 1.0, 4.0, 16), "num_key_value_heads": 1,
                             "rotary_emb_base": 500000.0}},
        {"qwen3-0.6b": 596_049_920, "qwen3-1.7b": 1_720_574_976}, "qwen3-0.6b",
        [({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "yarn"), YARN_OVER,
         ({"hidden_act": "swish2"}, "hidden_act"), ({"layer_types": ["full_attention"]}, "layer_types is"),
         ({"sliding_window": 0}, "sliding_window is 0, not a positive integer"),
         ({"layer_types": None, "max_window_layers": -1}, "max_window_layers is -1, not an integer of at least 0"),
         ({"use_sliding_window": False}, "layer_types names sliding layers but there is no sliding_window")],
        [({"use_sliding_window": False, "layer_types": ABSENT}, {"sliding_window": 0, "layer_types": ()}),
         ({"layer_types": None, "max_window_layers": 1}, {"layer_types": ("full", "sliding")}),
         ({"hidden_size": 70, "head_dim": 32}, {"hidden_size": 70, "attention_head_dim": 32}),
         ({"head_dim": ABSENT}, {"attention_head_dim": 128})],  # transformers' default, not hidden / heads
        [{"rope_scaling": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 16}},
         {"layer_types": ABSENT, "max_window_layers": 0}, {"tie_word_embeddings": ABSENT}]),
    "gemma3": FamilyCase(
        "gemma3-tiny",
        {"sliding-then-global": {},
         "softcapped-untied-mha": {"final_logit_softcapping": 5.0, "tie_word_embeddings": False,
                                   "num_key_value_heads": 4},
         "global-only-scalar-head-dim": {"layer_types": (), "sliding_window": 0, "query_pre_attn_scalar": 32,
                                         "layer_norm_eps": 1e-5}},
        {"gemma-3-270m": 268_098_176, "gemma-3-1b": 999_885_952}, "gemma-3-1b",
        [({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
         ({"use_bidirectional_attention": True}, "bidirectional"),
         ({"rope_parameters": {"full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}, "linear"),
         YARN_OVER, ({"rope_scaling": {"rope_type": "bogus"}}, "rope scaling 'bogus' is not supported"),
         ({"layer_types": ABSENT, "sliding_window_pattern": 0}, "sliding_window_pattern is 0, not a positive"),
         ({"layer_types": ABSENT, "sliding_window_pattern": -1}, "sliding_window_pattern is -1, not a positive"),
         ({"sliding_window": None}, "its layers slide but sliding_window is unset")],
        [({"rope_parameters": None, "rope_theta": 1e6, "rope_local_base_freq": 1e4,  # the published files' keys
           "layer_types": None, "sliding_window_pattern": 2, "hidden_activation": ABSENT},
          {"rotary_emb_base": 1e6, "rope_local_base": 1e4, "layer_types": ("sliding", "full"),
           "hidden_act": "gelu_pytorch_tanh"}),
         ({"sliding_window": ABSENT}, {"sliding_window": 4096})],
        [{"rope_scaling": {"rope_type": "default", "rope_theta": 5e5}},  # merged into the full layers' rope
         {"layer_types": ABSENT, "tie_word_embeddings": ABSENT, "head_dim": ABSENT, "query_pre_attn_scalar": ABSENT}]),
}


def test_every_registered_family_has_a_case():
    """A family registered without an entry here would escape the contract."""
    assert set(CASES) == set(FAMILIES)
    for name, case in CASES.items():
        assert get_model_spec(case.preset).family == name


def variant_params():
    return [pytest.param(name, variant, id=f"{name}-{variant}")
            for name, case in CASES.items() for variant in case.variants]


def spec_of(name: str, variant: str) -> ModelSpec:
    return replace(get_model_spec(CASES[name].preset), **CASES[name].variants[variant])


def ids(spec: ModelSpec, batch=3, length=40, seed=0) -> torch.Tensor:
    length = min(length, spec.max_position_embeddings)
    return torch.randint(0, spec.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


def reference_model(spec: ModelSpec, seed: int, loud: float = 0.0):
    """transformers' own class for `spec` with random weights, norms and biases included (not at their
    identity); `loud` > 0 draws every weight with that std, so predictions are confident and far from uniform."""
    torch.manual_seed(seed)
    adapter = family(spec.family).hf()
    model = adapter.causal_lm_class(spec)(adapter.hf_config(spec, attn_implementation="eager")).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
            elif loud:
                p.copy_(torch.randn_like(p) * loud)
    return model


# ------------------------------------------------------------------------------------- the math, both ways

@pytest.mark.parametrize("name, variant", variant_params())
def test_native_equals_transformers_logits_loss_and_gradients(name, variant):
    spec = spec_of(name, variant)
    reference = reference_model(spec, seed=1)
    native = build_model(spec, seed=2)
    assert [n for n, _ in native.named_parameters()] == [n for n, _ in reference.named_parameters()]  # and order
    native.load_state_dict(family(name).hf().from_hf_state(reference.state_dict()), strict=not spec.tie_word_embeddings)
    native.tie_weights()
    x = ids(spec)
    theirs = reference(input_ids=x, labels=x)
    assert (native.logits(x) - theirs.logits).abs().max().item() <= 1e-5
    loss = native(x)
    assert abs(loss.item() - theirs.loss.item()) <= 1e-5
    loss.backward()
    theirs.loss.backward()
    grads = dict(reference.named_parameters())
    for n, p in native.named_parameters():
        assert (p.grad - grads[n].grad).abs().max().item() <= 1e-5, n
    # model_impl=hf: transformers' class with the engine's interface, the same loss and FLOPs
    hf = build_model(spec, seed=3, impl="hf")
    hf.load_state_dict(reference.state_dict(), strict=not spec.tie_word_embeddings)
    assert type(hf).__name__ == f"HF{type(reference).__name__}" and len(hf.blocks()) == spec.num_hidden_layers
    with torch.no_grad():
        assert abs(hf(x).item() - theirs.loss.item()) <= 1e-5
    assert hf.flops_per_token(32) == native.flops_per_token(32)


@pytest.mark.parametrize("name, variant", variant_params())
def test_an_hf_directory_comes_in_and_goes_out_as_the_same_tensors_and_class(tmp_path, name, variant):
    """init_from's reader and the export: a transformers-written directory -> the engine's spec and weights ->
    a directory of the same class (and model_type) holding the same tensors."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    spec = spec_of(name, variant)
    reference = reference_model(spec, seed=4)
    reference.save_pretrained(tmp_path / "in")
    loaded_spec, weights = load_hf_pretrained(tmp_path / "in")
    native = build_model(loaded_spec, seed=5)
    native.load_state_dict(weights, strict=not loaded_spec.tie_word_embeddings)
    native.tie_weights()
    export_hf(native.state_dict(), loaded_spec, tmp_path / "out")
    before = load_file(str(tmp_path / "in" / "model.safetensors"))
    after = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    config_in, config_out = (json.loads((tmp_path / d / "config.json").read_text()) for d in ("in", "out"))
    for key in ("model_type", "architectures"):
        assert config_out[key] == config_in[key], key
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    assert type(reloaded) is type(reference)
    x = ids(spec)
    with torch.no_grad():
        assert (reloaded(input_ids=x).logits - native.logits(x)).abs().max().item() <= 1e-5
    again = to_transformers(native.state_dict(), loaded_spec)  # generate.py's model, its buffers rebuilt
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in reloaded.state_dict().items())
    with torch.no_grad():
        assert (again.float()(input_ids=x).logits - native.logits(x)).abs().max().item() <= 1e-5
    if loaded_spec.family == spec.family:  # (a Llama with QK-norm comes back as the Qwen3 it is)
        assert loaded_spec.padded_vocab_size == spec.padded_vocab_size  # the rows as the file has them
        assert replace(loaded_spec, name=spec.name, vocab_size=spec.vocab_size,
                       pad_vocab_multiple=spec.pad_vocab_multiple) == spec


@pytest.mark.parametrize("name", CASES)
def test_config_json_is_read_and_what_the_family_cannot_build_is_one_line(name):
    from utils.model.hf import spec_from_hf_config

    spec = get_model_spec(CASES[name].preset)
    config = family(name).hf().hf_config(spec).to_dict()
    assert spec_from_hf_config(config, name=spec.name).family == name
    for change, says in CASES[name].refused:
        with pytest.raises(ConfigError, match=f"x/config.json: .*{re.escape(says)}") as refused:
            spec_from_hf_config(changed(config, change), name="x", source="x/config.json")
        assert "\n" not in str(refused.value)
    for change, fields in CASES[name].accepted:  # other spellings of the same architecture
        read = spec_from_hf_config(changed(config, change), name="x", source="x/config.json")
        assert {k: getattr(read, k) for k in fields} == fields, change


@torch.no_grad()
@pytest.mark.parametrize("name", CASES)
def test_an_hf_directory_is_the_model_transformers_loads_from_it(name, tmp_path):
    """config.json read as transformers' config class reads it (every `accepted` and `as_transformers` spelling:
    rope_scaling over rope_parameters, its defaults where a key is absent) and the tensors as `from_pretrained`
    loads them (a tied config whose file holds a head of its own keeps them apart, said in one line; a head without
    its embedding is both): the engine's model of each directory gives the logits of transformers' own
    `AutoModelForCausalLM.from_pretrained` of it."""
    from safetensors.torch import save_file
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    spec = get_model_spec(CASES[name].preset)
    base = family(name).hf().hf_config(spec).to_dict()
    head = "lm_head.weight"  # (every family's class, GPT-NeoX's too, names it so in transformers 5)
    cases = [*(change for change, _ in CASES[name].accepted), *CASES[name].as_transformers,
             {"tie_word_embeddings": True, "own head": True}, {"tie_word_embeddings": True, "head only": True}]
    for i, change in enumerate(cases):
        config = changed(base, {k: v for k, v in change.items() if k not in ("own head", "head only")})
        folder = tmp_path / str(i)
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        torch.manual_seed(i)
        theirs = CONFIG_MAPPING[config["model_type"]].from_dict(json.loads(json.dumps(config)))
        weights = {k: v.clone() for k, v in AutoModelForCausalLM.from_config(theirs).state_dict().items()}
        embedding = next(k for k in weights if weights[k].shape == weights[head].shape and k != head)
        if "own head" in change:
            weights[head] = torch.randn_like(weights[head]) * 0.02
        if "head only" in change:
            del weights[embedding]
        save_file(weights, str(folder / "model.safetensors"))
        reference = AutoModelForCausalLM.from_pretrained(folder).float().eval()
        said = []
        loaded, state = load_hf_pretrained(folder, say=said.append)
        native = build_model(loaded, seed=0)
        native.load_state_dict(state, strict=not loaded.tie_word_embeddings)
        native.tie_weights()
        x = ids(loaded)
        assert (native.logits(x) - reference(input_ids=x).logits).abs().max().item() <= 1e-5, change
        assert loaded.tie_word_embeddings == ("own head" not in change and bool(reference.config.tie_word_embeddings))
        assert len(said) == ("own head" in change), said
        if said:
            assert said[0].startswith(f"warning: init_from {folder}: config.json ties the head to the embedding") and \
                "as transformers loads it, the two stay apart: this model is untied" in said[0], said


@pytest.mark.parametrize("name", CASES)
def test_presets_have_the_published_parameter_counts(name):
    fam = family(name)
    for preset, published in CASES[name].published.items():
        spec = get_model_spec(preset)
        with torch.device("meta"):
            model = build_model(spec, seed=0)
        assert sum(p.numel() for p in model.parameters()) == fam.parameters(spec) == published, preset


@pytest.mark.parametrize("name", CASES)
def test_the_memory_plan_counts_what_the_built_model_holds(name):
    """Weights, and Muon's state (one momentum buffer per matrix the family gives Muon, AdamW's two for the
    rest): the plan's numbers are the built model's, for every preset of the family."""
    from configs.profiles import RunShape, memory_plan
    from utils.training.optim.muon import muon_parameters

    for spec in family(name).presets:
        with torch.device("meta"):
            model = build_model(spec, seed=0)
        total = sum(p.numel() for p in model.parameters())
        muon = sum(p.numel() for p in muon_parameters(model))
        matrices = len(family(name).muon_matrices(spec)) * spec.num_hidden_layers
        assert muon > 0 and len(muon_parameters(model)) == matrices, spec.name
        plan = memory_plan(spec, RunShape(micro_batch=1, seq_len=64, optimizer="muon"))
        assert plan.weights == 4 * total, spec.name
        assert plan.optimizer == 4 * (2 * total - muon), spec.name
        fsdp = memory_plan(spec, RunShape(strategy="fsdp", world_size=8, micro_batch=1, seq_len=64, optimizer="muon"))
        assert math.isclose(fsdp.state * 8, plan.state)


@pytest.mark.parametrize("name", CASES)
def test_memory_plan_py_fits_a_published_preset_on_an_80_gib_gpu_at_its_default_plan(name):
    """micro-batch 1, no activation checkpointing, the length a run trains at when seq_len is unset (the
    model's context before rope scaling, at most 8,192 tokens: configs.training_config.default_seq_len)."""
    import subprocess

    from configs.training_config import default_seq_len

    preset = CASES[name].fits_80gib
    length = default_seq_len(get_model_spec(preset))[0]
    out = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "memory_plan.py"), "--model", preset],
                         capture_output=True, text=True, cwd=REPO_ROOT)
    assert out.returncode == 0 and "fits a 80 GiB GPU" in out.stdout, out.stdout + out.stderr
    assert out.stdout.startswith(f"{preset}, ddp over 1 GPU(s), micro-batch 1"), out.stdout
    assert f"seq_len {length:,} (the training default)" in out.stdout, out.stdout


@pytest.mark.parametrize("name", CASES)
def test_the_memory_plans_activations_are_what_a_block_keeps(name):
    """The family's count of what one block keeps for backward (none, selective, full) against what
    `saved_activation_bytes` measures on its test-size model (fp32, the difference of 4 and 2 layers), within
    10%."""
    from utils.model.activation_checkpointing import saved_activation_bytes

    preset = get_model_spec(CASES[name].preset)
    x = ids(preset, batch=2, length=64)
    for policy in ("none", "selective", "full"):
        kept = []
        for layers in (2, 4):
            spec = replace(preset, num_hidden_layers=layers, layer_types=preset.layer_types * (layers // 2))
            model = build_model(spec, seed=0)
            apply_activation_checkpointing(model, policy)
            kept.append(saved_activation_bytes(model, x))
        measured = (kept[1] - kept[0]) / 2 / 4 / x.numel()  # values per token per block
        counted = family(name).activations(preset, policy)
        assert abs(counted / measured - 1) < 0.1, (policy, counted, measured)


# ------------------------------------------------------------------------------ the engine's model seams

@pytest.mark.parametrize("impl", ["native", "hf"])
@pytest.mark.parametrize("name", CASES)
def test_every_activation_checkpointing_policy_gives_the_gradients_of_none(name, impl):
    preset = get_model_spec(CASES[name].preset)
    spec = replace(preset, num_hidden_layers=4, layer_types=preset.layer_types * 2)
    x = ids(spec, batch=2, length=32)
    grads = {}
    for policy in ACTIVATION_CHECKPOINTING:
        model = build_model(spec, seed=3, impl=impl)
        wrapped = apply_activation_checkpointing(model, policy, every=2)
        assert wrapped == {"none": 0, "full": 4, "every_k": 2, "selective": 4}[policy]
        model(x).backward()
        grads[policy] = {parameter_fqn(n): p.grad.clone() for n, p in model.named_parameters()}
    for policy in ACTIVATION_CHECKPOINTING:
        assert grads[policy].keys() == grads["none"].keys()
        for n, g in grads["none"].items():
            assert torch.allclose(grads[policy][n], g, atol=1e-6, rtol=0), (policy, n)


@torch.no_grad()
@pytest.mark.parametrize("name", CASES)
def test_a_packed_document_has_its_logits_alone(name):
    """attention=document with position_reset: a document in a pack has the logits it has alone (sliding
    layers keep their window inside it); FlexAttention's block mask gives SDPA's dense mask's logits."""
    spec = get_model_spec(CASES[name].preset)
    eos = 0

    def doc(n, seed):
        body = torch.randint(1, spec.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))
        return torch.cat([body, torch.tensor([eos])])

    a, b = doc(9, 1), doc(30, 2)
    plain = build_model(spec, seed=1).eval()
    masked = build_model(spec, seed=1).eval()
    masked.use_document_masking(eos, position_reset=True, flex=False)
    packed = torch.cat([a, b])[None]
    logits = masked.logits(packed)[0]
    assert torch.allclose(logits[len(a):], plain.logits(b[None])[0], atol=1e-5, rtol=0)
    assert not torch.allclose(plain.logits(packed)[0, len(a):], plain.logits(b[None])[0], atol=1e-3)
    flex = build_model(spec, seed=1).eval()
    flex.use_document_masking(eos, position_reset=True, flex=True)
    assert torch.allclose(flex.logits(packed)[0], logits, atol=1e-5, rtol=0)
    if spec.sliding_window:  # and without documents, the window alone: FlexAttention's equals SDPA's
        window_flex = build_model(spec, seed=1).eval()
        window_flex.flex_attention = True
        assert torch.allclose(window_flex.logits(packed), plain.logits(packed), atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_regional_compile_changes_nothing(name):
    spec = get_model_spec(CASES[name].preset)
    x = ids(spec, batch=2, length=32)
    grads = []
    for compiled in (False, True):
        model = build_model(spec, seed=4)
        if compiled:
            model.compile_blocks()
        model(x).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for n in grads[0]:
        assert torch.allclose(grads[0][n], grads[1][n], atol=1e-6, rtol=1e-4), n


# ------------------------------------------------------------------------------------- in real processes

STEPS = ("max_steps=6", "save_steps=3", "save_total_limit=3")
ENV = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
       "TOKENIZERS_PARALLELISM": "false"}


def close(a: float, b: float, rel: float = 1e-5) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-7)


def checkpoint(out: Path, step: int) -> Path:
    return next((out / "checkpoints").glob(f"checkpoint-epoch*-step{step}-files*"))


def launch(out: Path, data: Path, gpus: int, strategy: str, *sets: str):
    cmd = [str(REPO_ROOT / "start_training.sh"), "--config", "demo", "--cpu", "--gpus", str(gpus),
           "--strategy", strategy, "--", "--output-dir", str(out), "--data-dir", str(data)]
    for s in TINY + list(sets):
        cmd += ["--set", s]
    return run(cmd, ENV, timeout=600)


# DDP wraps the whole model whatever its family (one all-reduce of every gradient): one family's 2 DDP ranks prove
# it beside that family's one process (tests/e2e/test_multiprocess.py does for the tiny GPT-NeoX, untied), and this
# one ties its embeddings (one parameter used twice) and scales them. FSDP2 shards each family's blocks and
# embeddings its own way: every family runs it.
DDP_FAMILY = "gemma3"


@pytest.fixture(scope="module", params=list(CASES))
def runs(request, tmp_path_factory):
    """One family's preset through train.py: global batch 4, 6 steps, checkpoints at 3 and 6. fsdp2: 2 FSDP
    ranks (micro 1 x accumulation 2); ddp2 (DDP_FAMILY only): 2 DDP ranks (the same); one: 1 process (micro 2 x
    accumulation 2)."""
    name = request.param
    model = f"model={CASES[name].preset}"
    root = tmp_path_factory.mktemp(name)
    data = make_shards(root / "data")
    out = {"name": name, "model": model, "root": root, "data": data}
    for kind, gpus, strategy in (("fsdp2", 2, "fsdp"), ("ddp2", 2, "ddp")):
        if kind == "ddp2" and name != DDP_FAMILY:
            continue
        out[kind] = root / kind
        launch(out[kind], data, gpus, strategy, model, *STEPS, "per_device_train_batch_size=1",
               "gradient_accumulation_steps=2")
    out["one"] = root / "one"
    run(train_cmd(out["one"], data, model, *STEPS, "per_device_train_batch_size=2", "gradient_accumulation_steps=2"),
        ENV)
    return out


@pytest.mark.slow
def test_one_process_learns_and_ranks_and_strategies_agree(runs):
    one = train_rows(runs["one"])
    others = [train_rows(runs[k]) for k in ("ddp2", "fsdp2") if k in runs]
    assert len(others) == (2 if runs["name"] == DDP_FAMILY else 1)
    assert all(sorted(other) == sorted(one) == list(range(1, 7)) for other in others)
    assert one[6]["loss"] < one[1]["loss"] - 0.1, (one[1]["loss"], one[6]["loss"])  # it learns
    for step in range(1, 7):
        for other in others:
            assert close(other[step]["loss"], one[step]["loss"]), (step, other[step]["loss"], one[step]["loss"])
            assert close(other[step]["grad_norm"], one[step]["grad_norm"]), step


def resumed_at_step_3(runs, source: str, out: Path) -> tuple[str, dict, dict]:
    """The 1-process run's settings resumed from `source`'s step-3 checkpoint into `out`: (its stdout, its rows
    of steps 4-6, the uninterrupted 1-process run's rows)."""
    proc = run(train_cmd(out, runs["data"], runs["model"], *STEPS, "per_device_train_batch_size=2",
                         "gradient_accumulation_steps=2", extra=("--resume", str(checkpoint(runs[source], 3)))), ENV)
    rows = train_rows(out)
    assert sorted(rows) == [4, 5, 6]
    return proc.stdout, rows, train_rows(runs["one"])


@pytest.mark.slow
def test_a_resume_is_bitwise_the_uninterrupted_run(runs, tmp_path):
    """From the 1-process run's step-3 checkpoint: steps 4-6 and the exported weights are bit for bit."""
    from safetensors.torch import load_file

    stdout, rows, expected = resumed_at_step_3(runs, "one", tmp_path / "resumed")
    assert "Resumed from" in stdout
    for step in rows:
        assert rows[step]["loss"] == expected[step]["loss"] and rows[step]["grad_norm"] == expected[step]["grad_norm"]
    a = load_file(str(tmp_path / "resumed" / "final_model" / "model.safetensors"))
    b = load_file(str(runs["one"] / "final_model" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_an_fsdp_checkpoint_resumes_on_one_process(runs, tmp_path):
    stdout, rows, expected = resumed_at_step_3(runs, "fsdp2", tmp_path / "resumed")
    assert "checkpoint written by 2 processes (fsdp), now 1 (ddp)" in stdout
    for step in rows:
        assert close(rows[step]["loss"], expected[step]["loss"]), (step, rows[step], expected[step])


@pytest.mark.slow
def test_the_export_loads_as_its_class_and_tied_embeddings_stay_tied_through_fsdp(runs):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    spec = get_model_spec(CASES[runs["name"]].preset)
    weights = {k: load_file(str(runs[k] / "final_model" / "model.safetensors")) for k in ("one", "fsdp2")}
    assert weights["one"].keys() == weights["fsdp2"].keys()
    engine_names = family(spec.family).hf().from_hf_state(weights["one"])
    assert ("lm_head.weight" in engine_names) != spec.tie_word_embeddings  # tied: one tensor on disk
    for k, v in weights["one"].items():  # (Adam moves a near-zero gradient's weight by up to lr: 3e-3 here)
        assert torch.allclose(weights["fsdp2"][k], v, atol=1e-3, rtol=0), k
    model = AutoModelForCausalLM.from_pretrained(runs["fsdp2"] / "final_model").eval()
    assert type(model) is family(spec.family).hf().causal_lm_class(spec)
    if spec.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    native = build_model(spec, seed=0)
    native.load_state_dict(family(spec.family).hf().from_hf_state(weights["fsdp2"]),
                           strict=not spec.tie_word_embeddings)
    native.tie_weights()
    x = ids(spec, batch=2, length=48)
    with torch.no_grad():
        assert (model(input_ids=x).logits - native.logits(x)).abs().max().item() <= 1e-5


@pytest.mark.slow
def test_fp8_with_document_attention_trains(runs, tmp_path):
    """torchao's float8 training (emulated on the CPU) converts every block matrix whose sides are multiples of
    16 (the family's Muon matrices are its block matrices), with attention=document."""
    pytest.importorskip("torchao")
    spec = get_model_spec(CASES[runs["name"]].preset)
    out = tmp_path / "fp8"
    proc = run(train_cmd(out, runs["data"], runs["model"], "mixed_precision=fp8", "attention=document", "eos_id=0",
                         "max_steps=2", "save_steps=2", "preflight_steps=0", "per_device_train_batch_size=2"),
               ENV | {"NEOX_FP8_EMULATE": "1"})
    eligible = sum(r % 16 == 0 and c % 16 == 0 for r, c in family(spec.family).muon_matrices(spec).values())
    assert re.search(rf"fp8: {eligible * spec.num_hidden_layers} Linear layers run float8 matmuls", proc.stdout), \
        proc.stdout[-2000:]
    assert "attention: document" in proc.stdout
    assert all(math.isfinite(r["loss"]) for r in train_rows(out).values())


@pytest.mark.slow
def test_init_from_an_hf_directory_trains_and_exports_the_same_class(runs, tmp_path):
    """A transformers-written directory of the family (loud weights: its loss is far from a fresh model's)
    starts the run; final_model/ loads as the same transformers class."""
    from transformers import AutoModelForCausalLM

    spec = get_model_spec(CASES[runs["name"]].preset)
    reference = reference_model(spec, seed=6, loud=0.5)
    reference.save_pretrained(tmp_path / "hf")
    out = tmp_path / "from-hf"
    proc = run(train_cmd(out, runs["data"], "max_steps=2", "save_steps=2", f"init_from={tmp_path / 'hf'}",
                         "per_device_train_batch_size=2"), ENV)
    assert f"init_from {tmp_path / 'hf'}: architecture from its config.json" in proc.stdout
    rows = train_rows(out)
    assert train_rows(runs["one"])[1]["loss"] < 7 and rows[1]["loss"] > 8, rows[1]["loss"]
    exported = AutoModelForCausalLM.from_pretrained(out / "final_model")
    assert type(exported) is type(reference)
    assert json.loads((out / "final_model" / "config.json").read_text())["model_type"] == reference.config.model_type


# lm-evaluation-harness scores every family's model in one process (its Python API, as its CLI runs it: the
# `hf` model, the task from --include_path, --log_samples): one start-up of lm-eval and its datasets for all of them
LM_EVAL_ALL = """
import json, sys
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager

models, yamls, out = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
manager = TaskManager(include_path=yamls)
scored = {}
for name, path in models.items():
    got = simple_evaluate(model="hf", model_args=f"pretrained={path},dtype=float32", tasks=["toy_next_line"],
                          task_manager=manager, device="cpu", batch_size=8, log_samples=True)
    rows = sorted(got["samples"]["toy_next_line"], key=lambda r: r["doc_id"])
    scored[name] = {"results": got["results"]["toy_next_line"],
                    "loglikelihoods": [[float(resp[0]) for resp in row["filtered_resps"]] for row in rows]}
with open(out, "w") as f:
    json.dump(scored, f)
"""


@pytest.fixture(scope="module")
def lm_eval_scores(tmp_path_factory):
    """For every family: a toy transformers model (random, confident weights; the demo's tokenizer; for the
    families that have them head_dim other than hidden / heads and a sliding window shorter than the contexts)
    in an HF directory, the toy task, and lm-evaluation-harness's scores of each choice (one lm-eval process)."""
    from tests.conftest import make_subprocess_env
    from utils.data.demo import read_stdlib_corpus, train_tokenizer
    from utils.evals.demo_task import build_next_line_task
    from utils.model.hf import ExportTokenizer

    root = tmp_path_factory.mktemp("lm_eval")
    tokenizer_dir = root / "tokenizer"
    tokenizer_dir.mkdir()
    train_tokenizer(read_stdlib_corpus(300_000)[1], 512).save(str(tokenizer_dir / "tokenizer.json"))
    found = ExportTokenizer.find(tokenizer_dir)
    task = root / "next_line.jsonl"
    build_next_line_task(task, count=24)
    models = {}
    for name in CASES:
        spec = replace(get_model_spec(CASES[name].preset), max_position_embeddings=256)
        hf_tokenizer = found.hf_tokenizer(spec.max_position_embeddings)
        lengths = [len(hf_tokenizer(json.loads(line)["context"])["input_ids"])
                   for line in task.read_text().splitlines()]
        assert min(lengths) > (spec.sliding_window or 0), lengths  # the window is shorter than every context
        reference = reference_model(spec, seed=7, loud=0.3)
        reference.config.update(found.special_ids(hf_tokenizer))
        reference.save_pretrained(root / name)
        hf_tokenizer.save_pretrained(root / name)
        models[name] = str(root / name)
    yamls = root / "lm_eval_tasks"
    yamls.mkdir()
    (yamls / "next_line.yaml").write_text(
        f"task: toy_next_line\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {task}\n"
        f"test_split: test\noutput_type: multiple_choice\ndoc_to_text: \"{{{{context}}}}\"\ndoc_to_choice: choices\n"
        f"doc_to_target: gold\ntarget_delimiter: \"\"\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    env = make_subprocess_env() | {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                                   "HF_HOME": str(root / "hf_home"), "HF_DATASETS_CACHE": str(root / "hf_datasets")}
    run([sys.executable, "-c", LM_EVAL_ALL, json.dumps(models), str(yamls), str(root / "scores.json")], env,
        timeout=900)
    return {"task": task, "models": models, "scores": json.loads((root / "scores.json").read_text())}


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_evaluate_py_equals_lm_evaluation_harness_per_choice(name, lm_eval_scores, tmp_path, subprocess_env):
    """The family's toy model (lm_eval_scores), scored by lm-evaluation-harness and by scripts/evaluate.py:
    equal acc and acc_norm, each choice's log-likelihood within 1e-4."""
    task, model = lm_eval_scores["task"], lm_eval_scores["models"][name]
    results, theirs = lm_eval_scores["scores"][name]["results"], lm_eval_scores["scores"][name]["loglikelihoods"]
    evaluated = run([sys.executable, str(REPO_ROOT / "scripts" / "evaluate.py"), model, "--json",
                     "--batch-size", "5", "--samples", str(tmp_path / "samples.jsonl"), f"--task=next_line={task}"],
                    subprocess_env)
    ours = json.loads(evaluated.stdout)["next_line"]
    mine = [json.loads(line)["loglikelihoods"] for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(mine) == len(theirs) == ours["examples"] == 24
    worst = max(abs(a - b) for m, t in zip(mine, theirs) for a, b in zip(m, t))
    assert worst < 1e-4, worst
    spread = max(abs(a - b) for m in mine for a, b in zip(m, m[1:]))
    assert spread > 1.0, spread  # confident weights: the choices' scores differ, so a wrong mask would show
    for metric in ("acc", "acc_norm"):
        assert ours[metric] == results[f"{metric},none"], metric


# --------------------------------------------------------------------------- what one family has of its own

def test_llama3_rope_scaling_equals_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from utils.model.common.rotary import spec_inv_freq

    spec = get_model_spec("llama-3.2-1b")
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](family("llama").hf().hf_config(spec))
    assert torch.allclose(spec_inv_freq(spec), theirs, rtol=1e-6, atol=0)
    assert not torch.allclose(spec_inv_freq(replace(spec, rope_scaling=())), theirs)  # the scaling does something


def test_a_spec_setting_a_field_its_family_does_not_read_is_refused():
    with pytest.raises(ConfigError, match="'tiny': the gpt_neox family has no sliding_window"):
        build_model(replace(get_model_spec("tiny"), sliding_window=8, layer_types=("sliding", "full")), seed=0)
    with pytest.raises(ConfigError, match="qk_norm"):
        build_model(replace(get_model_spec("qwen3-tiny"), qk_norm=False), seed=0)
    # GPT-NeoX's native block takes QK-norm, but transformers' GPTNeoXForCausalLM cannot hold it: no export
    spec = replace(get_model_spec("tiny"), qk_norm=True)
    plain = build_model(get_model_spec("tiny"), seed=0)
    assert len(build_model(spec, seed=0).state_dict()) == len(plain.state_dict()) + 8  # 2 layers x q, k x w, b
    with pytest.raises(ConfigError, match="qk_norm has no place in transformers' GPTNeoXForCausalLM"):
        to_transformers(build_model(spec, seed=0).state_dict(), spec)
