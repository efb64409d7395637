"""The tools around training: generate.py, scripts/export_hf.py,
scripts/plot_run.py and the one tokenizer reader (a GPT-2-style vocab.json + merges.txt directory included).
A tiny model, exported and checkpointed for real, with byte-level BPE tokenizers built here (no download)."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.trainkit import REPO_ROOT

EOS = "<|endoftext|>"
CONTEXT = 64  # the tiny model's positions


def byte_bpe(size: int):
    """A byte-level BPE of `size` ids, GPT-2's shape: the 256 byte symbols (the newline's first, so that a
    model whose every logit ties writes newlines), merges of byte pairs, and <|endoftext|> last (in the
    vocabulary itself, as GPT-2's vocab.json has it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda c: (c != "Ċ", c))
    vocab = {c: i for i, c in enumerate(alphabet)}
    merges = []
    for a in alphabet[1:]:
        for b in alphabet[1:]:
            if len(vocab) < size - 1:
                vocab[a + b] = len(vocab)
                merges.append((a, b))
    vocab[EOS] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([EOS])
    assert tokenizer.get_vocab_size() == size and tokenizer.token_to_id("Ċ") == 0
    return tokenizer


@pytest.fixture(scope="module")
def tools(tmp_path_factory):
    """tokenizer.json (400 ids), big.json (600 ids), gpt2/ (the 400-id one as vocab.json + merges.txt),
    hf/ (the tiny model exported with it), newlines/ (the same with a zero head: greedy text is all
    newlines) and a checkpoint of the tiny model holding tokenizer.json."""
    from configs import get_model_spec
    from utils.checkpoint.format import CheckpointPayload, checkpoint_name, write_checkpoint
    from utils.model import build_model
    from utils.model.hf import export_hf

    root = tmp_path_factory.mktemp("tools")
    small = byte_bpe(400)
    small.save(str(root / "tokenizer.json"))
    byte_bpe(600).save(str(root / "big.json"))
    (root / "gpt2").mkdir()
    small.model.save(str(root / "gpt2"))
    spec = replace(get_model_spec("tiny"))
    assert spec.padded_vocab_size == 512 and spec.max_position_embeddings == CONTEXT
    state = build_model(spec, seed=0).state_dict()
    export_hf(state, spec, root / "hf", tokenizer=root / "tokenizer.json")
    export_hf(state | {"lm_head.weight": torch.zeros_like(state["lm_head.weight"])}, spec, root / "newlines",
              tokenizer=root / "tokenizer.json")
    payload = CheckpointPayload(state, {}, {"step": 1, "epoch": 0, "model": spec.to_dict()})
    checkpoint = write_checkpoint(root / "checkpoints", checkpoint_name(0, 1, 1), payload,
                                  {"tokenizer.json": root / "tokenizer.json"})
    return root, checkpoint


def generate_main(capsys, *argv) -> tuple[int, str, str]:
    import generate

    try:
        code = generate.main([str(a) for a in argv])
    except SystemExit as exc:  # the command line's own errors (utils/cli.py): one line too
        code = exc.code
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def error_line(code: int, err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1, (code, err)
    return lines[0]


# ------------------------------------------------------------------------------- generate.py: the prompt

def test_an_empty_prompt_starts_from_the_tokenizer_s_first_token(tools, capsys):
    root, _ = tools
    code, out, _ = generate_main(capsys, root / "newlines", "--prompt", "", "--max-new-tokens", "3",
                                 "--temperature", "0")
    assert code == 0 and out == "\n\n\n\n"


def test_a_prompt_longer_than_the_context_keeps_its_end(tools, capsys):
    """A 300-token prompt on a 64-token model keeps its last 64 - 5 tokens, says so once, and continues
    exactly as that end alone does."""
    from tokenizers import Tokenizer

    root, _ = tools
    tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
    prompt = " ".join(f"w{i}" for i in range(100))
    ids = tokenizer.encode(prompt).ids
    assert len(ids) > 200
    end = tokenizer.decode(ids[-(CONTEXT - 5):])
    greedy = ["--max-new-tokens", "5", "--temperature", "0", "--jsonl"]
    code, long_out, err = generate_main(capsys, root / "hf", "--prompt", prompt, *greedy)
    assert code == 0 and err.count(f"kept only its last {CONTEXT - 5} tokens") == 1, err
    assert "longer than the specified maximum" not in err  # transformers' own warning is not shown
    code, end_out, err = generate_main(capsys, root / "hf", "--prompt", end, *greedy)
    assert code == 0 and "kept only" not in err
    assert json.loads(long_out)["continuation"] == json.loads(end_out)["continuation"]


@pytest.mark.slow
def test_max_new_tokens_is_capped_at_the_context_and_said_once(tools, capsys):
    root, _ = tools
    code, out, err = generate_main(capsys, root / "newlines", "--prompt", "ab", "--prompt", "abcd",
                                   "--max-new-tokens", "1000", "--temperature", "0", "--jsonl")
    assert code == 0 and err.count(f"--max-new-tokens 1000 capped at {CONTEXT - 1}") == 1, err
    rows = [json.loads(line) for line in out.splitlines()]
    # each prompt is 1-2 tokens; the rest of the context is the continuation's
    assert [len(r["continuation"]) for r in rows] == [CONTEXT - 1, CONTEXT - 1]


@pytest.mark.parametrize("option, value, says", [
    ("--temperature", "nan", "argument --temperature: must be a finite number, got nan; "),
    ("--temperature", "inf", "argument --temperature: must be a finite number, got inf"),
    ("--temperature", "-1", "--temperature must be a finite number"),
    ("--top-k", "-1", "--top-k must be 0 (all tokens) or more"),
    ("--top-k", "513", "--top-k 513 is more than the model's 512 token ids"),
    ("--device", "tpu", "--device tpu: not a device here; use auto, cpu, cuda or cuda:N"),
])
def test_sampling_options_out_of_range_are_one_line(tools, capsys, option, value, says):
    root, _ = tools
    code, out, err = generate_main(capsys, root / "hf", "--prompt", "x", option, value)
    assert says in error_line(code, err) and out == ""


# --------------------------------------------------------------------------- generate.py: what it prints

def test_several_continuations_are_one_line_each_and_one_stays_plain(tools, capsys):
    """The zero-head model writes only newlines: several prompts' continuations are still one line each
    (newlines written as \\n), one prompt's is printed as it is."""
    import generate

    root, _ = tools
    greedy = ["--max-new-tokens", "3", "--temperature", "0"]
    code, out, _ = generate_main(capsys, root / "newlines", "--prompt", "a", "--prompt", "b", "--prompt", "c", *greedy)
    assert code == 0 and out.splitlines() == ["\\n\\n\\n"] * 3
    code, out, _ = generate_main(capsys, root / "newlines", "--prompt", "a", *greedy)
    assert code == 0 and out == "\n\n\n\n"
    text = "a\\nb\nc\r\\"  # a literal backslash-n, a newline, a carriage return, a backslash
    (line,) = generate.shown([text, "x"])[:1]
    assert "\n" not in line and "\r" not in line
    assert line.encode().decode("unicode_escape") == text


# ------------------------------------------------------------------- generate.py / export: bad model dirs

def bad_hf_dir(root: Path, tmp: Path, what: str) -> Path:
    import shutil

    d = tmp / what
    shutil.copytree(root / "hf", d)
    if what == "truncated":
        data = (d / "model.safetensors").read_bytes()
        (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    elif what == "no-weights":
        (d / "model.safetensors").unlink()
    elif what == "unsafe-bin":
        (d / "model.safetensors").unlink()
        torch.save({"w": Path("not a tensor")}, d / "pytorch_model.bin")
    elif what in ("mamba", "auto-map"):
        config = json.loads((d / "config.json").read_text())
        if what == "mamba":
            config["model_type"] = "mamba"
        else:
            config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.Evil"}
            (d / "modeling_evil.py").write_text(f"open({str(tmp / 'ran')!r}, 'w')\nclass Evil: pass\n")
        (d / "config.json").write_text(json.dumps(config))
    return d


@pytest.mark.parametrize("what, says", [
    ("truncated", r"model.safetensors: cannot read it"),
    ("no-weights", r"no-weights: no weights \(model.safetensors, pytorch_model.bin"),
    ("unsafe-bin", r"pytorch_model.bin: cannot read it \(it holds more than tensors"),
    ("mamba", r"config.json: model_type is 'mamba'; the engine loads 'gemma3_text', 'gpt_neox', 'llama', 'qwen2', "
              r"'qwen3' model directories"),
    ("auto-map", r"config.json: names code of its own \(auto_map\)"),
])
def test_a_bad_hf_directory_is_one_line_and_runs_no_code(tools, tmp_path, capsys, what, says):
    import re

    root, _ = tools
    code, out, err = generate_main(capsys, bad_hf_dir(root, tmp_path, what), "--prompt", "x")
    assert re.search(says, error_line(code, err)) and out == ""
    assert not (tmp_path / "ran").exists()


def test_a_tokenizer_bigger_than_the_model_is_refused_by_generate_and_export(tools, tmp_path, capsys):
    from scripts import export_hf

    root, checkpoint = tools
    for model in (root / "hf", checkpoint):
        code, out, err = generate_main(capsys, model, "--prompt", "x", "--tokenizer", root / "big.json")
        assert "big.json has 600 ids but the model" in error_line(code, err) and "512 embedding rows" in err
    assert export_hf.main([str(checkpoint), str(tmp_path / "out"), "--tokenizer", str(root / "big.json")]) == 2
    assert "big.json has 600 ids but the model 'tiny' has 512 embedding rows" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------ a GPT-2-style tokenizer folder

def test_a_gpt2_style_tokenizer_directory_is_read_by_prepare_export_and_generate(tools, tmp_path, capsys):
    """vocab.json + merges.txt (+ tokenizer_config.json) without tokenizer.json: prepare_data writes the
    converted tokenizer.json (the same ids as the original), export_hf.py and generate.py take it too."""
    import shutil

    from tokenizers import Tokenizer

    from scripts import export_hf
    from utils.data.prepare import PrepareOptions, prepare

    root, checkpoint = tools
    gpt2 = tmp_path / "gpt2"
    shutil.copytree(root / "gpt2", gpt2)
    (gpt2 / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS, "model_max_length": 1024}))
    assert not (gpt2 / "tokenizer.json").exists()
    (tmp_path / "corpus.txt").write_text("hello world, a GPT-2-style tokenizer\nin two lines")
    result = prepare([str(tmp_path / "corpus.txt")], str(gpt2), tmp_path / "data",
                     PrepareOptions(val_fraction=0, shard_tokens=1024))
    assert result.documents == 1
    original = Tokenizer.from_file(str(root / "tokenizer.json"))
    written = Tokenizer.from_file(str(tmp_path / "data" / "tokenizer.json"))
    text = "hello world, a GPT-2-style tokenizer\nin two lines"
    assert written.encode(text).ids == original.encode(text).ids
    info = json.loads((tmp_path / "data" / "dataset.json").read_text())["tokenizer"]
    assert (info["vocab_size"], info["eos_id"], info["eos_token"]) == (400, 399, EOS)

    assert export_hf.main([str(checkpoint), str(tmp_path / "out"), "--tokenizer", str(gpt2)]) == 0
    capsys.readouterr()
    from transformers import AutoTokenizer

    exported = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert exported(text)["input_ids"] == original.encode(text).ids and exported.eos_token == EOS
    greedy = ["--max-new-tokens", "4", "--temperature", "0"]
    code, with_dir, _ = generate_main(capsys, checkpoint, "--prompt", "hello", "--tokenizer", gpt2, *greedy)
    code2, with_file, _ = generate_main(capsys, checkpoint, "--prompt", "hello", *greedy)
    assert code == code2 == 0 and with_dir == with_file


def test_a_gpt2_style_directory_missing_a_file_or_malformed_is_one_line(tools, tmp_path):
    from utils.data.prepare import load_tokenizer
    from utils.errors import UserError

    root, _ = tools
    half = tmp_path / "half"
    half.mkdir()
    (half / "vocab.json").write_text((root / "gpt2" / "vocab.json").read_text())
    with pytest.raises(UserError, match=r"half: has vocab.json but no merges.txt"):
        load_tokenizer(str(half))
    (half / "merges.txt").write_text("#version: 0.2\nnot-in-vocab pair\n")
    with pytest.raises(UserError, match=r"half: cannot read its vocab.json \+ merges.txt as a GPT-2 tokenizer"):
        load_tokenizer(str(half))
    with pytest.raises(UserError, match=r"nothing: no tokenizer.json there, nor GPT-2-style vocab.json \+ merges.txt"):
        load_tokenizer(str(tmp_path / "nothing"))


# ------------------------------------------------------------------------------------------ plot_run.py

@pytest.fixture
def one_run(tmp_path):
    logs = tmp_path / "run" / "logs"
    logs.mkdir(parents=True)
    rows = [{"step": s, "tokens": 100 * s, "loss": 8 / s, "lr": 1e-3, "tokens_per_sec": 50.0} for s in (1, 2)]
    (logs / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path / "run"


def test_plot_run_into_a_directory_writes_a_named_file_inside_it(one_run, tmp_path, capsys):
    from scripts import plot_run

    (tmp_path / "plots").mkdir()
    assert plot_run.main([str(one_run), "-o", str(tmp_path / "plots")]) == 0
    assert f"wrote {tmp_path / 'plots' / 'curves.png'} (" in capsys.readouterr().out
    assert (tmp_path / "plots" / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / "plots.png").exists()
    assert plot_run.main([str(one_run), "-o", str(tmp_path / "curves")]) == 0  # no extension: .png, said
    assert f"wrote {tmp_path / 'curves.png'} (" in capsys.readouterr().out and (tmp_path / "curves.png").is_file()


def test_plot_run_with_an_extension_matplotlib_cannot_write_is_one_line(one_run, tmp_path, capsys):
    from scripts import plot_run

    assert plot_run.main([str(one_run), "-o", str(tmp_path / "plot.txt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: -o {tmp_path / 'plot.txt'}: matplotlib cannot write .txt")
    assert ".png" in err and ".svg" in err and ".pdf" in err and not (tmp_path / "plot.txt").exists()


# ------------------------------------------------------------------- host memory on the CPU (issue 26/19)

@pytest.mark.slow
def test_a_50k_vocabulary_does_not_page_fault_its_buffers_in_every_step(tmp_path):
    """The same 12 CPU steps of the tiny model on data with GPT-2's 50,257 ids and with 512: every step frees
    and reallocates vocabulary-sized buffers (the loss's logits, gradients, optimizer temporaries). Kept by
    the process, the big vocabulary's run page-faults its peak in once (measured 2.8x the small one's
    faults in all); given back to the OS at each free, every step faults ~200 MB in again (measured 24x)."""
    import random
    import resource
    import subprocess

    from tests.conftest import make_subprocess_env
    from tests.trainkit import gpt2_style_tokenizer, train_cmd
    from utils.data.prepare import PrepareOptions, prepare

    rng = random.Random(0)
    words = ["".join(rng.choice("etaoinshrdlu") for _ in range(rng.randint(2, 8))) for _ in range(2000)]
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": " ".join(rng.choices(words, k=100))}) + "\n"
                                                   for _ in range(400)))  # 400 documents
    faults = {}
    for vocab in (50257, 512):
        data = tmp_path / f"data-{vocab}"
        prepare([str(tmp_path / "corpus.jsonl")], str(gpt2_style_tokenizer(tmp_path / f"{vocab}.json", vocab)), data,
                PrepareOptions(shard_tokens=1 << 14))
        cmd = train_cmd(tmp_path / f"out-{vocab}", data, "per_device_train_batch_size=16", "eval_interval=1000",
                        "save_steps=1000", extra=("--max-steps", "12"))
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=make_subprocess_env(), capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        faults[vocab] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt - before
    assert faults[50257] < 6 * faults[512], faults
