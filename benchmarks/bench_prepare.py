#!/usr/bin/env python
"""prepare_data.py's throughput: a synthetic JSONL corpus, a byte-level BPE tokenizer of realistic size
trained on it, then the real prepare() with 1..N workers; prints tokens/s for each, side by side, and
checks the outputs are byte-identical.

    python benchmarks/bench_prepare.py                       # 50 MB of text, a 32k BPE, workers 1 and 2
    python benchmarks/bench_prepare.py --mb 200 --vocab 50257 --workers 1 2 4 8
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from utils.data.prepare import prepare  # noqa: E402



def corpus(path: Path, megabytes: float, seed: int = 0) -> int:
    """JSONL documents of Zipf-distributed pseudo-words (a vocabulary of 20k), 50-2000 words each."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 10))) for _ in range(20_000)]
    weights = [1.0 / (i + 1) for i in range(len(words))]
    written, docs = 0, 0
    with open(path, "w") as f:
        while written < megabytes * 1e6:
            text = " ".join(rng.choices(words, weights, k=rng.randint(50, 2000)))
            line = json.dumps({"text": text}) + "\n"
            f.write(line)
            written += len(line)
            docs += 1
    return docs


def tokenizer(path: Path, sample: Path, vocab: int) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    with open(sample) as f:
        lines = [json.loads(next(f))["text"] for _ in range(2000)]
    tok.train_from_iterator(lines, trainer)
    tok.save(str(path))
    return path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, default=50.0, help="corpus size in MB of JSONL")
    p.add_argument("--vocab", type=int, default=32_000)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_prepare_") as tmp:
        work = Path(tmp)
        t0 = time.perf_counter()
        docs = corpus(work / "corpus.jsonl", args.mb)
        tok = tokenizer(work / "tokenizer.json", work / "corpus.jsonl", args.vocab)
        print(f"# prepare_data throughput: {args.mb:g} MB JSONL ({docs:,} documents), byte-level BPE "
              f"{args.vocab:,} ids (made in {time.perf_counter() - t0:.0f} s)")
        print(f"device: cpu {platform.processor() or platform.machine()} ({os.cpu_count()} cores), date {date.today()}")
        print(f"command: python benchmarks/{Path(__file__).name} {' '.join(sys.argv[1:])}\n")
        print("| workers | seconds | tokens | tokens/s | MB/s of text |\n| ---: | ---: | ---: | ---: | ---: |")
        trees = []
        for w in args.workers:
            out = work / f"out{w}"
            result = prepare([str(work / "corpus.jsonl")], str(tok), out, workers=w)
            rate = result.tokens / result.seconds
            print(f"| {w} | {result.seconds:.1f} | {result.tokens:,} | {rate:,.0f} | {args.mb / result.seconds:.1f} |",
                  flush=True)
            trees.append({p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()})
        same = all(t == trees[0] for t in trees)
        print(f"\noutputs byte-identical across worker counts: {'yes' if same else 'NO'}")
        return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
