#!/usr/bin/env python
"""How much a checkpoint costs the training loop.

Runs the real train.py on the same synthetic shards in five variants and prints, side by side:
- per checkpoint: how long the loop was blocked vs how long the device -> host copy took
  (the rest of the save, writing and uploading, runs in background threads);
- median step time with no checkpoints, with local checkpoints, with checkpoints uploaded to a GCS
  bucket (an in-process gcp-storage-emulator here; STORAGE_EMULATOR_HOST of your own to use another),
  and with GCS refusing connections or accepting them and never answering.
Step times come from the metrics rows, which leave checkpoint and eval time out of tokens/s: the cost of
a save is its "loop blocked" column.

`--copy-rate` instead measures the snapshot's device->host copy at the 1.2B model's size: the first
snapshot (allocating, and on CUDA pinning, host buffers) against the next ones (reusing them).

    python benchmarks/bench_checkpoint.py                      # CPU: the demo model
    python benchmarks/bench_checkpoint.py --model gpt-neox-1.2b --precision bf16 --steps 40 --save-every 10
    python benchmarks/bench_checkpoint.py --copy-rate          # 1.2B-sized state: GPU->pinned host, or host->host
    python benchmarks/bench_checkpoint.py --strategy fsdp      # sharded saves (DCP's async save) instead
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

from configs import get_model_spec

REPO_ROOT = Path(__file__).resolve().parent.parent



def make_shards(data_dir: Path, files: int, rows: int, seq_len: int, vocab: int) -> None:
    import numpy as np

    rng = np.random.default_rng(0)
    for i in range(files):
        (data_dir / f"part-{i % 2}").mkdir(parents=True, exist_ok=True)
        ids = rng.integers(0, vocab, size=(rows, seq_len), dtype=np.uint16 if vocab <= 65536 else np.int32)
        np.savez(data_dir / f"part-{i % 2}" / f"shard-{i:03d}.npz", input_ids=ids)


def run_train(out: Path, data: Path, args, sets: list[str], env: dict,
              allow_upload_failure: bool = False) -> list[dict]:
    cmd = [sys.executable, str(REPO_ROOT / "train.py"), "--config", "production", "--output-dir", str(out),
           "--data-dir", str(data), "--set", f"model={args.model}", "--set", f"mixed_precision={args.precision}",
           "--set", f"compile_model={str(args.compile).lower()}", "--set", "logging_steps=1",
           "--set", f"max_steps={args.steps}", "--set", "eval_interval=1000000", "--set", "val_files=1",
           "--set", f"per_device_train_batch_size={args.micro_batch}", "--set", "gradient_accumulation_steps=1",
           "--set", "dataloader_num_workers=0", "--set", "warmup_steps=2", "--set", "profile=off",
           "--set", "preflight_steps=0", "--set", f"seq_len={args.seq_len}", "--set", f"strategy={args.strategy}"]
    for s in sets:
        cmd += ["--set", s]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0 and not (allow_upload_failure and proc.returncode == 1):
        sys.exit(f"train.py failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]


class BlackHole:
    """A TCP endpoint that accepts connections and never answers: a GCS that hangs."""

    def __init__(self):
        import threading

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.held = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                self.held.append(self.sock.accept()[0])
            except OSError:
                return

    def close(self):
        self.sock.close()
        for conn in self.held:
            conn.close()


def copy_rate(rounds: int) -> int:
    """The snapshot's copy at the 1.2B model's size: fresh host buffers, then reused ones."""
    import torch

    from utils.checkpoint.format import HostBuffers, snapshot_to_cpu

    spec = get_model_spec("gpt-neox-1.2b")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    h, f, v, layers = spec.hidden_size, spec.intermediate_size, spec.padded_vocab_size, spec.num_hidden_layers
    shapes = [(v, h), (v, h), (h,), (h,)] + layers * [(3 * h, h), (3 * h,), (h, h), (h,), (f, h), (f,), (h, f),
                                                     (h,), (h,), (h,), (h,), (h,)]
    state = {f"t{i}": torch.ones(shape, device=device) for i, shape in enumerate(shapes)}  # fp32 weights
    gb = sum(t.numel() * 4 for t in state.values()) / 1e9
    buffers = HostBuffers()
    print(f"# Snapshot copy at the 1.2B model's size: {gb:.2f} GB of fp32 weights ({len(state)} tensors), "
          f"{device} -> {'pinned ' if device == 'cuda' else ''}host memory")
    print(f"device: {torch.cuda.get_device_name(0) if device == 'cuda' else 'cpu ' + platform.processor()} "
          f"({os.cpu_count()} cores), torch {torch.__version__}, date {date.today()}")
    print(f"command: python benchmarks/{Path(__file__).name} {' '.join(sys.argv[1:])}\n")
    print("| snapshot | seconds | GB/s | host buffers allocated (GB) |\n| --- | ---: | ---: | ---: |")
    for r in range(rounds):
        before = buffers.allocated_bytes
        started = time.perf_counter()
        snapshot_to_cpu(state, buffers)
        seconds = time.perf_counter() - started
        label = "first (allocates)" if r == 0 else f"{r + 1} (reuses)"
        print(f"| {label} | {seconds:.2f} | {gb / seconds:.1f} | {(buffers.allocated_bytes - before) / 1e9:.2f} |")
    return 0


def step_times(rows: list[dict], skip: int) -> list[float]:
    return [1.0 / r["steps_per_sec"] for r in rows if "steps_per_sec" in r and r["step"] > skip]


def main() -> int:
    cuda = __import__("torch").cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-neox-1.2b" if cuda else "demo")
    p.add_argument("--precision", default="bf16" if cuda else "no")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=cuda)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--micro-batch", type=int, default=4 if cuda else 8)
    p.add_argument("--seq-len", type=int, default=0, help="0: the model's context")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds; medians across them")
    p.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp",
                   help="fsdp: sharded checkpoints (every rank's shards through DCP's async save), one process")
    p.add_argument("--copy-rate", action="store_true", help="measure the snapshot copy at 1.2B size and exit")
    args = p.parse_args()
    if args.copy_rate:
        return copy_rate(rounds=4)
    spec = get_model_spec(args.model)
    args.seq_len = args.seq_len or spec.max_position_embeddings

    work = Path(tempfile.mkdtemp(prefix="bench_ckpt_"))
    data = work / "data"
    make_shards(data, files=3, rows=max(64, args.micro_batch * args.steps // 2 + 1), seq_len=args.seq_len,
                vocab=spec.vocab_size)
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))

    server = None
    if "STORAGE_EMULATOR_HOST" not in env:
        from gcp_storage_emulator.server import create_server

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = create_server("127.0.0.1", port, in_memory=True, default_bucket="bench")
        server.start()
        env["STORAGE_EMULATOR_HOST"] = f"http://127.0.0.1:{port}"
    bucket = os.environ.get("BENCH_BUCKET", "bench")

    skip = 3  # warm-up steps
    far = str(10 * args.steps)
    hole = BlackHole()
    upload = [f"save_steps={args.save_every}", f"gcs_bucket={bucket}", "upload_timeout_s=5"]
    variants = {  # label: (--set values, STORAGE_EMULATOR_HOST)
        "no checkpoints": ([f"save_steps={far}"], env["STORAGE_EMULATOR_HOST"]),
        "local checkpoints": ([f"save_steps={args.save_every}"], env["STORAGE_EMULATOR_HOST"]),
        "checkpoints + GCS upload": (upload, env["STORAGE_EMULATOR_HOST"]),
        "GCS refusing connections": (upload, "http://127.0.0.1:9"),
        "GCS never answering": (upload, hole.url),
    }
    runs = {label: [] for label in variants}
    for r in range(args.repeats):  # interleaved, so a noisy neighbour hits every variant alike
        for i, (label, (sets, host)) in enumerate(variants.items()):
            runs[label].append(run_train(work / f"r{r}-{i}", data, args, sets + [f"run_name=bench{r}"],
                                         env | {"STORAGE_EMULATOR_HOST": host}, allow_upload_failure=True))
    hole.close()
    if server is not None:
        server.stop()

    print(f"# Checkpoint cost ({args.strategy}): model {args.model}, "
          f"micro-batch {args.micro_batch} x seq {args.seq_len}, "
          f"{args.precision}, {args.steps} steps, a checkpoint every {args.save_every}, "
          f"{args.repeats} interleaved rounds (medians)")
    print(f"device: {'cuda ' + __import__('torch').cuda.get_device_name(0) if cuda else 'cpu ' + platform.processor()}"
          f" ({os.cpu_count()} cores), date {date.today()}")
    print(f"command: python benchmarks/{Path(__file__).name} {' '.join(sys.argv[1:])}\n")
    print("| run | median step (ms) | mean step (ms) | checkpoints | median loop blocked (ms) | "
          "median device->host copy (ms) |")
    print("| --- | --- | --- | --- | --- | --- |")
    base = None
    for label, repeats in runs.items():
        med = statistics.median(statistics.median(step_times(rows, skip)) for rows in repeats) * 1000
        mean = statistics.median(statistics.mean(step_times(rows, skip)) for rows in repeats) * 1000
        base = base or med
        # the final save (at max_steps) happens after the last timed step
        saves = [r for rows in repeats for r in rows if "checkpoint" in r and r["step"] < args.steps]
        blocked = f"{statistics.median(r['blocked_s'] for r in saves) * 1000:.1f}" if saves else "-"
        copy = f"{statistics.median(r['copy_s'] for r in saves) * 1000:.1f}" if saves else "-"
        print(f"| {label} | {med:.1f} ({med / base:.2f}x) | {mean:.1f} | {len(saves)} | {blocked} | {copy} |")
    ckpt = next((work / "r0-1" / "checkpoints").iterdir())
    size = sum(f.stat().st_size for f in ckpt.iterdir()) / 2**20
    print(f"\ncheckpoint size: {size:.1f} MiB ({ckpt.name}); step times are per optimizer step after "
          f"{skip} warm-up steps (a save's blocked time falls in the next step, so it shows in the mean); "
          f"blocked = the whole save call on the training thread")
    return 0


if __name__ == "__main__":
    sys.exit(main())
