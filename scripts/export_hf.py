#!/usr/bin/env python
"""Convert an engine checkpoint into an HF model directory that `AutoModelForCausalLM.from_pretrained` loads.

    python scripts/export_hf.py checkpoints/checkpoint-epoch0-step5000-files12 exported/step5000

Reads the checkpoint's weights (verified against its manifest; a sharded FSDP checkpoint's shards are
reassembled in this one process) and its model record, writes them through transformers' own
GPTNeoXForCausalLM (`save_pretrained`; above 5 GB as sharded safetensors with their index), with the
tokenizer's files (tokenizer.json, tokenizer_config.json) and its BOS/EOS/padding ids in config.json and
generation_config.json. The tokenizer is the checkpoint's tokenizer.json unless `--tokenizer` names another
(a prepared data directory, whose dataset.json names the EOS token, an HF tokenizer directory, or a
tokenizer.json); an export without one says so. The end of every completed run does the same into
final_model/.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from utils.cli import CommandLine
from utils.errors import UserError


def main(argv=None) -> int:
    p = CommandLine(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a checkpoint directory (checkpoints/checkpoint-epoch*-step*-files*)")
    p.add_argument("out_dir", help="the HF model directory to write (must not exist, or be empty)")
    p.add_argument("--tokenizer", help="a prepared data directory (dataset.json), an HF tokenizer directory or a "
                                       "tokenizer.json (default: the checkpoint's tokenizer.json)")
    args = p.parse_args(argv)
    from utils.model.hf import ExportTokenizer, load_checkpoint_model
    from utils.run.export import write_export

    out = Path(args.out_dir)
    try:
        if out.exists() and not out.is_dir():
            raise UserError(f"{out} is a file; give a new directory to export into")
        if out.exists() and any(out.iterdir()):
            raise UserError(f"{out} already exists and is not empty; choose a new output directory")
        tokenizer = ExportTokenizer.find(Path(args.tokenizer or args.checkpoint))
        if args.tokenizer and tokenizer is None:
            raise UserError(f"--tokenizer {args.tokenizer}: no such file, or no tokenizer there (give a prepared "
                            f"data directory, an HF tokenizer directory or a tokenizer.json)")
        spec, weights, trainer_state = load_checkpoint_model(args.checkpoint)
        if tokenizer is None:
            print(f"warning: {args.checkpoint} holds no tokenizer.json, so {out} has none: AutoTokenizer cannot load "
                  f"it (or loads a wrong one). Export again with --tokenizer PATH (the data directory or the "
                  f"tokenizer.json the model was trained with)", file=sys.stderr)
        write_export(weights, spec, out, tokenizer, advice="export into a folder you may write, with space to spare "
                                                           f"(nothing was written to {out})")
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"exported {args.checkpoint} (step {trainer_state.get('step')}) to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
