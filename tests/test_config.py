"""Presets, --set overrides and their errors."""
import pytest

from configs import ConfigError, PRESETS, get_model_spec, get_training_config, parse_overrides


def test_presets_exist_and_validate():
    assert set(PRESETS) == {"demo", "test", "production"}
    for name in PRESETS:
        assert get_training_config(name).preset == name


def test_production_preset_is_the_seeds():
    cfg = get_training_config("production")
    assert (cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps) == (4, 4)
    assert cfg.mixed_precision == "bf16" and cfg.compile_model and cfg.warmup_steps > 0
    test = get_training_config("test")
    assert test.max_files == 5 and test.model == "gpt-neox-1.2b"


def test_model_1p2b_architecture():
    spec = get_model_spec("gpt-neox-1.2b")
    assert (spec.hidden_size, spec.num_hidden_layers, spec.num_attention_heads) == (2048, 24, 16)
    assert (spec.intermediate_size, spec.max_position_embeddings, spec.rotary_pct) == (8192, 2048, 0.25)
    assert spec.use_parallel_residual and spec.vocab_size == 50257 and spec.padded_vocab_size == 50304


def test_set_overrides_are_typed():
    o = parse_overrides(["model=tiny", "save_steps=5", "compile_model=false", "learning_rate=1e-3"])
    assert o == {"model": "tiny", "save_steps": 5, "compile_model": False, "learning_rate": 1e-3}
    cfg = get_training_config("production", o)
    assert cfg.model == "tiny" and cfg.save_steps == 5 and cfg.compile_model is False


@pytest.mark.parametrize("pairs, fragment", [
    (["no_such_key=1"], "unknown training-config field"),
    (["save_steps=abc"], "expected a value of type int"),
    (["compile_model=maybe"], "expected a value of type bool"),
    (["save_steps"], "expected KEY=VALUE"),
])
def test_bad_overrides(pairs, fragment):
    with pytest.raises(ConfigError, match=fragment):
        parse_overrides(pairs)


@pytest.mark.parametrize("overrides, fragment", [
    ({"mixed_precision": "fp4"}, "use one of bf16, fp16, fp8, no"),
    ({"model": "gpt-5"}, "valid models: demo, gpt-neox-1.2b"),
    ({"max_steps": 0}, "max_steps=0 must be at least 1"),
    ({"seq_len": 4096}, "exceeds model"),
    ({"gcs_bucket": "gs://b/x"}, "bare bucket name"),
])
def test_bad_values(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment):
        get_training_config("demo", overrides)


def test_unknown_preset_lists_valid():
    with pytest.raises(ConfigError, match="valid configs: demo, test, production"):
        get_training_config("prod")
