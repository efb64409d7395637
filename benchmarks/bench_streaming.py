#!/usr/bin/env python
"""Time to the first training batch from a bucket: streaming (`data_dir=gs://...`) against the full download
(download_training_data.py, then the shard index's validation), on a corpus of many shards in the GCS
emulator (gcp-storage-emulator, in this process, serving one request at a time on localhost: what it
measures is how many bytes each path moves and checks before step 1, not a network).

Writes `--shards` 1-D uint16 shards of `--shard-tokens` ids with prepare_data.py's dataset.json, uploads them
to the emulator, then for each order: the streamed source opened (dataset.json fetched, index built) and the
loader's first micro-batch; and the download workflow: every shard synced (verified), indexed (validated),
the first micro-batch. Prints both times, their ratio, and the bytes each moved before the first batch.

    python benchmarks/bench_streaming.py                         # 96 shards of 1M tokens (2 MB), micro-batch 8
    python benchmarks/bench_streaming.py --shards 256 --shard-tokens 4194304 --json streaming.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import numpy as np


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_dataset(root: Path, shards: int, shard_tokens: int, vocab: int) -> int:
    """prepare_data.py's layout (part-NNNNN/shard-NNNNN.npz and a dataset.json); returns the bytes of shards."""
    from utils.data.dataset_info import FILE, FORMAT, VERSION
    from utils.data.partition import save_shard
    from utils.data.prepare import shard_name

    rng = np.random.default_rng(0)
    entries = [save_shard(root, shard_name("", k), rng.integers(1, vocab, shard_tokens, dtype=np.uint16))
               for k in range(shards)]
    (root / FILE).write_text(json.dumps({
        "format": FORMAT, "version": VERSION, "dtype": "uint16", "documents": shards,
        "tokens": shards * shard_tokens, "shard_tokens": shard_tokens, "shards": entries,
        "tokenizer": {"file": "tokenizer.json", "vocab_size": vocab, "eos_id": 0, "eos_token": "<|endoftext|>"}}))
    return sum(e["bytes"] for e in entries)


def first_batch_streaming(url: str, cache: Path, order, seq_len: int, micro: int, vocab: int):
    """(seconds to the first micro-batch, bytes fetched by then, the shards that micro-batch reads)."""
    from utils.data.build import open_source
    from utils.data.loader import RankSlice, ResumableLoader, source_schedule
    from utils.data.source import CacheBudget, OpenRequest, Source

    started = time.perf_counter()
    request = OpenRequest(seq_len, vocab, log=lambda _line: None, shuffle=order, step_sequences=micro,
                          cache_dir=str(cache), cache=CacheBudget())
    train, _ = open_source(Source("data", path=url), request)
    loader = ResumableLoader(train, micro, 0, 1, seed=0, shuffle=order)
    next(loader)
    seconds, fetched = time.perf_counter() - started, train._fetcher.fetched_bytes
    loader.close()
    while train._fetcher._inflight:  # downloads still running would slow the next measurement
        time.sleep(0.01)
    first = next(source_schedule(loader.specs, RankSlice(micro, 0, 1), 0, ((0,), (0,), (1.0,)), order, 0))
    return seconds, fetched, sorted(set(np.searchsorted(train._cumulative, first, side="right").tolist()))


def fetch_alone(url: str, dest: Path, shards: list[int]) -> float:
    """Seconds to download just these shards (verified, 4 at a time, as the fetcher does)."""
    from concurrent.futures import ThreadPoolExecutor

    from utils.data.dataset_info import DatasetInfo
    from utils.data.source import Source
    from utils.data.stream_source import description_dir
    from utils.io.storage import RemoteObject, download_verified, make_client

    entries = DatasetInfo.load(description_dir(Source("data", path=url), str(dest))).shards
    started = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda f: download_verified(make_client(), "bench", RemoteObject(
            f"ds/{entries[f]['path']}", entries[f]["bytes"], entries[f]["crc32c"]), dest / entries[f]["path"]), shards))
    return time.perf_counter() - started


def first_batch_downloaded(url: str, dest: Path, order, seq_len: int, micro: int, vocab: int) -> tuple[float, int]:
    from utils.data.build import open_source
    from utils.data.download import SyncOptions, sync_prefix
    from utils.data.loader import ResumableLoader
    from utils.data.source import OpenRequest, Source
    from utils.io.storage import make_client

    started = time.perf_counter()
    report = sync_prefix(make_client, url, dest, SyncOptions(workers=8, progress=False))
    request = OpenRequest(seq_len, vocab, log=lambda _line: None, shuffle=order, step_sequences=micro)
    train, _ = open_source(Source("data", path=dest, val_files=0), request)
    next(ResumableLoader(train, micro, 0, 1, seed=0, shuffle=order))
    return time.perf_counter() - started, report.bytes


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shards", type=int, default=96)
    p.add_argument("--shard-tokens", type=int, default=1 << 20)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro", type=int, default=8, help="sequences in the first micro-batch")
    p.add_argument("--block-shards", type=int, default=16, help="shuffle=blocks: shards per block")
    p.add_argument("--repeats", type=int, default=3, help="measurements of each, the median reported")
    p.add_argument("--json", help="write the figures here too")
    args = p.parse_args()

    import logging

    from gcp_storage_emulator.server import create_server

    from utils.data.mixture import Shuffle
    from utils.io.storage import make_client, upload_verified

    logging.getLogger("gcp_storage_emulator").setLevel(logging.CRITICAL)  # a missing tokenizer.json is fine here
    port = free_port()
    server = create_server("127.0.0.1", port, in_memory=True, default_bucket="bench")
    server.start()
    os.environ["STORAGE_EMULATOR_HOST"] = f"http://127.0.0.1:{port}"
    work = Path(tempfile.mkdtemp(prefix="bench-streaming-"))
    vocab = 50_000
    try:
        corpus_bytes = make_dataset(work / "made", args.shards, args.shard_tokens, vocab)
        client = make_client()
        for path in sorted((work / "made").rglob("*.npz")) + [work / "made" / "dataset.json"]:
            upload_verified(client, "bench", path, f"ds/{path.relative_to(work / 'made').as_posix()}")
        url = "gs://bench/ds"
        rows = []
        for order in (Shuffle(), Shuffle("blocks", args.block_shards)):
            runs = []
            for k in range(args.repeats):  # fresh folders each time: nothing cached
                streamed, streamed_bytes, first = first_batch_streaming(
                    url, work / f"cache-{order.kind}-{k}", order, args.seq_len, args.micro, vocab)
                alone = fetch_alone(url, work / f"alone-{order.kind}-{k}", first)
                downloaded, downloaded_bytes = first_batch_downloaded(url, work / f"copy-{order.kind}-{k}", order,
                                                                      args.seq_len, args.micro, vocab)
                shutil.rmtree(work / f"copy-{order.kind}-{k}")
                runs.append((streamed, streamed_bytes, alone, downloaded, downloaded_bytes))
            streamed, streamed_bytes, alone, downloaded, downloaded_bytes = (
                sorted(column)[len(column) // 2] for column in zip(*runs))
            rows.append({"order": order.describe(), "streamed_s": round(streamed, 3),
                         "streamed_mb_at_step_1": round(streamed_bytes / 1e6, 1), "first_batch_shards": len(first),
                         "first_shards_alone_s": round(alone, 3), "download_s": round(downloaded, 3),
                         "download_mb": round(downloaded_bytes / 1e6, 1), "ratio": round(downloaded / streamed, 1)})
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)

    print(f"corpus: {args.shards} shards of {args.shard_tokens:,} tokens, {corpus_bytes / 1e6:,.1f} MB in the "
          f"emulator; first micro-batch of {args.micro} sequences of {args.seq_len} tokens; median of "
          f"{args.repeats} measurements")
    print("| order | streamed: s to the first batch | MB fetched by then | shards it reads | those shards "
          "alone: s | download + index: s | MB | download / streamed |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['order']} | {r['streamed_s']:.2f} | {r['streamed_mb_at_step_1']:,.1f} | "
              f"{r['first_batch_shards']} | {r['first_shards_alone_s']:.2f} | {r['download_s']:.2f} | "
              f"{r['download_mb']:,.1f} | {r['ratio']:.1f}x |")
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    print(f"{date.today().isoformat()}, {machine}")
    if args.json:
        Path(args.json).write_text(json.dumps({"date": date.today().isoformat(), "machine": machine,
                                               "args": vars(args), "corpus_mb": round(corpus_bytes / 1e6, 1),
                                               "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
