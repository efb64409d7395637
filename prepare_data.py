#!/usr/bin/env python
"""Turn a corpus and a tokenizer into the engine's training shards (+ tokenizer.json, plan.json, dataset.json).

    python prepare_data.py --input corpus/ more/*.jsonl.gz --tokenizer tokenizer.json --output data/training
    python prepare_data.py --input corpus/ --tokenizer path/to/hf-tokenizer-dir --output data/mine \\
        --workers 8 --upload gs://my-bucket/datasets/mine
    python prepare_data.py --input gs://my-bucket/corpus --tokenizer tokenizer.json \\
        --output gs://my-bucket/datasets/mine --executor ray --ray-address ray://head:10001

Inputs (local or gs://): .txt (one document per file), .jsonl (one document per line, in --text-field),
either gzipped, and .parquet (with pyarrow installed); folders and prefixes are searched recursively. The
inputs are cut into partitions of about --partition-mb (a .jsonl or .parquet anywhere, a .txt or .gz
whole), tokenized by --executor, each document followed by the tokenizer's end-of-document token. Output:
1-D uint16 shards (uint32 above 65,536 ids) of --shard-tokens ids in part-NNNNN/ folders, the last of
each partition shorter; a validation split (documents whose seeded hash of file and position falls under
--val-fraction) under val/; tokenizer.json, plan.json and dataset.json (vocabulary, EOS, counts, both
splits, every shard's size and crc32c). The output is the same bytes whatever the executor, --workers or
the number of reruns; a killed run leaves nothing that looks like a dataset, and running the same command
again finishes it, redoing only the partitions not done (or, when the output is complete, does nothing).
Exit status: 0 done, 1 upload failed (the local dataset is complete), 2 bad input.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

from utils.cli import CommandLine, number_flag
from utils.data.partition import DEFAULT_PARTITION_BYTES, MIN_VAL_DOCUMENTS
from utils.data.prepare import DEFAULT_SHARD_TOKENS, DEFAULT_SPLIT_SEED, DEFAULT_VAL_FRACTION
from utils.errors import UserError


def parse_args(argv=None) -> argparse.Namespace:
    p = CommandLine(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, metavar="PATH",
                   help="files, folders or globs, or gs://BUCKET/PREFIX (a folder or one object)")
    p.add_argument("--tokenizer", required=True, help="a tokenizer.json, or an HF tokenizer directory (with "
                                                      "tokenizer.json, or GPT-2-style vocab.json + merges.txt)")
    p.add_argument("--output", required=True,
                   help="the folder to create (empty or absent), or gs://BUCKET/PREFIX, written straight there")
    p.add_argument("--workers", type=number_flag("int"), default=max(1, (os.cpu_count() or 2) - 1),
                   help="partitions tokenized at once: processes with --executor local, CPUs of a local Ray "
                        "(default: cores - 1; with --ray-address the cluster's CPUs decide)")
    p.add_argument("--executor", choices=("local", "ray"), default="local",
                   help="local: a process pool on this machine (default); ray: one Ray task per partition, "
                        "retried on failure (pip install 'ray==2.60.0')")
    p.add_argument("--ray-address", metavar="ADDRESS",
                   help="join this running Ray cluster (ray://HOST:10001, or HOST:6379 on a node of it); "
                        "without it --executor ray starts a local Ray")
    p.add_argument("--partition-mb", type=megabytes, default=DEFAULT_PARTITION_BYTES / 1e6,
                   help=f"input megabytes per partition, the unit of work and of reruns (default "
                        f"{DEFAULT_PARTITION_BYTES / 1e6:g}); a partition's last shard is shorter")
    p.add_argument("--merge-only", action="store_true",
                   help="tokenize nothing: merge the partitions already done, refusing, by name, any missing")
    p.add_argument("--text-field", default="text", help="the JSONL field / Parquet column holding the text")
    p.add_argument("--shard-tokens", type=number_flag("int"), default=DEFAULT_SHARD_TOKENS,
                   help=f"token ids per shard (default {DEFAULT_SHARD_TOKENS:,} = 2^24: 32 MiB as uint16, so a "
                        f"bucket holds thousands of objects and each downloads quickly; for a small corpus use "
                        f"less, so the training split has several shards: prepare warns when it has fewer than 8)")
    p.add_argument("--val-fraction", type=number_flag("float"), default=DEFAULT_VAL_FRACTION,
                   help=f"share of the documents, drawn by a seeded hash of each one's file and position, held out "
                        f"as the validation split under val/ (default {DEFAULT_VAL_FRACTION}; raised for a corpus "
                        f"too small for {MIN_VAL_DOCUMENTS} documents at that rate, at most a quarter; 0: no split)")
    p.add_argument("--split-seed", type=number_flag("int"), default=DEFAULT_SPLIT_SEED,
                   help="seed of the validation draw")
    p.add_argument("--eos-token", help="the end-of-document token (default: the tokenizer's own)")
    p.add_argument("--upload", metavar="gs://BUCKET/PREFIX", help="then upload the result there, verified")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


MAX_PARTITION_MB = 1e9  # a petabyte: one partition of any corpus there is


def megabytes(text: str) -> float:
    """--partition-mb's type: a number above 0, at most MAX_PARTITION_MB."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number of megabytes") from None
    if not math.isfinite(value) or value <= 0 or value > MAX_PARTITION_MB:
        raise argparse.ArgumentTypeError(f"'{text}' must be a number of megabytes above 0 and at most "
                                         f"{MAX_PARTITION_MB:,.0f}")
    return value


def main(argv=None) -> int:
    args = parse_args(argv)
    import signal

    from utils.data.prepare import (
        BucketLock,
        PrepareOptions,
        check_upload_url,
        lock_output,
        prepare,
        report_line,
        stderr_progress,
        upload,
    )

    signal.signal(signal.SIGTERM, _interrupt)  # stop the pool and clean up, as for Ctrl-C
    progress = None if args.no_progress else stderr_progress()
    lock = None
    try:
        check_upload_url(args.upload)
        if args.upload and args.output.startswith("gs://"):
            raise UserError(f"--upload with --output {args.output}: the dataset is written there already")
        lock = BucketLock(args.output).acquire() if args.output.startswith("gs://") else lock_output(args.output)
        options = PrepareOptions(args.workers, args.text_field, args.shard_tokens, args.eos_token, args.val_fraction,
                                 args.split_seed, round(args.partition_mb * 1e6), args.executor, args.ray_address,
                                 args.merge_only)
        result = prepare(args.input, args.tokenizer, args.output, options, progress=progress,
                         log=lambda line: print(line, flush=True))
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: nothing was published; the partitions already done are kept: run the same command "
              "again to finish", file=sys.stderr)
        return 130
    finally:
        if progress is not None:
            progress.close()
        if lock is not None:
            lock.release()
    print(report_line(result), flush=True)
    for note in result.notes:
        print(note, file=sys.stderr, flush=True)
    if args.upload:
        try:
            count = upload(result.output, args.upload)
        except UserError as exc:
            print(f"error: upload to {args.upload} failed: {exc}; the local dataset in {result.output} is complete: "
                  f"run the same command again to retry", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print(f"interrupted during the upload to {args.upload}; the local dataset in {result.output} is complete: "
                  f"run the same command again to finish the upload", file=sys.stderr)
            return 130
        print(f"uploaded {count} files to {args.upload}; mirror it on each training machine with: python "
              f"download_training_data.py --source {args.upload} --dest DIR", flush=True)
    return 0


def _interrupt(signum, frame):
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
