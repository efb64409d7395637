#!/usr/bin/env python
"""Continue prompts with a trained model: a checkpoint, a run's output directory, or an HF model directory.

    python generate.py runs/demo/final_model --prompt "def fibonacci(n):" --max-new-tokens 64
    python generate.py runs/demo --prompt "Once upon" --prompt "The engine" --temperature 0  # its newest checkpoint
    python generate.py runs/demo/checkpoints/checkpoint-epoch0-step400-files20 --prompt "import" --top-k 20

PATH: an engine checkpoint directory; a run's output directory (its newest complete checkpoint, under
checkpoints/); or an HF directory (final_model/, scripts/export_hf.py's output). The tokenizer is the one
saved with it, or `--tokenizer`. Prompts are batched, left-padded; generation stops at the tokenizer's
end-of-document token. `--temperature 0` is greedy (deterministic: the same text from a checkpoint, its run
directory and the exported model). stdout holds only the continuations, one per prompt in order (`--jsonl`:
one JSON object per line with the prompt and its continuation); everything else goes to stderr.
Exit status: 0 done, 2 bad input.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from utils.errors import UserError  # noqa: E402


class GenerateError(UserError):
    """A PATH or option generate.py cannot use; the message names it."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", metavar="PATH", help="a checkpoint directory, a run's output directory or an HF directory")
    p.add_argument("--prompt", action="append", required=True, help="a prompt (repeatable: one batch)")
    p.add_argument("--max-new-tokens", type=int, default=50)
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--top-k", type=int, default=50, help="sample from the k likeliest tokens (0: all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    p.add_argument("--device", default="auto", help="auto (cuda if available) | cpu | cuda | cuda:N")
    p.add_argument("--tokenizer", help="a prepared data directory, an HF tokenizer directory or a tokenizer.json "
                                       "(default: the one saved with PATH)")
    p.add_argument("--jsonl", action="store_true", help="print one JSON object per prompt")
    return p.parse_args(argv)


def resolve_model_path(path: Path) -> tuple[str, Path]:
    """("hf" | "checkpoint", directory) for PATH; a run's output directory gives its newest checkpoint."""
    from utils.checkpoint.format import find_latest_local, parse_checkpoint_name

    if not path.is_dir():
        raise GenerateError(f"{path}: no such directory (a checkpoint, a run's output directory or an HF model)")
    if (path / "config.json").is_file():
        return "hf", path
    if parse_checkpoint_name(path.name):
        return "checkpoint", path
    if (path / "checkpoints").is_dir():
        newest = find_latest_local(path / "checkpoints", log=lambda msg: print(msg, file=sys.stderr))
        if newest is not None:
            return "checkpoint", newest
    raise GenerateError(f"{path}: not a checkpoint, an HF model directory (config.json) or a run's output directory "
                        f"with a complete checkpoint under checkpoints/")


def load(path: Path, tokenizer_source: str | None):
    """(transformers model, tokenizer) for PATH; the tokenizer pads on the left."""
    from utils.model.hf import ExportTokenizer, load_checkpoint_model, quiet_progress, to_transformers

    kind, directory = resolve_model_path(path)
    found = ExportTokenizer.find(tokenizer_source) if tokenizer_source else None
    if tokenizer_source and found is None:
        raise GenerateError(f"--tokenizer {tokenizer_source}: no tokenizer there")
    if kind == "hf":
        from transformers import AutoModelForCausalLM, AutoTokenizer

        with quiet_progress():
            model = AutoModelForCausalLM.from_pretrained(directory)
        if found is None and not (directory / "tokenizer.json").is_file():
            raise GenerateError(f"{directory}: no tokenizer saved with the model; pass --tokenizer")
        tokenizer = (found.hf_tokenizer(model.config.max_position_embeddings) if found
                     else AutoTokenizer.from_pretrained(directory, padding_side="left"))
    else:
        spec, weights, _ = load_checkpoint_model(directory)
        found = found or ExportTokenizer.find(directory)
        if found is None:
            raise GenerateError(f"{directory}: no tokenizer.json in the checkpoint; pass --tokenizer")
        tokenizer = found.hf_tokenizer(spec.max_position_embeddings)
        model = to_transformers(weights, spec, found.special_ids(tokenizer))
        model.config.use_cache = True
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    print(f"generate: {kind} {directory}", file=sys.stderr)
    return model, tokenizer


def generate(model, tokenizer, prompts: list[str], max_new_tokens: int, temperature: float, top_k: int,
             device: str = "cpu", seed: int = 0) -> list[str]:
    """The continuation of each prompt (special tokens left out), batched and left-padded."""
    import torch

    torch.manual_seed(seed)
    model = model.to(device).eval()
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    sampling = {"do_sample": True, "temperature": temperature, "top_k": top_k or None} if temperature > 0 else \
        {"do_sample": False, "temperature": None, "top_k": None, "top_p": None}
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id, **sampling)
    new = out[:, batch["input_ids"].shape[1]:]
    return tokenizer.batch_decode(new, skip_special_tokens=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.max_new_tokens < 1 or args.temperature < 0 or args.top_k < 0:
            raise GenerateError("--max-new-tokens must be at least 1, --temperature and --top-k not negative")
        import torch

        device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise GenerateError(f"--device {args.device}: no CUDA GPU here; use --device cpu")
        model, tokenizer = load(Path(args.path), args.tokenizer)
        texts = generate(model, tokenizer, args.prompt, args.max_new_tokens, args.temperature, args.top_k, device,
                         args.seed)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for prompt, text in zip(args.prompt, texts):
        print(json.dumps({"prompt": prompt, "continuation": text}, ensure_ascii=False) if args.jsonl else text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
