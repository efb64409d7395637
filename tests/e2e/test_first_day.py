"""A new user's first day, end to end: README.md's "Your own data" commands as written (plus a tiny model and
a few steps) on a 10 MB corpus with a GPT-2-shaped 50,257-id tokenizer, on the CPU; then transformers'
AutoTokenizer + AutoModelForCausalLM on final_model/ (a batch of left-padded prompts, the tokenizer's EOS),
and generate.py giving the same greedy text from a checkpoint, the run's directory and final_model/."""
from __future__ import annotations

import json
import random
import re
import shlex
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import make_subprocess_env
from tests.trainkit import REPO_ROOT, gpt2_style_tokenizer, run

# the README's `--config cpu` run writes runs/cpu/ in the repository; here the same folder in the scratch one
RUN = Path("runs") / "cpu"
# what the README's commands get on top, to train in seconds: the tiny model, 4 steps, an eval and a checkpoint
QUICK = ["--max-steps", "4", "--", "--output-dir", str(RUN), "--set", "model=tiny", "--set", "seq_len=64",
         "--set", "per_device_train_batch_size=4", "--set", "eval_interval=2", "--set", "save_steps=2",
         "--set", "dataloader_num_workers=0", "--set", "sample_every=2", "--set", "sample_max_new_tokens=4"]
KINDS = {"animals": "the quick brown fox jumps over the lazy dog while a cat sleeps".split(),
         "engines": "a model learns to predict the next token from shards of a corpus".split()}


def readme_commands() -> list[str]:
    """The shell commands of README.md's "Your own data" section (its first code block)."""
    text = (REPO_ROOT / "README.md").read_text()
    section = text[text.index("## Your own data"):]
    block = section[section.index("```bash") + len("```bash"):section.index("```", section.index("```bash") + 7)]
    return [line.strip() for line in block.splitlines() if line.strip() and not line.strip().startswith("#")]


def as_run(command: str) -> list[str]:
    """A README command with the repository's paths (the test runs in a scratch folder)."""
    words = shlex.split(command)
    swap = {".venv/bin/python": sys.executable, "./start_training.sh": str(REPO_ROOT / "start_training.sh"),
            "prepare_data.py": str(REPO_ROOT / "prepare_data.py")}
    return [swap.get(w, w) for w in words]


def write_corpus(root: Path, megabytes: float = 10) -> None:
    """JSONL documents of two kinds, all of one kind first (as a sorted corpus often is)."""
    rng = random.Random(0)
    (root / "corpus").mkdir(parents=True)
    for kind, words in KINDS.items():
        with open(root / "corpus" / f"{kind}.jsonl", "w") as f:
            size = 0
            while size < megabytes * 1e6 / len(KINDS):
                line = json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(50, 400)))}) + "\n"
                f.write(line)
                size += len(line)


@pytest.fixture(scope="module")
def first_day(tmp_path_factory):
    """The README's commands run in a scratch folder holding corpus/ and my-tokenizer/; returns it."""
    root = tmp_path_factory.mktemp("first-day")
    started = time.perf_counter()
    write_corpus(root)
    gpt2_style_tokenizer(root / "my-tokenizer" / "tokenizer.json")
    env = make_subprocess_env()
    commands = readme_commands()
    prepare = next(c for c in commands if "prepare_data.py" in c)
    train = next(c for c in commands if "start_training.sh --config cpu" in c)
    proc = run(as_run(prepare), env, cwd=root)
    assert "validation:" in proc.stdout
    assert re.search(r"^warning: the training split is 1 shard file.*--shard-tokens [\d,]+", proc.stderr, re.M)
    proc = run(as_run(train) + QUICK, env, cwd=root)
    assert "validation on the 1 shard(s) of dataset.json's split" in proc.stdout
    assert re.search(r"^Summary: 4 steps, 1,024 tokens.*\n  val_loss [\d.]+ at step 0 -> [\d.]+ at step 4 \(-",
                     proc.stdout, re.M), proc.stdout
    assert "Sample at step 2: 'The' -> " in proc.stdout
    print(f"README own-data commands: {time.perf_counter() - started:.1f} s", file=sys.stderr)
    return root, commands


@pytest.mark.slow
def test_readme_own_data_ends_with_a_model_transformers_generates_with(first_day):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, _ = first_day
    final = root / RUN / "final_model"
    assert {"tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"} <= \
        {p.name for p in final.iterdir()}
    tokenizer = AutoTokenizer.from_pretrained(final)
    model = AutoModelForCausalLM.from_pretrained(final)
    dataset = json.loads((root / "data" / "mine" / "dataset.json").read_text())
    assert tokenizer.eos_token_id == dataset["tokenizer"]["eos_id"] == 50256 == len(tokenizer) - 1
    assert model.config.eos_token_id == model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert tokenizer.pad_token_id == tokenizer.eos_token_id and tokenizer.padding_side == "left"
    prompts = ["the quick", "a model learns to predict the", "dog"]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    assert batch["attention_mask"][2, 0] == 0 and batch["attention_mask"][2, -1] == 1  # padded on the left
    out = model.generate(**batch, max_new_tokens=5, do_sample=False)
    assert out.shape[0] == 3 and out.shape[1] <= batch["input_ids"].shape[1] + 5
    assert int(out.max()) < len(tokenizer)
    alone = model.generate(**tokenizer(prompts[1:2], return_tensors="pt"), max_new_tokens=5, do_sample=False)
    assert torch.equal(out[1, :alone.shape[1]], alone[0])  # the longest prompt is unpadded: the same tokens


@pytest.mark.slow
def test_samples_and_tensorboard_of_the_run(first_day):
    """Samples every 2 steps in logs/samples.jsonl and TensorBoard's text tab; one TensorBoard run (the
    hyperparameters in it, no stray timestamp-named runs); step 0 on the tokens axis too."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root, _ = first_day
    samples = [json.loads(line) for line in (root / RUN / "logs" / "samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["prompt"]) for r in samples] == [(2, "The"), (2, "In the beginning"), (4, "The"),
                                                           (4, "In the beginning")]
    assert all(isinstance(r["continuation"], str) and r["tokens"] == 256 * r["step"] for r in samples)
    board = root / RUN / "logs" / "tensorboard"
    assert [p.name for p in board.iterdir() if p.is_dir()] == [] and (board / "hparams.yml").is_file()
    events = EventAccumulator(str(board), size_guidance={"tensors": 0})
    events.Reload()
    assert [e.step for e in events.Tensors("samples/text_summary")] == [2, 4]
    assert [e.step for e in events.Scalars("by_tokens/eval/val_loss")] == [0, 512, 1024]


@pytest.mark.slow
def test_generate_prints_the_same_greedy_text_from_a_checkpoint_the_run_and_final_model(first_day, capsys):
    import generate

    root, commands = first_day
    readme = as_run(next(c for c in commands if "generate.py" in c))
    args = readme[readme.index(str(RUN / "final_model")):] + ["--temperature", "0", "--max-new-tokens", "6"]
    args[0] = str(root / RUN / "final_model")
    checkpoint = sorted((root / RUN / "checkpoints").iterdir())[-1]
    texts = {}
    for path in (root / RUN / "final_model", root / RUN, checkpoint):
        assert generate.main([str(path)] + args[1:]) == 0
        texts[path.name] = capsys.readouterr().out
    assert len(set(texts.values())) == 1, texts
    assert texts["final_model"].count("\n") >= 2  # one continuation per prompt
    assert generate.main([str(root / "nothing-here"), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert re.search(r"^error: .*nothing-here", err, re.M) and "Traceback" not in err


@pytest.mark.slow
def test_resume_auto_on_the_finished_run_does_nothing_unless_final_model_is_missing(first_day, tmp_path):
    import shutil

    root, _ = first_day
    run_dir = tmp_path / "run"
    shutil.copytree(root, run_dir, ignore=shutil.ignore_patterns("corpus"), symlinks=True)
    env = make_subprocess_env()
    args = [sys.executable, str(REPO_ROOT / "train.py"), "--config", "cpu", "--set", "data_dir=data/mine",
            "--max-steps", "4", "--resume", "auto"] + QUICK[3:]
    rows = (run_dir / RUN / "logs" / "metrics.jsonl").read_text()
    weights = (run_dir / RUN / "final_model" / "model.safetensors").read_bytes()
    proc = run(args, env, cwd=run_dir)
    assert "The run already finished: checkpoint checkpoint-epoch0-step4-files0 is at max_steps=4" in proc.stdout
    assert "Preflight" not in proc.stdout and (run_dir / RUN / "logs" / "metrics.jsonl").read_text() == rows
    shutil.rmtree(run_dir / RUN / "final_model")
    proc = run(args, env, cwd=run_dir)
    assert "final_model/ was missing: exported it" in proc.stdout
    assert (run_dir / RUN / "final_model" / "model.safetensors").read_bytes() == weights
    assert json.loads((run_dir / RUN / "final_model" / "config.json").read_text())["eos_token_id"] == 50256


@pytest.mark.slow
def test_transformers_loads_the_model_without_torchao_noise(first_day, tmp_path):
    """In the venv (setup.sh's .pth hook), outside the repository: importing transformers and loading
    final_model/ prints nothing but transformers' own progress bar, on a machine without torchao's kernels."""
    import os
    import subprocess

    root, _ = first_day
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = ("import transformers, torch; transformers.AutoModelForCausalLM; "
            f"transformers.AutoModelForCausalLM.from_pretrained({str(root / RUN / 'final_model')!r})")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in re.split(r"[\r\n]", proc.stdout + proc.stderr) if line.strip()]
    assert all(line.startswith("Loading weights") for line in lines), lines


def test_plot_run_draws_every_run_s_curves_against_tokens(tmp_path, capsys):
    """scripts/plot_run.py on two runs: a PNG with every training, eval, lr and tokens/s point drawn; a
    folder without metrics is one error line."""
    from scripts import plot_run

    for name, scale in (("a", 1.0), ("b", 0.9)):
        logs = tmp_path / name / "logs"
        logs.mkdir(parents=True)
        rows = [{"step": 0, "tokens": 0, "val_loss": 8.0 * scale}]
        rows += [{"step": s, "tokens": 100 * s, "loss": scale * 8 / s, "lr": 1e-3, "tokens_per_sec": 50.0}
                 for s in (1, 2, 3)]
        rows += [{"step": 3, "tokens": 300, "val_loss": 5.0 * scale}]
        (logs / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "runs.png"
    assert plot_run.main([str(tmp_path / "a"), str(tmp_path / "b" / "logs" / "metrics.jsonl"), "-o", str(out)]) == 0
    assert "(22 points from 2 run(s))" in capsys.readouterr().out  # per run: 3 x (loss, lr, tok/s) + 2 val
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_run.main([str(tmp_path / "nothing"), "-o", str(tmp_path / "x.png")]) == 2
    assert capsys.readouterr().err.startswith("error: ") and not (tmp_path / "x.png").exists()


def test_plot_run_writes_into_the_run_s_folder_and_nothing_where_it_is_run(tmp_path):
    """Without -o the figure goes into the first run's folder (curves.png; curves-vs-NAME.png with others),
    never into the folder it is run from (the repository, for the docs' commands)."""
    for name in ("demo", "cpu"):
        (tmp_path / "runs" / name / "logs").mkdir(parents=True)
        rows = [{"step": s, "tokens": 100 * s, "loss": 8 / s, "lr": 1e-3, "tokens_per_sec": 50.0} for s in (1, 2)]
        (tmp_path / "runs" / name / "logs" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    here = tmp_path / "repository"
    here.mkdir()
    script = str(REPO_ROOT / "scripts" / "plot_run.py")
    for runs, written in (([tmp_path / "runs" / "demo"], tmp_path / "runs" / "demo" / "curves.png"),
                          ([tmp_path / "runs" / "demo", tmp_path / "runs" / "cpu" / "logs" / "metrics.jsonl"],
                           tmp_path / "runs" / "demo" / "curves-vs-cpu.png")):
        proc = run([sys.executable, script, *map(str, runs)], make_subprocess_env(), cwd=here, timeout=120)
        assert proc.stdout.startswith(f"wrote {written} (") and written.read_bytes()[:4] == b"\x89PNG"
        assert list(here.iterdir()) == []


def test_export_of_a_tokenizer_without_an_end_of_document_token(tmp_path):
    """A tokenizer nobody named an EOS for still goes out whole (no ids invented); a GPT-2-shaped one gets
    its <|endoftext|> as BOS, EOS and padding."""
    from dataclasses import replace

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer

    from configs import get_model_spec
    from utils.model import build_model
    from utils.model.hf import ExportTokenizer, export_hf

    words = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]", "a", "b", "c"])}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.save(str(tmp_path / "words.json"))
    spec = replace(get_model_spec("tiny"), vocab_size=4)
    export_hf(build_model(spec, seed=0).state_dict(), spec, tmp_path / "out", tokenizer=tmp_path / "words.json")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["eos_token_id"] is None and config["pad_token_id"] is None
    assert AutoTokenizer.from_pretrained(tmp_path / "out")("a b c")["input_ids"] == [1, 2, 3]
    found = ExportTokenizer.find(gpt2_style_tokenizer(tmp_path / "gpt2" / "tokenizer.json"))
    assert (found.bos, found.eos, found.pad) == ("<|endoftext|>",) * 3
    assert ExportTokenizer.find(tmp_path / "nothing") is None


def digits_text_and_ids(tokenizer_file: Path) -> tuple[str, list[int]]:
    """Text with numbers and its ids by the tokenizer the data was prepared with; that tokenizer keeps some
    multi-digit number in one token (so a tokenizer that splits digits one by one would differ)."""
    from tokenizers import Tokenizer

    text = "x = 12345 + 678\nfor i in range(100):\n    total += i * 2024  # 3.14159"
    trained = Tokenizer.from_file(str(tokenizer_file))
    ids = trained.encode(text, add_special_tokens=False).ids
    assert any(sum(c.isdigit() for c in trained.id_to_token(i)) >= 2 for i in ids)
    return text, ids


def test_an_export_names_the_tokenizer_it_was_trained_with_and_no_other_s_files(tmp_path):
    """GPT-NeoX and Llama exports into a folder holding another tokenizer's files (vocab.json, merges.txt,
    special_tokens_map.json): those are gone; tokenizer_config.json names PreTrainedTokenizerFast (loadable
    by transformers 4 and 5); AutoTokenizer encodes numbers as the training tokenizer does; nothing else."""
    from dataclasses import replace

    from transformers import AutoTokenizer

    from configs import get_model_spec
    from utils.model import build_model
    from utils.model.hf import export_hf

    tokenizer = gpt2_style_tokenizer(tmp_path / "mine" / "tokenizer.json")
    text, ids = digits_text_and_ids(tokenizer)
    for name in ("tiny", "llama-tiny"):
        spec = replace(get_model_spec(name), vocab_size=50257)
        out = tmp_path / name
        out.mkdir()
        for stale in ("vocab.json", "merges.txt", "special_tokens_map.json"):
            (out / stale).write_text("{}")
        warnings = []
        export_hf(build_model(spec, seed=0).state_dict(), spec, out, tokenizer=tokenizer, warn=warnings.append)
        assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                         "tokenizer.json", "tokenizer_config.json"], name
        assert json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
        assert AutoTokenizer.from_pretrained(out)(text, add_special_tokens=False)["input_ids"] == ids, name
        assert warnings == [], warnings


@pytest.mark.slow
def test_a_qwen2_model_trained_with_the_demo_s_tokenizer_exports_a_tokenizer_that_encodes_as_training_did(
        tmp_path, subprocess_env):
    """init_from a Qwen2 directory (transformers' Qwen2ForCausalLM: its AutoTokenizer default, Qwen2Tokenizer,
    splits numbers digit by digit), trained on the demo's data and its BPE: AutoTokenizer encodes numbers as
    that BPE does, on final_model/ itself or, where the installed transformers picks its own class by the
    model_type whatever tokenizer_config.json names, on final_model/tokenizer/, which the run's warning names."""
    from dataclasses import replace

    from transformers import AutoTokenizer

    from configs import get_model_spec
    from tests.trainkit import train_cmd
    from utils.model.families import family

    spec = replace(get_model_spec("llama-tiny"), vocab_size=2048, max_position_embeddings=128, qkv_bias=True)
    fam = family("llama")
    fam.hf().causal_lm_class(spec)(fam.hf().hf_config(spec)).save_pretrained(tmp_path / "qwen2-toy")
    assert json.loads((tmp_path / "qwen2-toy" / "config.json").read_text())["model_type"] == "qwen2"
    out = tmp_path / "run"
    proc = run(train_cmd(out, tmp_path / "data", "max_steps=2", "save_steps=2", "demo_data=true",
                         f"init_from={tmp_path / 'qwen2-toy'}"), make_subprocess_env(), timeout=600)
    final = out / "final_model"
    text, ids = digits_text_and_ids(tmp_path / "data" / "tokenizer.json")
    assert json.loads((final / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert not (final / "vocab.json").exists() and not (final / "merges.txt").exists()
    loaded = AutoTokenizer.from_pretrained(final)
    if loaded(text, add_special_tokens=False)["input_ids"] == ids:
        assert not (final / "tokenizer").exists()
        return
    warning = next(line for line in proc.stderr.splitlines() if "AutoTokenizer loads" in line)
    assert f"as its {type(loaded).__name__}" in warning and f"tokenizer={final / 'tokenizer'}" in warning, warning
    assert warning in (out / "logs" / "training.log").read_text()
    alone = AutoTokenizer.from_pretrained(final / "tokenizer")
    assert alone(text, add_special_tokens=False)["input_ids"] == ids
    assert alone.eos_token == "<|endoftext|>" and alone.padding_side == "left"
