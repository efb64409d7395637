"""Where `prepare_data.py` writes: a folder on disk, or a `gs://` prefix written straight to (no local copy
of the dataset), behind one small interface so that partitions and the merge are written once.

Names are relative to the output's parent: `NAME/...` is the dataset, `.NAME.staging/...` the staging
area beside it (the plan, each partition's shards and completion record). Hidden, so neither a training
run nor `download_training_data.py` of the dataset's prefix ever reads it. On disk, a name read, sized or
moved is a regular file of its folder, never a symlink (a bucket's objects are nothing else). The merge
assembles the dataset under `assembly`: on disk inside the staging folder, renamed into place whole by
`finish()`; in a bucket, where nothing renames a folder, straight under `NAME/`, where `dataset.json`,
written last, says it is done.
"""
from __future__ import annotations

import os
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from utils.io import files


def output_store(output: str | Path) -> "LocalOutput | BucketOutput":
    return BucketOutput(output) if str(output).startswith("gs://") else LocalOutput(Path(output))


class LocalOutput:
    def __init__(self, output: Path):
        self.output = Path(os.path.abspath(output))
        self.base = self.output.parent
        self.name = self.output.name
        self.staging = f".{self.name}.staging"
        self.assembly = f"{self.staging}/dataset"
        self.disk = self.output  # where a full disk would be felt

    def url(self, name: str) -> str:
        return (self.base / name).as_posix()

    @contextmanager
    def scratch(self, folder: str) -> Iterator[Path]:
        """A local folder to write `folder`'s files in; `publish` then puts each in place. A symlink in its
        place is no folder of prepare's: it goes, and the folder is made (nothing is written where it leads)."""
        path = self.base / folder
        if path.is_symlink():
            path.unlink()
        path.mkdir(parents=True, exist_ok=True)
        yield path

    def publish(self, local: Path, name: str) -> None:
        target = self.base / name
        if Path(local) != target:
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(local, target)

    def regular_file(self, name: str) -> Path | None:
        """`name`'s path when it is a regular file inside its top folder (the dataset, or the staging area), else
        None: nothing there, or a symlink, or a file reached through a symlinked folder inside it. The files
        prepare made are none of those, and a crafted completion record naming one would otherwise have the merge
        publish (and --upload send) whatever it points at."""
        top, _, rest = name.partition("/")
        if rest and not files.inside(self.base / top, rest):
            return None
        try:
            return self.base / name if stat.S_ISREG(os.lstat(self.base / name).st_mode) else None
        except (FileNotFoundError, NotADirectoryError):
            return None

    def read_bytes(self, name: str) -> bytes | None:
        """A regular file's bytes (regular_file), or None."""
        path = self.regular_file(name)
        return None if path is None else path.read_bytes()

    def write_bytes(self, name: str, data: bytes) -> None:
        (self.base / name).parent.mkdir(parents=True, exist_ok=True)
        files.write_bytes(self.base / name, data)
        files.set_default_mode(self.base / name)

    def size(self, name: str) -> int | None:
        """A regular file's size (regular_file), or None."""
        path = self.regular_file(name)
        return None if path is None else path.lstat().st_size

    def move(self, source: str, dest: str) -> None:
        (self.base / dest).parent.mkdir(parents=True, exist_ok=True)
        os.replace(self.base / source, self.base / dest)

    def remove(self, folder: str) -> None:
        if (self.base / folder).exists():
            files.remove_tree(self.base / folder)

    def holds_anything(self, folder: str) -> bool:
        path = self.base / folder
        return path.is_dir() and any(path.iterdir())

    def finish(self) -> None:
        """Renames the assembled dataset into place in one step (the output appears whole or not at all)."""
        for path in (self.base / self.assembly).rglob("*"):
            if path.is_file():
                files.set_default_mode(path)
        files.fsync_dir(self.base / self.assembly)
        files.publish_directory(self.base / self.assembly, self.output, replace=False)


class BucketOutput:
    def __init__(self, url: str):
        from utils.io.storage import parse_gs_url

        from utils.data.corpus import PrepareError

        try:
            self.bucket, prefix = parse_gs_url(url)
        except ValueError as exc:
            raise PrepareError(f"--output {url}: {exc}") from None
        if not prefix:
            raise PrepareError(f"--output {url}: name a folder in the bucket (gs://{self.bucket}/PREFIX)")
        parent, _, self.name = prefix.rpartition("/")
        self.base = parent
        self.output = url.rstrip("/")
        self.staging = f".{self.name}.staging"
        self.assembly = self.name
        self.disk = Path(tempfile.gettempdir())  # where shards wait for their upload

    def url(self, name: str) -> str:
        from utils.io.storage import gs_url

        return gs_url(self.bucket, f"{self.base}/{name}" if self.base else name)

    @staticmethod
    def _client():
        from utils.io.storage import thread_client

        return thread_client()  # one per thread of each process (a client is not pickled with a store)

    @contextmanager
    def scratch(self, folder: str) -> Iterator[Path]:
        with tempfile.TemporaryDirectory(prefix="prepare-") as tmp:
            yield Path(tmp)

    def publish(self, local: Path, name: str) -> None:
        from utils.io.storage import parse_gs_url, upload_verified

        upload_verified(self._client(), self.bucket, local, parse_gs_url(self.url(name))[1])
        Path(local).unlink()

    def read_bytes(self, name: str) -> bytes | None:
        from utils.io.storage import read_object

        return read_object(self._client(), self.url(name))

    def write_bytes(self, name: str, data: bytes) -> None:
        from utils.io.storage import upload_bytes

        upload_bytes(self._client(), self.url(name), data)

    def size(self, name: str) -> int | None:
        from utils.io.storage import stat_object

        found = stat_object(self._client(), self.url(name))
        return None if found is None else found.size

    def move(self, source: str, dest: str) -> None:
        from utils.io.storage import move_object

        move_object(self._client(), self.url(source), self.url(dest))

    def remove(self, folder: str) -> None:
        from utils.io.storage import delete_prefix

        delete_prefix(self._client(), self.url(folder))

    def holds_anything(self, folder: str) -> bool:
        from utils.io.storage import list_objects, parse_gs_url

        return bool(list_objects(self._client(), self.bucket, parse_gs_url(self.url(folder))[1], suffix=None))

    def finish(self) -> None:
        """Nothing to rename: the merge wrote the dataset in place, dataset.json last."""
