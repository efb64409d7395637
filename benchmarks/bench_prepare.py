#!/usr/bin/env python
"""prepare_data.py's throughput: a synthetic JSONL corpus, a byte-level BPE tokenizer of realistic size
trained on it, then the real prepare() for each executor (local, ray) and worker count, on the same corpus
cut into the same partitions; prints tokens/s side by side, each executor's start-up time and Ray's
overhead against the local pool, and checks the outputs are byte-identical.

    python benchmarks/bench_prepare.py                       # 50 MB of text, a 32k BPE, local and ray, 1 and 2 workers
    python benchmarks/bench_prepare.py --mb 200 --vocab 50257 --workers 1 2 4 8 --executors local
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

from utils.data.prepare import PrepareOptions, prepare


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
    p.add_argument("--executors", nargs="+", choices=("local", "ray"), default=["local", "ray"])
    p.add_argument("--partition-mb", type=float, default=None,
                   help="input MB per partition (default: --mb / 8, so every worker count has partitions to share)")
    args = p.parse_args()
    partition_mb = args.partition_mb or args.mb / 8
    with tempfile.TemporaryDirectory(prefix="bench_prepare_") as tmp:
        work = Path(tmp)
        t0 = time.perf_counter()
        docs = corpus(work / "corpus.jsonl", args.mb)
        tok = tokenizer(work / "tokenizer.json", work / "corpus.jsonl", args.vocab)
        print(f"# prepare_data throughput: {args.mb:g} MB JSONL ({docs:,} documents), byte-level BPE "
              f"{args.vocab:,} ids (made in {time.perf_counter() - t0:.0f} s)")
        print(f"device: cpu {platform.processor() or platform.machine()} ({os.cpu_count()} cores), date {date.today()}")
        print(f"command: python benchmarks/{Path(__file__).name} {' '.join(sys.argv[1:])}\n")
        print(f"partitions of {partition_mb:g} MB\n")
        print("| executor | workers | partitions | seconds | start-up s | tokens | tokens/s | MB/s of text |\n"
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        trees, seconds = [], {}
        for executor in args.executors:
            for w in args.workers:
                out = work / f"out-{executor}{w}"
                result = prepare([str(work / "corpus.jsonl")], str(tok), out,
                                 PrepareOptions(workers=w, executor=executor,
                                                partition_bytes=round(partition_mb * 1e6)))
                seconds[executor, w] = result.seconds
                rate = result.tokens / result.seconds
                print(f"| {executor} | {w} | {result.partitions} | {result.seconds:.1f} | "
                      f"{result.startup_seconds:.1f} | {result.tokens:,} | {rate:,.0f} | "
                      f"{args.mb / result.seconds:.1f} |", flush=True)
                trees.append({p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()})
        for w in args.workers:
            if ("local", w) in seconds and ("ray", w) in seconds:
                extra = seconds["ray", w] - seconds["local", w]
                print(f"\nray against local, {w} worker(s): {seconds['ray', w] / seconds['local', w]:.2f}x the time "
                      f"({extra:+.1f} s)")
        same = all(t == trees[0] for t in trees)
        print(f"\noutputs byte-identical across executors and worker counts: {'yes' if same else 'NO'}")
        return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
