#!/usr/bin/env python
"""Continue prompts with a trained model: a checkpoint, a run's output directory, or an HF model directory.

    python generate.py runs/demo/final_model --prompt "def fibonacci(n):" --max-new-tokens 64
    python generate.py runs/demo --prompt "Once upon" --prompt "The engine" --temperature 0  # its newest checkpoint
    python generate.py runs/demo/checkpoints/checkpoint-epoch0-step400-files20 --prompt "import" --top-k 20

PATH: an engine checkpoint directory; a run's output directory (its newest complete checkpoint, under
checkpoints/); or an HF directory (final_model/, scripts/export_hf.py's output). The tokenizer is the one
saved with it, or `--tokenizer` (a tokenizer.json, an HF tokenizer directory, GPT-2's vocab.json + merges.txt,
or a prepared data directory). Prompts are batched, left-padded; generation stops at the tokenizer's
end-of-document token. `--temperature 0` is greedy (deterministic: the same text from a checkpoint, its run
directory and the exported model).

The model's context (max_position_embeddings) holds a prompt and its continuation: `--max-new-tokens` is
capped at the context less one, and a longer prompt keeps its last tokens, each said once on stderr (the
model never sees positions it was not trained on: a sliding window would need one full forward pass per
token). An empty prompt starts from the BOS token.

stdout holds only the continuations: a single prompt's as it is; several, one line each in order, with
backslash, newline and carriage return written as \\\\, \\n and \\r (`--jsonl`: one JSON object per line with
the prompt and its continuation); everything else goes to stderr. Exit status: 0 done, 2 bad input.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from utils import layout
from utils.cli import CommandLine, number_flag
from utils.errors import UserError
from utils.runtime.threads import settle_wait


class GenerateError(UserError):
    """A PATH or option generate.py cannot use; the message names it."""


def parse_args(argv=None) -> argparse.Namespace:
    p = CommandLine(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", metavar="PATH", help="a checkpoint directory, a run's output directory or an HF directory")
    p.add_argument("--prompt", action="append", required=True, help="a prompt (repeatable: one batch)")
    p.add_argument("--max-new-tokens", type=number_flag("int"), default=50)
    p.add_argument("--temperature", type=number_flag("float"), default=0.8, help="0: greedy")
    p.add_argument("--top-k", type=number_flag("int"), default=50, help="sample from the k likeliest tokens (0: all)")
    p.add_argument("--seed", type=number_flag("int"), default=0, help="seed of the sampling")
    p.add_argument("--device", default="auto", help="auto (cuda if available) | cpu | cuda | cuda:N")
    p.add_argument("--tokenizer", help="a prepared data directory, an HF tokenizer directory or a tokenizer.json "
                                       "(default: the one saved with PATH)")
    p.add_argument("--jsonl", action="store_true", help="print one JSON object per prompt")
    return p.parse_args(argv)


def resolve_model_path(path: Path) -> tuple[str, Path]:
    """("hf" | "checkpoint", directory) for PATH; a run's output directory gives its newest checkpoint."""
    from utils.checkpoint.format import find_latest_local, parse_checkpoint_name

    if path.exists() and not path.is_dir():
        raise GenerateError(f"{path}: a file, not a directory; give the folder of a checkpoint, a run's output "
                            f"directory or an HF model (the one holding its config.json)")
    if not path.is_dir():
        raise GenerateError(f"{path}: no such directory (a checkpoint, a run's output directory or an HF model)")
    if (path / "config.json").is_file():
        return "hf", path
    if parse_checkpoint_name(path.name):
        return "checkpoint", path
    if (path / layout.CHECKPOINTS).is_dir():
        newest = find_latest_local(path / layout.CHECKPOINTS, log=lambda msg: print(msg, file=sys.stderr))
        if newest is not None:
            return "checkpoint", newest
    raise GenerateError(f"{path}: not a checkpoint, an HF model directory (config.json) or a run's output directory "
                        f"with a complete checkpoint under checkpoints/")


def load_weights(path: Path):
    """("hf" | "checkpoint", directory, spec, weights with the engine's names) for PATH (resolve_model_path). An
    HF directory is read by the engine's own loader (safetensors, or torch.load with weights_only; a known
    family only, no auto_map), so nothing in it runs code; its errors name the directory, not a config option."""
    from utils.model.hf import check_weights, load_checkpoint_model, load_hf_pretrained

    kind, directory = resolve_model_path(path)
    if kind == "hf":
        spec, weights = load_hf_pretrained(directory, option="")
        check_weights(spec, weights, directory, option="")
    else:
        spec, weights, _ = load_checkpoint_model(directory)
    return kind, directory, spec, weights


def load(path: Path, tokenizer_source: str | None):
    """(transformers model, tokenizer) for PATH (load_weights); the tokenizer pads on the left."""
    from utils.model.hf import ExportTokenizer, to_transformers

    kind, directory, spec, weights = load_weights(path)
    found = ExportTokenizer.find(tokenizer_source or directory)
    if found is None:
        raise GenerateError(f"--tokenizer {tokenizer_source}: no tokenizer there (a prepared data directory, an HF "
                            f"tokenizer directory or a tokenizer.json)" if tokenizer_source else
                            f"{directory}: no tokenizer saved with the model; pass --tokenizer")
    found.check_fits(spec.padded_vocab_size, directory)
    tokenizer = found.hf_tokenizer(spec.max_position_embeddings)
    model = to_transformers(weights, spec, found.special_ids(tokenizer))
    model.config.use_cache = True
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    print(f"generate: {kind} {directory}", file=sys.stderr)
    return model, tokenizer


def fit_prompts(tokenizer, prompts: list[str], max_new_tokens: int, context: int, say) -> tuple[list[list[int]], int]:
    """(each prompt's ids, the new-token count) within the model's context of `context` positions, which
    the prompt and its continuation share: `max_new_tokens` is capped at context - 1, and a longer prompt
    keeps its last context - max_new_tokens ids (what comes after it depends on those most); `say` tells
    each once. An empty prompt starts from the tokenizer's BOS (else EOS) token: an unconditional sample."""
    if max_new_tokens > context - 1:
        say(f"generate: --max-new-tokens {max_new_tokens} capped at {context - 1}: the model's context is "
            f"{context} tokens, prompt and continuation together")
        max_new_tokens = context - 1
    room = context - max_new_tokens
    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    fitted, cut = [], []
    for number, ids in enumerate(tokenizer(prompts, add_special_tokens=False, verbose=False)["input_ids"], 1):
        if not ids:
            if start is None:
                raise GenerateError(f"--prompt {number} is empty and the tokenizer has no BOS or EOS token to start "
                                    f"from; give some text")
            ids = [start]
        if len(ids) > room:
            cut.append(str(number))
            ids = ids[-room:]
        fitted.append(ids)
    if cut:
        say(f"generate: prompt {', '.join(cut)} kept only its last {room} tokens: with {max_new_tokens} new tokens "
            f"that fills the model's {context}-token context")
    return fitted, max_new_tokens


@dataclass(frozen=True)
class Sampling:
    """How continuations are drawn: up to `max_new_tokens` each, at `temperature` (0: greedy) from the `top_k`
    likeliest ids (0: all), with torch's generator seeded by `seed`."""

    max_new_tokens: int = 64
    temperature: float = 0.8
    top_k: int = 50
    seed: int = 0


def generate(model, tokenizer, prompts: list[str], sampling: Sampling, device: str = "cpu",
             say=lambda line: print(line, file=sys.stderr)) -> list[str]:
    """The continuation of each prompt (special tokens left out), batched and left-padded, within the model's
    context (fit_prompts)."""
    import torch

    torch.manual_seed(sampling.seed)
    model = model.to(device).eval()
    ids, max_new_tokens = fit_prompts(tokenizer, prompts, sampling.max_new_tokens,
                                      model.config.max_position_embeddings, say)
    batch = tokenizer.pad({"input_ids": ids}, padding=True, return_tensors="pt").to(device)
    draw = {"do_sample": True, "temperature": sampling.temperature, "top_k": sampling.top_k or None} \
        if sampling.temperature > 0 else {"do_sample": False, "temperature": None, "top_k": None, "top_p": None}
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id, **draw)
    new = out[:, batch["input_ids"].shape[1]:]
    return tokenizer.batch_decode(new, skip_special_tokens=True)


def check_options(args) -> str:
    """The options that need no model, in one line each; returns the device to run on."""
    import torch

    if args.max_new_tokens < 1:
        raise GenerateError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise GenerateError(f"--temperature must be a finite number, 0 (greedy) or more, got {args.temperature}")
    if args.top_k < 0:
        raise GenerateError(f"--top-k must be 0 (all tokens) or more, got {args.top_k}")
    if args.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        raise GenerateError(f"--device {args.device}: not a device here; use auto, cpu, cuda or cuda:N")
    if args.device.startswith("cuda"):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not count:
            raise GenerateError(f"--device {args.device}: no CUDA GPU here; use --device cpu")
        if int(args.device.partition(":")[2] or 0) >= count:
            raise GenerateError(f"--device {args.device}: this machine has {count} GPU(s), cuda:0 to cuda:{count - 1}")
    return args.device


ONE_LINE = str.maketrans({"\\": "\\\\", "\n": "\\n", "\r": "\\r"})


def shown(texts: list[str]) -> list[str]:
    """What stdout gets: one prompt's continuation as it is; several, one line each, with backslash, newline
    and carriage return written as \\\\, \\n and \\r, so that each line is one continuation."""
    if len(texts) == 1:
        return texts
    return [text.translate(ONE_LINE) for text in texts]


def main(argv=None) -> int:
    settle_wait()  # how CPU threads wait: before torch (and its OpenMP runtime) is imported
    args = parse_args(argv)
    try:
        device = check_options(args)
        model, tokenizer = load(Path(args.path), args.tokenizer)
        if args.top_k > model.config.vocab_size:
            raise GenerateError(f"--top-k {args.top_k} is more than the model's {model.config.vocab_size:,} token "
                                f"ids; 0 samples from all of them")
        texts = generate(model, tokenizer, args.prompt,
                         Sampling(args.max_new_tokens, args.temperature, args.top_k, args.seed), device)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    lines = ([json.dumps({"prompt": prompt, "continuation": text}, ensure_ascii=False)
              for prompt, text in zip(args.prompt, texts)] if args.jsonl else shown(texts))
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
