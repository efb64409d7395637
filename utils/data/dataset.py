"""Reading sequences: global sequence number -> `seq_len` token ids, straight from the shard files."""
from __future__ import annotations

import os
import zipfile
from collections import OrderedDict

import numpy as np
import torch
from torch.utils.data import Dataset

from utils.data.index import ShardIndex
from utils.data.shards import INPUT_KEY, ShardError

# Shard files kept open per process (least recently used closed first): well under the usual 1024 limit.
MAX_OPEN_FILES = 128
# Decompressed shards kept per process (workers included); at least one shard is always kept.
COMPRESSED_CACHE_BYTES = 512 << 20


class TokenSequenceDataset(Dataset):
    """Sequence i of the index as int64 ids of length seq_len: the `.npz` shard folder as a SequenceSource
    (utils/data/source.py).

    Uncompressed shards are read with positional reads (os.preadv) at the array's offset inside the zip:
    one syscall per sequence straight from the page cache, nothing mapped, so the resident set does not
    grow with the data read (with mmap, every touched page-cache folio counts as RSS). Fortran-ordered
    2-D arrays, whose rows are not contiguous, are memory-mapped instead. Compressed shards are
    decompressed whole into a small per-process LRU cache. Files are opened lazily in each process; open
    descriptors and caches are dropped on pickling and after a fork, so DataLoader workers are safe."""

    def __init__(self, index: ShardIndex):
        self.index = index
        self.seq_len = index.seq_len
        self._paths = [str(index.root / s.path) for s in index.shards]
        self._layouts = [index.layouts[s.path] for s in index.shards]
        self._cumulative = index.cumulative
        self._starts = np.concatenate(([0], self._cumulative)).astype(np.int64)
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._fds: OrderedDict[int, int] = OrderedDict()
        self._maps: dict[int, np.ndarray] = {}
        self._decompressed: OrderedDict[int, np.ndarray] = OrderedDict()
        self._decompressed_bytes = 0

    def _close(self) -> None:
        fds, self._fds = self._fds, OrderedDict()
        for fd in fds.values():
            try:
                os.close(fd)
            except OSError:
                pass

    def __del__(self):
        if getattr(self, "_pid", None) == os.getpid():
            self._close()

    def __getstate__(self):
        state = self.__dict__.copy()
        for k in ("_fds", "_maps", "_decompressed"):
            state[k] = type(state[k])()
        state["_decompressed_bytes"] = 0
        return state

    def __len__(self) -> int:
        return self.index.num_sequences

    def _check_process(self) -> None:
        if self._pid != os.getpid():  # forked: the parent's descriptors and caches are the parent's
            self._close()
            self._reset()

    def _fd(self, f: int) -> int:
        fd = self._fds.get(f)
        if fd is not None:
            self._fds.move_to_end(f)
            return fd
        while len(self._fds) >= MAX_OPEN_FILES:
            os.close(self._fds.popitem(last=False)[1])
        fd = self._fds[f] = os.open(self._paths[f], os.O_RDONLY)
        return fd

    def _array(self, f: int) -> np.ndarray:
        """The whole array of shard f: a memmap (Fortran-ordered) or the decompressed copy (compressed)."""
        layout = self._layouts[f]
        if not layout.compressed:
            arr = self._maps.get(f)
            if arr is None:
                arr = self._maps[f] = np.memmap(self._paths[f], dtype=layout.dtype, mode="r",
                                                offset=layout.data_offset, shape=layout.shape, order="F")
            return arr
        arr = self._decompressed.get(f)
        if arr is not None:
            self._decompressed.move_to_end(f)
            return arr
        with zipfile.ZipFile(self._paths[f]) as zf, zf.open(INPUT_KEY + ".npy") as fp:
            arr = np.lib.format.read_array(fp, allow_pickle=False)
        while self._decompressed and self._decompressed_bytes + arr.nbytes > COMPRESSED_CACHE_BYTES:
            _, old = self._decompressed.popitem(last=False)
            self._decompressed_bytes -= old.nbytes
        self._decompressed[f] = arr
        self._decompressed_bytes += arr.nbytes
        return arr

    def _read_sequence(self, f: int, j: int, out: np.ndarray) -> None:
        layout, n = self._layouts[f], self.seq_len
        if layout.compressed or layout.fortran_order:
            arr = self._array(f)
            out[:] = arr[j * n:(j + 1) * n] if arr.ndim == 1 else arr[j, :n]
            return
        dtype = layout.dtype
        first = j * n if len(layout.shape) == 1 else j * layout.shape[1]
        buf = out if dtype == out.dtype else np.empty(n, dtype=dtype)  # out is C-contiguous
        want = n * dtype.itemsize
        got = os.preadv(self._fd(f), [buf[:n]], layout.data_offset + first * dtype.itemsize)
        if got != want:
            raise ShardError(f"{self._paths[f]}: read {got} of {want} bytes of sequence {j}; the file "
                             "changed or shrank since it was indexed: restart to re-validate it")
        if buf is not out:
            out[:] = buf

    def fingerprint(self) -> dict:
        """The shard index's: every file's path, rows and size, hashed (utils/data/index.py)."""
        return self.index.fingerprint()

    def files_consumed(self, position: int) -> int:
        return self.index.files_consumed(position)

    def describe(self) -> str:
        return str(self.index.root)

    def file_sequences(self) -> np.ndarray:
        return np.array([s.num_sequences for s in self.index.shards], dtype=np.int64)

    @property
    def wire_dtype(self) -> np.dtype:
        """The smallest dtype that holds every id (< vocab_size): what workers send to the main process."""
        return np.dtype(np.uint16 if self.index.vocab_size <= 1 << 16 else np.int32)

    def get_batch(self, indices, dtype=np.int64) -> np.ndarray:
        """Sequences `indices` as one array [len(indices), seq_len] of `dtype` (int64 unless asked),
        read straight from the shards (no per-sample tensors, no collate)."""
        self._check_process()
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        n = len(self)
        if idx.size and (idx.min() < 0 or idx.max() >= n):
            raise IndexError(f"sequence index out of range [0, {n})")
        files = np.searchsorted(self._cumulative, idx, side="right")
        local = idx - self._starts[files]
        out = np.empty((len(idx), self.seq_len), dtype=dtype)
        for k, (f, j) in enumerate(zip(files.tolist(), local.tolist())):
            self._read_sequence(f, j, out[k])
        return out

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.from_numpy(self.get_batch([int(i)])[0])
