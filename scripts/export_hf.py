#!/usr/bin/env python
"""Convert an engine checkpoint into an HF model directory that `AutoModelForCausalLM.from_pretrained` loads.

    python scripts/export_hf.py checkpoints/checkpoint-epoch0-step5000-files12 exported/step5000

Reads the checkpoint's weights (verified against its manifest; a sharded FSDP checkpoint's shards are
reassembled in this one process) and its model record, writes them through transformers' own
GPTNeoXForCausalLM (`save_pretrained`; above 5 GB as sharded safetensors with their index), and copies the
checkpoint's tokenizer.json (or the one given with --tokenizer; an export without one says so). The end of
every completed run does the same into final_model/.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from configs.model_config import ModelSpec  # noqa: E402
from utils.errors import UserError  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a checkpoint directory (checkpoints/checkpoint-epoch*-step*-files*)")
    p.add_argument("out_dir", help="the HF model directory to write (must not exist, or be empty)")
    p.add_argument("--tokenizer", metavar="PATH", help="the tokenizer.json to ship with the model (default: the "
                   "checkpoint's own)")
    args = p.parse_args(argv)
    from utils import files
    from utils.checkpoint.format import read_checkpoint
    from utils.model.hf import export_hf

    out = Path(args.out_dir)
    try:
        if out.exists() and not out.is_dir():
            raise UserError(f"{out} is a file; give a new directory to export into")
        if out.exists() and any(out.iterdir()):
            raise UserError(f"{out} already exists and is not empty; choose a new output directory")
        if args.tokenizer and not Path(args.tokenizer).is_file():
            raise UserError(f"--tokenizer {args.tokenizer}: no such file; give the tokenizer.json the model was "
                            f"trained with")
        payload = read_checkpoint(args.checkpoint, objects=False)
        record = dict(payload.trainer_state.get("model") or {})
        record.pop("padded_vocab_size", None)
        try:
            spec = ModelSpec(**record)
        except TypeError as exc:
            raise UserError(f"{args.checkpoint}: its trainer_state.json has no usable model record ({exc})") from None
        weights = payload.model_state
        if weights is None:  # sharded (strategy=fsdp): every rank's shards, reassembled
            from utils.checkpoint.sharded import read_full_model_state

            weights = read_full_model_state(args.checkpoint)
        tokenizer = Path(args.tokenizer) if args.tokenizer else Path(args.checkpoint) / "tokenizer.json"
        with files.write_guard(out, advice="export into a folder you may write, with space to spare"):
            export_hf(weights, spec, out, tokenizer=tokenizer)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not tokenizer.is_file():
        print(f"warning: {args.checkpoint} holds no tokenizer.json, so {out} has none: AutoTokenizer cannot load it "
              f"(or loads a wrong one). Export again with --tokenizer PATH (the tokenizer.json the model was trained "
              f"with, e.g. DATA_DIR/tokenizer.json)", file=sys.stderr)
    print(f"exported {args.checkpoint} (step {payload.trainer_state.get('step')}) to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
