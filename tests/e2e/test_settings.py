"""Settings: numbers that cannot train are refused from their declared
ranges; a resume follows the settings it is given (or refuses them); mixtures refuse sources they cannot mix
(another tokenizer, a name given twice, an empty folder under the demo) and a source deleted between runs can
be dropped; a config file's advice, run name and precision read right. Numbers are typed through train.py as
a user types them; the rest in-process where the code is a function."""
from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from configs.model_config import ConfigError
from configs.training_config import TrainingConfig, get_training_config, parse_overrides, read_config_file
from tests.trainkit import REPO_ROOT, TINY, load_weights, make_shards, run, tiny_hf_model, train_cmd, train_rows


def one_error_line(proc) -> str:
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, proc.stderr
    return lines[0]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return make_shards(tmp_path_factory.mktemp("settings") / "data", n_files=3, rows=16)


# ------------------------------------------------------------------------- 5: numbers that cannot train

@pytest.mark.parametrize("setting, rule", [
    ("learning_rate=nan", "--set learning_rate=nan: learning_rate must be a finite number, got nan"),
    ("adam_beta2=1.5", "adam_beta2=1.5 must be a finite number within [0, 1)"),
    ("adam_eps=-1", "adam_eps=-1.0 must be a finite number within (0, 1]"),
    ("max_grad_norm=-1", "max_grad_norm=-1.0 must be a finite number within [0, 1e6]"),
    # issue 41: every loss term and coefficient has a range (z_loss=1e30 trained to loss=0.0000 and exported)
    ("z_loss=1e30", "z_loss=1e+30 must be a finite number within [0, 1]"),
    ("adam_eps=10", "adam_eps=10.0 must be a finite number within (0, 1]"),
    ("max_grad_norm=1e30", "max_grad_norm=1e+30 must be a finite number within [0, 1e6]"),
    ("spike_threshold=1e9", "spike_threshold=1000000000.0 must be a finite number within (0, 1000]"),
])
def test_numbers_that_cannot_train_are_one_line_through_train_py(tmp_path, subprocess_env, shards, setting, rule):
    proc = run(train_cmd(tmp_path / "out", shards, setting, "max_steps=2"), subprocess_env, check=False)
    assert one_error_line(proc) == f"error: {rule}"
    assert not (tmp_path / "out" / "final_model").exists()


def test_every_number_has_a_declared_range_and_each_bound_is_enforced():
    """The one loop in validate() checks each numeric field against the range declared beside it: a value
    past either end (and nan, and inf for a float) is refused naming the field; the bounds themselves pass."""
    numeric = [f for f in fields(TrainingConfig) if f.type in ("int", "float")]
    assert len(numeric) > 25
    for f in numeric:
        bounds = f.metadata.get("bounds")
        assert bounds is not None, f"{f.name} declares no range"
        outside = [bounds.low - 1 if bounds.low_closed else bounds.low]
        if bounds.high != math.inf:
            outside.append(bounds.high + 1 if bounds.high_closed else bounds.high)
        if f.type == "float":
            outside += [math.nan, math.inf]
        for value in outside:
            if value in bounds.special:
                continue
            value = int(value) if f.type == "int" else value
            with pytest.raises(ConfigError, match=rf"^{f.name}=\S+ must be ") as e:
                get_training_config("demo", {f.name: value})
            assert "\n" not in str(e.value)
        if f.name in ("seq_len", "sample_every"):
            continue  # limited by the model's positions / needs sample_prompts
        inside = bounds.low if bounds.low_closed else bounds.low + (1 if f.type == "int" else 0.5)
        get_training_config("demo", {f.name: int(inside) if f.type == "int" else inside})
    assert get_training_config("demo", {"max_files": -1}).max_files == -1  # a meaning of its own


@pytest.mark.slow
def test_max_grad_norm_zero_is_no_clipping_and_the_norm_is_still_logged(tmp_path, subprocess_env, shards):
    """max_grad_norm=0 trains exactly as a norm too large to clip (it zeroed every gradient before); the
    norm is logged either way (two runs, 10 s)."""
    sets = ("max_steps=3", "save_steps=100")
    runs = {}
    for norm in ("0", "1e6"):  # 1e6: the largest norm it takes (issue 41), far above this toy run's
        out = tmp_path / norm
        run(train_cmd(out, shards, *sets, f"max_grad_norm={norm}"), subprocess_env)
        runs[norm] = (train_rows(out), load_weights(out / "final_model" / "model.safetensors"))
    (zero, w0), (huge, w1) = runs["0"], runs["1e6"]
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    assert [zero[s]["loss"] for s in (1, 2, 3)] == [huge[s]["loss"] for s in (1, 2, 3)]
    assert zero[3]["loss"] < zero[1]["loss"] - 0.05 and all(zero[s]["grad_norm"] > 0 for s in (1, 2, 3))


def test_a_non_finite_loss_in_fp32_says_fp32_and_does_not_advise_fp32(tmp_path, subprocess_env, shards):
    proc = run(train_cmd(tmp_path / "out", shards, "learning_rate=1e12", "warmup_steps=0", "max_grad_norm=0",
                         "max_steps=6", "logging_steps=3", "save_steps=100"), subprocess_env, check=False)
    line = one_error_line(proc)
    assert "non-finite loss at step" in line and "(fp32 precision)" in line and "learning_rate" in line
    assert "--mixed-precision" not in line
    assert "fp32 precision, compile=off" in proc.stdout and "no precision" not in proc.stdout + proc.stderr


def huge_head_model(path: Path) -> Path:
    """A tiny HF GPT-NeoX whose head is 1e20 times too large: a finite loss (about 1e20), and a gradient norm
    past what fp32 holds at the first step."""
    from safetensors.torch import load_file, save_file

    tiny_hf_model(path)
    weights = load_file(str(path / "model.safetensors"))
    weights["embed_out.weight"] *= 1e20
    save_file(weights, str(path / "model.safetensors"))
    return path


def test_a_non_finite_gradient_norm_stops_the_run_as_a_non_finite_loss_does(tmp_path, subprocess_env, shards):
    """init_from a model whose head is 1e20 times too large: the loss stays finite (about 1e20) but the gradient
    norm overflows fp32 at step 1. The run stops in one line naming the step, exit 2, nothing saved or exported,
    as for a non-finite loss (real train.py); it trained on with grad_norm null (clipping zeroed each update)
    and exported."""
    model = huge_head_model(tmp_path / "huge-head")
    out = tmp_path / "out"
    proc = run(train_cmd(out, shards, f"init_from={model}", "max_steps=3", "save_steps=1"), subprocess_env, check=False)
    line = one_error_line(proc)
    assert re.fullmatch(r"error: non-finite gradient norm \(its loss \d\.\d+e\+\d\d\) at step 1 \(fp32 precision\); no "
                        r"checkpoint was written for it\. .*", line), line
    assert not (out / "checkpoints").exists() or not list((out / "checkpoints").iterdir())
    assert not (out / "final_model").exists()


# ------------------------------------------------------------------------------ 6: settings on resume

def test_a_restored_scheduler_and_optimizer_follow_this_runs_config():
    """The schedule is rebuilt from the config at the restored step (not the checkpoint's base LR), AdamW's
    hyperparameters are the config's, and bf16 moments stay bf16 through a restore."""
    from utils.training.lr_scheduler import build_scheduler
    from utils.training.optim import OptimizerSettings, build_optimizer
    from utils.training.optim.adamw import BF16MomentAdamW
    from utils.training.schedules import ScheduleSettings

    base = {"model": "tiny", "optimizer": "adamw", "warmup_steps": 2, "max_steps": 10}
    old = get_training_config("demo", base)
    new = get_training_config("demo", base | {"learning_rate": 1e-9})
    model = torch.nn.Linear(4, 4)
    opt = build_optimizer(model, OptimizerSettings.of(old), fused=False)
    sched = build_scheduler(opt, ScheduleSettings.of(old))
    for _ in range(3):
        model(torch.ones(1, 4)).sum().backward()
        opt.step()
        sched.step()
    opt2 = build_optimizer(torch.nn.Linear(4, 4), OptimizerSettings.of(new), fused=False)
    sched2 = build_scheduler(opt2, ScheduleSettings.of(new))
    opt2.load_state_dict(opt.state_dict())
    sched2.load_state_dict(sched.state_dict())
    new_lr, old_lr = ScheduleSettings.of(new).lr, ScheduleSettings.of(old).lr
    assert [g["lr"] for g in opt2.param_groups] == [new_lr(4)] * 2 and new_lr(4) < old_lr(4) * 1e-5
    opt2.step()
    sched2.step()
    assert [g["lr"] for g in opt2.param_groups] == sched2.get_last_lr() == [new_lr(5)] * 2

    half = get_training_config("demo", {"model": "tiny", "optimizer": "adamw", "optimizer_state_dtype": "bf16"})
    bf16 = build_optimizer(torch.nn.Linear(4, 4), OptimizerSettings.of(half), fused=False)
    assert isinstance(bf16, BF16MomentAdamW)
    bf16.load_state_dict(opt.state_dict())  # torch's AdamW (fp32 moments) -> bf16 moments
    assert {s["exp_avg"].dtype for s in bf16.state.values()} == {torch.bfloat16}
    again = build_optimizer(torch.nn.Linear(4, 4), OptimizerSettings.of(half), fused=False)
    again.load_state_dict(bf16.state_dict())
    assert {s["exp_avg_sq"].dtype for s in again.state.values()} == {torch.bfloat16}


@pytest.mark.slow
def test_a_resume_applies_a_changed_learning_rate_and_refuses_another_seed(tmp_path, subprocess_env, shards):
    """2 steps, stop; --resume with learning_rate=1e-9 (and adam_beta2=0.9): one line each says so, the rows'
    lr is the new schedule's, the optimizer really used it (its saved LR and betas; the weights barely move)
    and nothing else changed. Another seed is refused in one line (13 s)."""
    from safetensors.torch import load_file

    from utils.training.schedules import ScheduleSettings

    out = tmp_path / "out"
    sets = ("max_steps=4", "save_steps=100")
    run(train_cmd(out, shards, *sets, "stop_at_step=2"), subprocess_env)
    proc = run(train_cmd(out, shards, *sets, "seed=7", extra=("--resume", "latest")), subprocess_env, check=False)
    assert "was trained with seed=42 but this run has seed=7" in one_error_line(proc)

    changed = ("learning_rate=1e-9", "adam_beta2=0.9")
    proc = run(train_cmd(out, shards, *sets, *changed, extra=("--resume", "latest")), subprocess_env)
    assert "resume: learning_rate changed 0.003 -> 1e-09: the LR schedule follows the new value from step 3" \
        in proc.stdout
    assert "resume: adam_beta2 changed 0.95 -> 0.9: AdamW follows the new value from step 3" in proc.stdout
    assert proc.stdout.count("resume: ") == 2
    schedule = ScheduleSettings.of(get_training_config("demo", parse_overrides(TINY + list(sets + changed)))).lr
    rows = train_rows(out)
    assert [rows[s]["lr"] for s in (3, 4)] == [schedule(3), schedule(4)]
    final = next((out / "checkpoints").glob("checkpoint-*-step4-*"))
    assert torch.load(final / "scheduler.pt", weights_only=True)["_last_lr"][0] == schedule(5)
    groups = torch.load(final / "optimizer.pt", weights_only=True)["param_groups"]
    assert [tuple(g["betas"]) for g in groups] == [(0.9, 0.9)] * 2 and groups[0]["eps"] == 1e-8
    before = load_file(str(next((out / "checkpoints").glob("checkpoint-*-step2-*")) / "model.safetensors"))
    after = load_file(str(final / "model.safetensors"))
    moved = max((after[k] - before[k]).abs().max().item() for k in before)
    assert 0 < moved < 1e-6  # two AdamW steps at ~1e-9 (at 3e-3 they move weights by ~1e-3)


# ----------------------------------------------------------------- 7, 8, 15: mixtures, config files

def write_dataset_json(folder: Path, vocab: int = 512, eos: int = 0, tokenizer_sha256: str = "a" * 64) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "dataset.json").write_text(json.dumps({
        "format": "gpt-neox-shards", "version": 1, "tokenizer": {"file": "tokenizer.json", "vocab_size": vocab,
                                                                 "eos_id": eos, "sha256": tokenizer_sha256},
        "dtype": "uint16", "documents": 1, "tokens": 1, "shards": []}))
    return folder


def test_sources_with_different_tokenizers_of_one_size_are_refused_and_one_without_dataset_json_is_named(tmp_path):
    from utils.data.dataset_info import DatasetInfo
    from utils.data.mixture import MixtureError, check_tokenizers

    web = DatasetInfo.load(write_dataset_json(tmp_path / "web"))
    code = DatasetInfo.load(write_dataset_json(tmp_path / "code", tokenizer_sha256="b" * 64))
    same = DatasetInfo.load(write_dataset_json(tmp_path / "same"))
    warned = []
    with pytest.raises(MixtureError) as e:
        check_tokenizers({"web": web, "code": code}, warned.append)
    assert "sources web and code were prepared with different tokenizers" in str(e.value)
    assert str(web.path) in str(e.value) and str(code.path) in str(e.value) and "\n" not in str(e.value)
    check_tokenizers({"web": web, "plain": None, "same": same, "raw": None}, warned.append)
    assert len(warned) == 1 and "plain, raw have no dataset.json" in warned[0] and str(web.path) in warned[0]
    check_tokenizers({"web": web, "same": same}, warned.append)
    check_tokenizers({"plain": None, "raw": None}, warned.append)  # nothing to check against: nothing said
    assert len(warned) == 1


def test_a_source_named_twice_is_refused_naming_it(tmp_path):
    with pytest.raises(ConfigError, match="data_mix names source 'a' twice"):
        parse_overrides(["data_mix=a=/x:1,a=/y:1"])
    path = tmp_path / "mix.yaml"
    path.write_text("base: demo\ndata_mix:\n  a: {path: /x, weight: 1}\n  a: {path: /y, weight: 1}\n")
    with pytest.raises(ConfigError, match=re.escape(f"--config {path}: line 4: key 'a' appears twice")):
        read_config_file(path)
    path.write_text("base: demo\nlearning_rate: 1.0e-3\nlearning_rate: 2.0e-3\n")
    with pytest.raises(ConfigError, match="key 'learning_rate' appears twice"):
        read_config_file(path)
    json_path = tmp_path / "mix.json"
    json_path.write_text('{"model": "tiny", "model": "demo"}')
    with pytest.raises(ConfigError, match="key 'model' appears twice"):
        read_config_file(json_path)


def test_a_windows_path_keeps_its_drive_colon():
    mix = parse_overrides([r"data_mix=web=C:\data\web:0.7,code=D:\code:0.3:2"])["data_mix"]
    assert mix == {"web": {"path": r"C:\data\web", "weight": 0.7},
                   "code": {"path": r"D:\code", "weight": 0.3, "epochs": 2}}
    with pytest.raises(ConfigError, match=re.escape(r"data_mix item 'web=C:\data': the weight must be a number "
                                                    r"after the path's last ':'")):
        parse_overrides([r"data_mix=web=C:\data"])


def test_the_demo_never_fills_an_empty_source_folder(tmp_path, subprocess_env, shards):
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = run(train_cmd(tmp_path / "out", shards, f"data_mix=mine={shards}:1,extra={empty}:1", "max_steps=1"),
               subprocess_env, check=False)
    line = one_error_line(proc)
    assert f"data_mix source extra: {empty} holds no .npz shards" in line and "data_dir only" in line
    assert not any(empty.iterdir())


def test_a_deleted_source_can_be_dropped_on_resume(tmp_path):
    """A mixture checkpoint resumed without one of its sources: the source is dropped (said in the log line
    that lists the changes), the kept one continues from its saved position. A missing folder says what to
    do, pointing at the drop; a mixture keeping none of the checkpoint's sources is refused."""
    from utils.data.dataset import TokenSequenceDataset
    from utils.data.index import ShardIndex
    from utils.data.loader import ResumableLoader
    from utils.data.mixture import MixtureError, check_sources
    from utils.data.source import DataSettings, Source, configured_sources

    def dataset(name: str) -> TokenSequenceDataset:
        return TokenSequenceDataset(ShardIndex.build(make_shards(tmp_path / name, n_files=2, rows=8), 64, 512,
                                                     log=lambda _m: None))

    web, code = dataset("web"), dataset("code")
    both = ResumableLoader([Source("web", 0.5, data=web), Source("code", 0.5, data=code)], 2, 0, 1, 3)
    for _ in range(3):
        next(both)
    state = both.state_dict()
    said = []
    alone = ResumableLoader([Source("web", 1.0, data=web)], 2, 0, 1, 3, log=said.append)
    alone.load_state_dict(state)
    assert alone.consumed == {"web": state["sources"]["web"]["consumed"]}
    assert len(said) == 1 and "web 0.5 -> 1, dropped code" in said[0]
    with pytest.raises(MixtureError, match=r"none of the checkpoint's sources \(web, code\) is in this run's"):
        ResumableLoader([Source("books", 1.0, data=dataset("books"))], 2, 0, 1, 3).load_state_dict(state)

    shutil.rmtree(tmp_path / "code")
    cfg = get_training_config("demo",
                              parse_overrides([f"data_mix=web={tmp_path / 'web'}:1,code={tmp_path / 'code'}:0"]))
    with pytest.raises(MixtureError, match=r"data_mix source code: .*code does not exist; .*remove the source from "
                                           r"data_mix \(on a resume, the log then says it was dropped\)"):
        check_sources(configured_sources(DataSettings.of(cfg)), {"web": None, "code": None}, said.append)


@pytest.mark.slow
def test_train_py_resumes_a_mixture_whose_source_folder_was_deleted(tmp_path, subprocess_env):
    """End to end: weight 0 on a deleted folder says to remove the source; removing it resumes (11 s)."""
    web = make_shards(tmp_path / "web", ids=(0, 256))
    code = make_shards(tmp_path / "code", ids=(256, 512), seed=1)
    out = tmp_path / "out"
    sets = ("max_steps=4", "save_steps=100", "per_device_train_batch_size=4")
    run(train_cmd(out, web, f"data_mix=web={web}:0.5,code={code}:0.5", *sets, "stop_at_step=2"), subprocess_env)
    shutil.rmtree(code)
    proc = run(train_cmd(out, web, f"data_mix=web={web}:1,code={code}:0", *sets, extra=("--resume", "latest")),
               subprocess_env, check=False)
    assert "remove the source from data_mix" in one_error_line(proc)
    proc = run(train_cmd(out, web, f"data_mix=web={web}:1", *sets, extra=("--resume", "latest")), subprocess_env)
    assert "Resumed from" in proc.stdout and "dropped code" in proc.stdout
    rows = train_rows(out)
    assert rows[4]["tokens/web"] == rows[2]["tokens/web"] + 2 * 4 * 64 and "tokens/code" not in rows[4]


def test_following_the_empty_config_files_advice_works(tmp_path, capsys):
    import train

    path = tmp_path / "empty.yaml"
    path.write_text("# nothing yet\n")
    assert train.main(["--config", str(path), "--print-config"]) == 2
    advice = capsys.readouterr().err
    field = re.search(r"e\.g\. '([^']+)'", advice).group(1)
    preset = re.search(r"--config (\w+)", advice).group(1)
    path.write_text(field + "\n")
    assert train.main(["--config", str(path), "--print-config"]) == 0
    assert train.main(["--config", preset, "--print-config"]) == 0


# ------------------------------------------------------------------------- 18: names and advice

def test_a_config_files_run_name_is_its_name():
    cfg = TrainingConfig(preset="/runs/configs/my-run.yaml")
    assert cfg.effective_run_name == "my-run"
    assert TrainingConfig(preset="demo").effective_run_name == "demo"
    assert TrainingConfig(preset="/x/my-run.yaml", run_name="named").effective_run_name == "named"


def test_a_missing_data_dir_under_the_cpu_preset_names_prepare_data(tmp_path, subprocess_env):
    cmd = [sys.executable, str(REPO_ROOT / "train.py"), "--config", "cpu", "--output-dir", str(tmp_path / "out"),
           "--data-dir", str(tmp_path / "mine")]
    proc = subprocess.run(cmd, env=subprocess_env, capture_output=True, text=True, timeout=120)
    line = one_error_line(proc)
    assert f"--output {tmp_path / 'mine'}" in line and "prepare_data.py" in line
    assert "download_training_data.py" in line
