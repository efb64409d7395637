"""How fast utils/data/ feeds one training process, on production-like shards.

    python benchmarks/data_throughput.py                      # 4 x 256 MB synthetic shards in a temp dir
    python benchmarks/data_throughput.py --data-dir data/training --seconds 10

Writes `--shards` uint16 token-stream shards (seq_len 2048, vocab 50257) unless --data-dir already holds
shards, then prints the index build time (first scan and cached) and the ResumableLoader's tokens/s for
each (num_workers, micro_batch_size). One H100 training the 1.2B model consumes about 55 K tokens/s; the
loader should give >= 10 M tokens/s per process. Not a test: it prints figures.
"""
from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np


from utils.data.dataset import TokenSequenceDataset
from utils.data.index import CACHE_NAME, ShardIndex
from utils.data.loader import Readers, ResumableLoader


def write_shard(path: Path, tokens: int, vocab: int, seed: int, rows: int = 0) -> None:
    """An uncompressed npz of random ids, written in chunks (never the whole array in memory)."""
    shape = (tokens // rows, rows) if rows else (tokens,)
    rng = np.random.default_rng(seed)
    chunk = 1 << 24
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf, zf.open("input_ids.npy", "w", force_zip64=True) as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "<u2", "fortran_order": False, "shape": shape})
        total = int(np.prod(shape))
        for start in range(0, total, chunk):
            f.write(rng.integers(0, vocab, min(chunk, total - start), dtype=np.uint16).tobytes())


def measure(dataset, micro: int, workers: int, seconds: float, seq_len: int) -> tuple[float, float]:
    """-> (tokens/s over `seconds` after the first batch, seconds to the first batch)."""
    loader = ResumableLoader(dataset, micro, rank=0, world_size=1, seed=0, readers=Readers(workers, 4))
    t0 = time.perf_counter()
    next(loader)
    first = time.perf_counter() - t0
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(50):
            next(loader)
        n += 50
    rate = n * micro * seq_len / (time.perf_counter() - t0)
    loader.close()
    return rate, first


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", help="use (or fill, if empty) this folder instead of a temp dir")
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--shard-mb", type=int, default=256)
    p.add_argument("--layout", choices=("stream", "rows"), default="stream")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--seconds", type=float, default=4.0, help="measuring time per configuration")
    p.add_argument("--workers", default="0,2")
    p.add_argument("--micro", default="4,8")
    args = p.parse_args()

    tmp = None
    if args.data_dir:
        root = Path(args.data_dir)
        root.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="data_throughput_")
        root = Path(tmp.name)
    try:
        if not any(root.rglob("*.npz")):
            t0 = time.perf_counter()
            tokens = args.shard_mb * (1 << 20) // 2
            for i in range(args.shards):
                write_shard(root / f"shard_{i:05d}.npz", tokens, args.vocab, seed=i,
                            rows=args.seq_len if args.layout == "rows" else 0)
            print(f"wrote {args.shards} x {args.shard_mb} MB {args.layout} shards to {root} "
                  f"in {time.perf_counter() - t0:.1f} s")
        (root / CACHE_NAME).unlink(missing_ok=True)
        t0 = time.perf_counter()
        index = ShardIndex.build(root, args.seq_len, args.vocab, log=lambda *_: None)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        index = ShardIndex.build(root, args.seq_len, args.vocab, log=lambda *_: None)
        warm = time.perf_counter() - t0
        size = sum((root / s.path).stat().st_size for s in index.shards)
        print(f"index: {len(index.shards)} files, {size / 1e9:.2f} GB, {index.num_sequences:,} sequences; "
              f"first build (scan + crc) {cold:.2f} s = {size / cold / 1e9:.1f} GB/s, cached build {warm * 1e3:.1f} ms")

        dataset = TokenSequenceDataset(index)
        big = dict(ResumableLoader(dataset, 8, 0, 1, 0).state_dict(), position=10**12)
        loader = ResumableLoader(dataset, 8, 0, 1, 0)
        t0 = time.perf_counter()
        loader.load_state_dict(big)
        next(loader)
        print(f"restore at position 1e12 + first batch: {(time.perf_counter() - t0) * 1e3:.1f} ms")

        print(f"\n| workers | micro-batch | tokens/s (M) | first batch (ms) |\n|---|---|---|---|")
        for workers in (int(w) for w in args.workers.split(",")):
            for micro in (int(m) for m in args.micro.split(",")):
                rate, first = measure(dataset, micro, workers, args.seconds, args.seq_len)
                print(f"| {workers} | {micro} | {rate / 1e6:.1f} | {first * 1e3:.0f} |", flush=True)
        print(f"\ncommand: python {' '.join(shlex.quote(a) for a in sys.argv)}")
    finally:
        if tmp is not None:
            tmp.cleanup()


if __name__ == "__main__":
    main()
