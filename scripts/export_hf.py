#!/usr/bin/env python
"""Convert an engine checkpoint into an HF model directory that `AutoModelForCausalLM.from_pretrained` loads.

    python scripts/export_hf.py checkpoints/checkpoint-epoch0-step5000-files12 exported/step5000

Reads the checkpoint's weights (verified against its manifest) and its model record, writes them through
transformers' own GPTNeoXForCausalLM (`save_pretrained`), with the tokenizer's files (tokenizer.json,
tokenizer_config.json) and its BOS/EOS/padding ids in config.json and generation_config.json. The tokenizer
is the checkpoint's tokenizer.json unless `--tokenizer` names another (a prepared data directory, whose
dataset.json names the EOS token, an HF tokenizer directory, or a tokenizer.json). The end of every
completed run does the same into final_model/.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from utils.errors import UserError  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a checkpoint directory (checkpoints/checkpoint-epoch*-step*-files*)")
    p.add_argument("out_dir", help="the HF model directory to write (must not exist, or be empty)")
    p.add_argument("--tokenizer", help="a prepared data directory (dataset.json), an HF tokenizer directory or a "
                                       "tokenizer.json (default: the checkpoint's tokenizer.json)")
    args = p.parse_args(argv)
    from utils.model.hf import ExportTokenizer, export_hf, load_checkpoint_model

    out = Path(args.out_dir)
    try:
        if out.exists() and any(out.iterdir()):
            raise UserError(f"{out} already exists and is not empty; choose a new output directory")
        spec, weights, trainer_state = load_checkpoint_model(args.checkpoint)
        tokenizer = Path(args.tokenizer or args.checkpoint)
        if ExportTokenizer.find(tokenizer) is None:
            if args.tokenizer:
                raise UserError(f"--tokenizer {tokenizer}: no tokenizer there (a prepared data directory, an HF "
                                f"tokenizer directory or a tokenizer.json)")
            print(f"note: {args.checkpoint} holds no tokenizer.json; exporting the model alone (pass --tokenizer)",
                  file=sys.stderr)
        export_hf(weights, spec, out, tokenizer=tokenizer)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"exported {args.checkpoint} (step {trainer_state.get('step')}) to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
