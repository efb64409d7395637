"""Mirror tokenized .npz shards from GCS to local disk: verified (size + crc32c), parallel, resumable.
With them, the dataset.json and tokenizer.json that prepare_data.py writes at the prefix's root.

    python download_training_data.py --source gs://BUCKET/PREFIX --dest data/training [--workers N]
        [--max-files N] [--dry-run]

Files already present with the right size and crc32c are skipped, so running it again finishes an
interrupted sync. Exit status: 0 when every object is in place, 1 when any failed, 2 for bad arguments.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from utils.storage import CredentialsError, StorageError, make_client, parse_gs_url, sync_prefix  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", required=True, help="gs://BUCKET/PREFIX holding the .npz shards")
    parser.add_argument("--dest", default="data/training", help="local folder (default: data/training)")
    parser.add_argument("--workers", type=int, default=8, help="parallel downloads (default: 8)")
    parser.add_argument("--max-files", type=int, default=-1,
                        help="only the first N shards in name order (default: all)")
    parser.add_argument("--dry-run", action="store_true", help="list what would be downloaded; transfer nothing")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        parse_gs_url(args.source)
    except ValueError as exc:
        print(f"error: --source: {exc}", file=sys.stderr)
        return 2
    if args.workers < 1:
        print(f"error: --workers must be at least 1, got {args.workers}", file=sys.stderr)
        return 2
    try:
        report = sync_prefix(make_client, args.source, args.dest, workers=args.workers, max_files=args.max_files,
                             dry_run=args.dry_run, progress=not args.no_progress)
    except CredentialsError as exc:
        print(f"error: credentials: {exc}", file=sys.stderr)
        return 1
    except StorageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; run the same command again to finish (completed files are kept)", file=sys.stderr)
        return 130
    print(report.summary(), flush=True)
    if report.failed:
        n = len(report.failed)
        print(f"error: {n} object{'s' if n != 1 else ''} failed: {' '.join(report.failed)}; "
              "run the same command again to retry them", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
