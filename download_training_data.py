"""Mirror tokenized .npz shards from GCS to local disk: verified (size + crc32c), parallel, resumable.
With them, the dataset.json and tokenizer.json that prepare_data.py writes at the prefix's root.

    python download_training_data.py --source gs://BUCKET/PREFIX --dest data/training [--workers N]
        [--max-files N] [--dry-run]
    python download_training_data.py --source web=gs://B/web --source code=gs://B/code --dest data/
        (several sources in one call: each into DEST/NAME; NAME defaults to the prefix's last part)

Files already present with the right size and crc32c are skipped, so running it again finishes an
interrupted sync. Exit status: 0 when every object is in place, 1 when any failed, 2 for bad arguments.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from utils.cli import CommandLine, number_flag
from utils.data.download import SyncOptions, sync_prefix
from utils.errors import DiskFullError
from utils.io.storage import CredentialsError, StorageError, make_client, parse_gs_url


def parse_args(argv=None) -> argparse.Namespace:
    parser = CommandLine(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", required=True, action="append", metavar="[NAME=]gs://BUCKET/PREFIX",
                        help="where the .npz shards are; repeat it to mirror several sources, each into DEST/NAME")
    parser.add_argument("--dest", default="data/training", help="local folder (default: data/training)")
    parser.add_argument("--workers", type=number_flag("int"), default=8, help="parallel downloads (default: 8)")
    parser.add_argument("--max-files", type=number_flag("int"), default=None,
                        help="only the first N shards in name order, per source (default: all)")
    parser.add_argument("--dry-run", action="store_true", help="list what would be downloaded; transfer nothing")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def plan(sources: list[str], dest: str) -> list[tuple[str, Path]]:
    """--source values and --dest -> (gs:// URL, local folder) pairs; ValueError for bad input. One source
    goes into DEST itself; several go into DEST/NAME each (NAME= given, or the prefix's last part)."""
    pairs = []
    for given in sources:
        name, url = given.split("=", 1) if "=" in given and not given.startswith("gs://") else (None, given)
        try:
            parse_gs_url(url)
        except ValueError as exc:
            raise ValueError(f"--source {given}: {exc}") from None
        name = name or url.rstrip("/").rsplit("/", 1)[-1]
        if not name or name in (".", "..") or "/" in name:
            raise ValueError(f"--source {given}: '{name}' cannot be a folder name; write NAME=gs://...")
        pairs.append((name, url))
    if len(pairs) == 1:
        return [(pairs[0][1], Path(dest))]
    names = [n for n, _ in pairs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"--source: two sources would go into {Path(dest) / twice[0]}; name them: NAME=gs://...")
    return [(url, Path(dest) / name) for name, url in pairs]


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        jobs = plan(args.source, args.dest)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.workers < 1:
        print(f"error: --workers must be at least 1, got {args.workers}", file=sys.stderr)
        return 2
    if args.max_files is not None and args.max_files < 1:
        print(f"error: --max-files must be at least 1, got {args.max_files}; leave it out to download every "
              f"shard", file=sys.stderr)
        return 2
    code = 0
    for url, dest in jobs:
        if len(jobs) > 1:
            print(f"{url} -> {dest}", flush=True)
        try:
            report = sync_prefix(make_client, url, dest, SyncOptions(workers=args.workers, max_files=args.max_files,
                                                                     dry_run=args.dry_run,
                                                                     progress=not args.no_progress))
        except CredentialsError as exc:
            print(f"error: credentials: {exc}", file=sys.stderr)
            return 1
        except (StorageError, DiskFullError) as exc:
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
            code = 1
    return code


if __name__ == "__main__":
    sys.exit(main())
