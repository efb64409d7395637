"""Hardening, third pass (issue 26), the tools around training: generate.py, scripts/export_hf.py,
scripts/plot_run.py and the one tokenizer reader (a GPT-2-style vocab.json + merges.txt directory included).
A tiny model, exported and checkpointed for real, with byte-level BPE tokenizers built here (no download)."""
from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.trainkit import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "scripts"))

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

    code = generate.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def error_line(code: int, err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1, (code, err)
    return lines[0]


# ------------------------------------------------------------------------ a GPT-2-style tokenizer folder

def test_a_gpt2_style_tokenizer_directory_is_read_by_prepare_export_and_generate(tools, tmp_path, capsys):
    """vocab.json + merges.txt (+ tokenizer_config.json) without tokenizer.json: prepare_data writes the
    converted tokenizer.json (the same ids as the original), export_hf.py and generate.py take it too."""
    import shutil

    import export_hf
    from tokenizers import Tokenizer

    from utils.data.prepare import prepare

    root, checkpoint = tools
    gpt2 = tmp_path / "gpt2"
    shutil.copytree(root / "gpt2", gpt2)
    (gpt2 / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS, "model_max_length": 1024}))
    assert not (gpt2 / "tokenizer.json").exists()
    (tmp_path / "corpus.txt").write_text("hello world, a GPT-2-style tokenizer\nin two lines")
    result = prepare([str(tmp_path / "corpus.txt")], str(gpt2), tmp_path / "data", val_fraction=0, shard_tokens=1024)
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
