"""Presets, --set overrides, config files, --help, trackers, and their errors."""
import re
import sys

import pytest
import yaml

from configs import PRESETS, ConfigError, get_model_spec, get_training_config, parse_overrides


def test_presets_exist_and_validate():
    assert set(PRESETS) == {"cpu", "demo", "test", "production"}
    for name in PRESETS:
        assert get_training_config(name).preset == name


def test_presets_are_the_yaml_files_and_print_config_round_trips(tmp_path, capsys):
    """configs/presets/NAME.yaml is the preset (one copy); `--print-config` output, loaded back with
    `--config`, prints the same text for every preset, and a field in the file reaches the preset."""
    import train
    from configs.training_config import PRESET_DIR

    assert sorted(p.stem for p in PRESET_DIR.glob("*.yaml")) == sorted(PRESETS)
    for name in PRESETS:
        assert train.main(["--config", name, "--print-config"]) == 0
        printed = capsys.readouterr().out
        path = tmp_path / f"{name}.yaml"
        path.write_text(printed)
        assert train.main(["--config", str(path), "--print-config"]) == 0
        assert capsys.readouterr().out == printed, name
        assert yaml.safe_load(printed)["preset"] == name
    demo = yaml.safe_load((PRESET_DIR / "demo.yaml").read_text())
    assert PRESETS["demo"].learning_rate == demo["learning_rate"] and PRESETS["demo"].model == demo["model"]


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
    ({"model": "gpt-5"}, "valid models: demo, .*gpt-neox-1.2b"),
    ({"max_steps": 0}, "max_steps=0 must be at least 1"),
    ({"seq_len": 4096}, "exceeds model"),
    ({"gcs_bucket": "gs://b/x"}, "bare bucket name"),
    ({"learning_rate": 1e30}, r"learning_rate=1e\+30 must be a finite number within \(0, 1e12\]"),
    ({"weight_decay": 1e30}, r"weight_decay=1e\+30 must be a finite number within \[0, 100\]"),
    ({"seq_len": 1}, r"seq_len=1 must be at least 2, or 0 \(the model's positions, at most its context before "
                     r"rope scaling and 8192\)"),
    ({"spike_guard": "rollback", "spike_patience": 9, "spike_window": 8},
     "spike_patience=9 exceeds spike_window=8: that many spikes never fall within the window"),
])
def test_bad_values(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment):
        get_training_config("demo", overrides)


def test_unknown_preset_lists_valid():
    with pytest.raises(ConfigError, match="valid configs: cpu, demo, production, test"):
        get_training_config("prod")


# ------------------------------------------------------------------------------- config files, --help

def test_config_file_starts_from_a_base_preset(tmp_path):
    from configs.settle import settle_config

    path = tmp_path / "my.yaml"
    path.write_text("base: demo\nlearning_rate: 5.0e-4\nsave_steps: 7\nreport_to: [tensorboard, mlflow]\n")
    cfg, profile = settle_config(str(path), ["save_steps=9"], {"max_steps": 11}, device=("cpu", None))
    demo = get_training_config("demo")
    assert (cfg.learning_rate, cfg.save_steps, cfg.max_steps) == (5e-4, 9, 11)  # file, then --set, then flags
    assert cfg.report_to == "tensorboard,mlflow" and cfg.model == demo.model and cfg.preset == str(path)
    assert profile is None
    (tmp_path / "c.json").write_text('{"model": "tiny", "compile_model": false}')
    cfg, _ = settle_config(str(tmp_path / "c.json"), [], {}, device=("cpu", None))
    assert cfg.model == "tiny" and cfg.compile_model is False and cfg.warmup_steps == 500  # field defaults


def test_a_bare_no_for_mixed_precision_in_a_config_file_is_fp32(tmp_path):
    """YAML reads `mixed_precision: no` as false: it was refused naming a value 'off' the user never wrote."""
    path = tmp_path / "fp32.yaml"
    path.write_text("base: demo\nmixed_precision: no\n")
    assert get_training_config(str(path)).mixed_precision == "no"
    path.write_text("base: demo\nmixed_precision: yes\n")  # issue 41: it said "got True" and nothing valid
    with pytest.raises(ConfigError, match=r"fp32.yaml: mixed_precision is true \(YAML reads a bare yes, true or on "
                                          r"so\), which names no precision; use one of bf16, fp16, fp8, no$"):
        get_training_config(str(path))
    get_training_config("demo", {"spike_guard": "warn", "spike_patience": 9, "spike_window": 8})  # not rollback


def test_a_bare_off_in_a_config_file_is_the_choice_off(tmp_path):
    """YAML reads `off` as false: `profile: off` and `spike_guard: off` were refused as 'False'."""
    path = tmp_path / "off.yaml"
    path.write_text("base: demo\nprofile: off\nspike_guard: off\n")
    cfg = get_training_config(str(path))
    assert (cfg.profile, cfg.spike_guard) == ("off", "off")
    with pytest.raises(ConfigError, match="spike_guard='sometimes' is not valid; use one of off, warn, skip, rollback"):
        get_training_config("demo", {"spike_guard": "sometimes"})


@pytest.mark.parametrize("text, fragment", [
    ("learning_rte: 1e-3\n", "unknown training-config field 'learning_rte'; did you mean 'learning_rate'?"),
    ("base: prod\n", "base 'prod' is not a preset"),
    ("save_steps: ten\n", "expected a value of type int for save_steps"),
    ("- a\n- b\n", "expected a mapping of field: value"),
    ("a: [1,\n", "not valid YAML"),
    # issue 41: YAML's non-plain types reached a field as their text (run_name: b'hello')
    ("base: demo\nrun_name: !!binary aGVsbG8=\n", "line 2: !!binary (bytes) is not a plain value; write a string,"),
    ("base: demo\nrun_name: 2024-01-01\n", "line 2: !!timestamp (a date) is not a plain value; write a string"),
    ("base: demo\nsample_prompts: !!set {a, b}\n", "line 2: !!set (a set) is not a plain value"),
])
def test_config_file_errors_name_the_file(tmp_path, text, fragment):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(fragment)) as info:
        get_training_config(str(path))
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_an_integer_past_int64_is_one_short_line():
    """--set max_steps=<400 digits> (an OverflowError traceback at the first float of it) and a config file's
    own: refused at once, the value's length said rather than the value; 2^63 - 1 is taken."""
    digits = "9" * 400
    with pytest.raises(ConfigError) as e:
        parse_overrides([f"max_steps={digits}"])
    assert str(e.value) == f"--set max_steps={digits[:67]}...: max_steps must be below 2^63, got a number of 400 digits"
    assert parse_overrides([f"max_steps={2**63 - 1}"]) == {"max_steps": 2**63 - 1}
    with pytest.raises(ConfigError, match="seed must be below 2\\^63, got a number of 20 digits"):
        parse_overrides([f"seed=-{2**64}"])


def test_typo_in_set_suggests_the_field():
    with pytest.raises(ConfigError, match="did you mean 'save_steps'"):
        parse_overrides(["save_step=5"])
    with pytest.raises(ConfigError, match="did you mean 'production'"):
        get_training_config("prodution")


@pytest.mark.slow
def test_config_file_trains_print_config_and_help(tmp_path, subprocess_env):
    from tests.trainkit import REPO_ROOT, make_shards, run, train_rows

    data = make_shards(tmp_path / "data")
    path = tmp_path / "my.yaml"
    path.write_text(f"base: demo\nmax_steps: 3\nlearning_rate: 1.0e-3\nmodel: tiny\ncompile_model: false\n"
                    f"dataloader_num_workers: 0\nval_files: 1\ndata_dir: {data}\n")
    base = [sys.executable, str(REPO_ROOT / "train.py"), "--config", str(path)]
    shown = run(base + ["--print-config", "--set", "save_steps=2"], subprocess_env)
    printed = yaml.safe_load(shown.stdout)
    assert printed["max_steps"] == 3 and printed["learning_rate"] == 1e-3 and printed["save_steps"] == 2
    assert printed["model"] == "tiny" and printed["per_device_train_batch_size"] == 16  # from base: demo
    out = tmp_path / "out"
    run(base + ["--output-dir", str(out)], subprocess_env)
    rows = train_rows(out)
    assert max(rows) == 3 and 0 < rows[3]["lr"] < 1e-3  # warmup: base demo's warmup_steps
    help_text = run(base[:2] + ["--help"], subprocess_env).stdout
    for name in ("learning_rate", "report_to", "model_impl", "upload_timeout_s"):
        assert re.search(rf"^  {name}\s+\w+\s+\S+", help_text, re.M), name


def test_tensorboard_holds_the_config_and_the_scalars(tmp_path, subprocess_env):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.trainkit import make_shards, run, train_cmd

    data = make_shards(tmp_path / "data")
    out = tmp_path / "out"
    run(train_cmd(out, data, "max_steps=4", "logging_steps=2", "save_steps=100", "report_to=tensorboard",
                  "per_device_train_batch_size=4"), subprocess_env)
    scalars, hparams = {}, {}
    for events in (out / "logs" / "tensorboard").rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events.parent))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            scalars[tag] = [(e.step, e.value) for e in acc.Scalars(tag)]
    for path in (out / "logs" / "tensorboard").rglob("hparams.yml"):
        hparams |= yaml.safe_load(path.read_text())
    assert [s for s, _ in scalars["train/loss"]] == [2, 4]
    assert [s for s, _ in scalars["by_tokens/train/loss"]] == [2 * 4 * 64, 4 * 4 * 64]  # tokens seen
    assert "eval/val_loss" in scalars and "train/tokens_per_sec" in scalars
    assert hparams["model"] == "tiny" and hparams["max_steps"] == 4 and hparams["report_to"] == "tensorboard"
    assert set(get_training_config("demo").to_dict()) <= set(hparams)  # the full resolved config


def test_a_resume_keeps_the_recipe_its_run_started_with_unless_the_command_sets_it(tmp_path):
    """keep_recipe: the checkpoint's optimizer, rate, schedule and loss where the command did not set them and
    the run started from the same preset; the command's own fields follow; another preset keeps nothing; a
    value of the checkpoint's config is checked as a config file's is, naming the checkpoint."""
    from configs.settle import explicit_fields
    from configs.training_config import keep_recipe

    now = get_training_config("demo")
    other = "muon" if now.optimizer == "adamw" else "adamw"
    saved = now.to_dict() | {"optimizer": other, "learning_rate": 0.0123, "weight_decay": 0.05, "max_steps": 77,
                             "eval_interval": 3}
    kept, line = keep_recipe(now, saved, explicit_fields("demo", ["weight_decay=0.2"], {"max_steps": None}),
                             "checkpoint c: trainer_state.json")
    assert (kept.optimizer, kept.learning_rate, kept.max_steps) == (other, 0.0123, 77)
    assert kept.weight_decay == now.weight_decay  # set by the command: not the checkpoint's
    assert kept.eval_interval == now.eval_interval  # not part of the recipe
    assert line.startswith(f"resume: the run continues the recipe it started with (optimizer={other}, "
                           f"learning_rate=0.0123, max_steps=77); 'demo' now says optimizer={now.optimizer}")
    assert keep_recipe(now, now.to_dict(), frozenset(), "c") == (now, None)
    assert keep_recipe(now, saved | {"preset": "cpu"}, frozenset(), "c") == (now, None)
    # a config file's own fields are the command's; the ones its base preset gives are not
    path = tmp_path / "mine.yaml"
    path.write_text("base: demo\nlearning_rate: 0.001\n")
    assert explicit_fields(str(path), [], {"max_steps": 9, "data_dir": None}) == {"learning_rate", "max_steps"}
    mine = get_training_config(str(path))
    kept, _ = keep_recipe(mine, mine.to_dict() | {"learning_rate": 0.5, "adam_beta2": 0.9},
                          explicit_fields(str(path), [], {}), "c")
    assert (kept.learning_rate, kept.adam_beta2) == (0.001, 0.9)
    with pytest.raises(ConfigError, match=r"checkpoint c: trainer_state.json: .*learning_rate"):
        keep_recipe(now, saved | {"learning_rate": "fast"}, frozenset(), "checkpoint c: trainer_state.json")
    with pytest.raises(ConfigError, match=r"^checkpoint c: optimizer='sgd' is not valid.*corrupt or crafted"):
        keep_recipe(now, saved | {"optimizer": "sgd"}, frozenset(), "checkpoint c")


def test_a_record_of_an_earlier_engine_resumes_its_recipe_and_every_field_read_back_is_checked():
    """A record lacking a field an earlier engine did not have (its `optimizer`: the demo preset trained AdamW at
    2e-3 then, Muon at 8e-3 now) continues what that engine trained with (FIELDS_ADDED), then today's keep-or-set
    rule; every field a resume reads back is checked as a setting, ranges included, whether or not the command
    sets it (`max_steps=-5` with `--max-steps 8`), each one line naming the checkpoint; a whole record lacking a
    field every engine wrote is refused."""
    from configs.training_config import RECORDED_FIELDS, keep_recipe

    now = get_training_config("demo")
    assert (now.optimizer, now.learning_rate) == ("muon", 0.008)
    old = {k: v for k, v in now.to_dict().items()
           if k not in ("optimizer", "muon_momentum", "muon_scale", "cautious_weight_decay", "z_loss")}
    old["learning_rate"] = 0.002
    kept, line = keep_recipe(now, old, frozenset({"max_steps"}), "checkpoint c: trainer_state.json")
    assert (kept.optimizer, kept.learning_rate, kept.z_loss) == ("adamw", 0.002, 0.0)
    assert line.startswith("resume: the run continues the recipe it started with (optimizer=adamw, "
                           "learning_rate=0.002); 'demo' now says optimizer=muon, learning_rate=0.008")
    assert keep_recipe(now, old, frozenset({"optimizer", "learning_rate"}), "c") == (now, None)  # set: followed
    crafted = {"max_steps": (-5, "max_steps=-5 must be at least 1"),
               "optimizer": (123, "optimizer='123' is not valid"),
               "learning_rate": (float("nan"), "learning_rate must be a finite number, got nan"),
               "decay_fraction": (1e308, "decay_fraction=1e+308 must be a finite number within [0, 1]"),
               "z_loss": (5, "z_loss=5.0 must be a finite number within [0, 1]"),
               "muon_momentum": (7, "muon_momentum=7.0 must be a finite number within [0, 1)"),
               "lr_schedule": ("bogus", "lr_schedule='bogus' is not valid"),
               "seed": ("x", "expected a value of type int for seed, got 'x'")}
    for field, (value, said) in crafted.items():
        with pytest.raises(ConfigError) as refused:
            keep_recipe(now, old | {field: value}, frozenset({"max_steps"}), "checkpoint c: trainer_state.json")
        message = str(refused.value)
        assert message.startswith("checkpoint c: trainer_state.json: ") and said in message, message
        assert message.endswith("the checkpoint is corrupt or crafted: resume from another one"), message
    assert {"seed", "optimizer_state_dtype", "max_grad_norm", "max_steps"} <= set(RECORDED_FIELDS)
    with pytest.raises(ConfigError, match=r"^c: learning_rate is missing, which every engine records"):
        keep_recipe(now, {k: v for k, v in old.items() if k != "learning_rate"}, frozenset(), "c")


def test_each_field_an_earlier_engine_lacked_appeared_when_and_as_the_table_says():
    """FIELDS_ADDED against the repository's history: each field is absent from the config of the commit before
    the one named and present in it with that default (model_impl's was the native model it came with; the
    engines before built transformers' class); every other field a resume reads back was in the first engine's
    config (dfae064). Skipped in a clone without the history."""
    import ast
    import subprocess

    from configs.training_config import FIELDS_ADDED, RECORDED_FIELDS
    from tests.trainkit import REPO_ROOT

    def config_at(commit: str) -> str:
        shown = subprocess.run(["git", "-C", str(REPO_ROOT), "show", f"{commit}:configs/training_config.py"],
                               capture_output=True, text=True)
        if shown.returncode != 0:
            pytest.skip(f"needs the repository's history (git show {commit})")
        return shown.stdout

    def default(text: str, field: str):
        match = re.search(rf"^    {field}: \w+ = (?:_field\()?\s*([^,)#\n]+)", text, re.M)
        return None if match is None else ast.literal_eval(match[1].strip())

    first = config_at("dfae064")
    for field in RECORDED_FIELDS:
        if field not in FIELDS_ADDED:
            assert default(first, field) is not None, field
    for field, (commit, before) in FIELDS_ADDED.items():
        assert default(config_at(f"{commit}^"), field) is None, (field, commit)
        assert default(config_at(commit), field) == {"model_impl": "native"}.get(field, before), (field, commit)
    model_before = subprocess.run(["git", "-C", str(REPO_ROOT), "show", f"{FIELDS_ADDED['model_impl'][0]}^:"
                                   "utils/model/__init__.py"], capture_output=True, text=True).stdout
    assert "GPTNeoXForCausalLM(" in model_before  # transformers' class: model_impl=hf


def test_a_settings_warning_is_the_configs_to_print_once_it_is_decided():
    """warmup_steps beyond max_steps: a line from `warnings()`, printed by the run once it has decided its
    values (not by each settling or validation of the config: a resume validates twice)."""
    cfg = get_training_config("demo", {"max_steps": 10, "warmup_steps": 50})
    assert cfg.warnings() == ["warning: warmup_steps=50 exceeds max_steps=10: the learning rate never reaches "
                              "learning_rate=0.008; lower warmup_steps"]
    assert get_training_config("demo", {"max_steps": 100, "warmup_steps": 50}).warnings() == []
