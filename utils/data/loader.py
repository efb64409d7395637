"""The order and the stream: a deterministic, rank-sharded, resumable batch loader, and eval batches.

`ResumableLoader` yields `[micro_batch_size, seq_len]` int64 batches forever. Its whole state is one
integer, `position`: the number of global samples consumed (see `ShardedBatchSampler` for the order).
`build_eval_batches` gives each rank its share of the first validation batches, in file order.
"""
from __future__ import annotations

import signal
import warnings
from collections import OrderedDict
from typing import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from utils.data.dataset import TokenSequenceDataset


class _BatchView(Dataset):
    """What the DataLoader indexes: a list of sequence numbers -> one [B, seq_len] numpy array of `dtype`.

    Workers return numpy arrays in the compact wire dtype: pickled through the result pipe they cost a
    fraction of what torch's per-tensor shared-memory hand-off costs, and the int64 widening happens once,
    in the main process."""

    def __init__(self, dataset: TokenSequenceDataset, dtype: np.dtype):
        self.dataset, self.dtype = dataset, dtype

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, indices: list[int]) -> np.ndarray:
        return self.dataset.get_batch(indices, dtype=self.dtype)


def _as_is(batch):
    return batch


def _ignore_stop_signals(_worker_id: int) -> None:
    """DataLoader workers leave SIGTERM/SIGINT to the training process. A scheduler that signals the whole
    process group (SLURM, systemd, `timeout`, Ctrl-C) would otherwise kill the workers first and crash the
    loop before it can checkpoint; the workers still exit when the loader shuts them down or the main
    process dies."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


# ----------------------------------------------------------------------------------------------------
# Order and sharding


def epoch_permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    """The sample order of one epoch: a permutation of range(n) from numpy's PCG64 seeded by (seed, epoch)."""
    perm = np.arange(n, dtype=np.int32 if n < 2**31 else np.int64)
    np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch]))).shuffle(perm)
    return perm


class ShardedBatchSampler(Sampler[list[int]]):
    """Infinite stream of this rank's micro-batches of sequence numbers.

    The global sample stream is perm(seed, 0) ++ perm(seed, 1) ++ ...; stream position p is sample
    perm(seed, p // N)[p % N]. A global batch is G = micro_batch_size * world_size consecutive positions
    and rank r takes positions [r * micro, (r + 1) * micro) of each. Starting at `start_position` costs one
    permutation, whatever the position."""

    def __init__(self, num_samples: int, micro_batch_size: int, rank: int, world_size: int, seed: int,
                 start_position: int = 0):
        if num_samples < 1:
            raise ValueError("cannot sample from an empty dataset (0 sequences)")
        if not (0 <= rank < world_size) or micro_batch_size < 1:
            raise ValueError(f"need 0 <= rank < world_size and micro_batch_size >= 1 "
                             f"(got rank={rank}, world_size={world_size}, micro_batch_size={micro_batch_size})")
        if seed < 0:
            raise ValueError(f"seed={seed} must be non-negative")
        self.num_samples, self.micro, self.rank, self.world, self.seed = (
            num_samples, micro_batch_size, rank, world_size, seed)
        self.global_batch = micro_batch_size * world_size
        self.start_position = start_position
        self._perms: OrderedDict[int, np.ndarray] = OrderedDict()

    def _perm(self, epoch: int) -> np.ndarray:
        perm = self._perms.get(epoch)
        if perm is None:
            perm = epoch_permutation(self.seed, epoch, self.num_samples)
            self._perms[epoch] = perm
            while len(self._perms) > 2:
                self._perms.popitem(last=False)
        return perm

    def indices_at(self, first_position: int) -> list[int]:
        """Sample numbers at stream positions [first_position, first_position + micro)."""
        n, out = self.num_samples, []
        p, end = first_position, first_position + self.micro
        while p < end:
            epoch, offset = divmod(p, n)
            take = min(end - p, n - offset)
            out.extend(self._perm(epoch)[offset:offset + take].tolist())
            p += take
        return out

    def __iter__(self) -> Iterator[list[int]]:
        p = self.start_position + self.rank * self.micro
        while True:
            yield self.indices_at(p)
            p += self.global_batch


# ----------------------------------------------------------------------------------------------------
# The loader the training loop holds


class ResumableLoader:
    """This rank's infinite stream of [micro_batch_size, seq_len] LongTensors, checkpointable.

    `position` counts global samples in batches *returned* by __next__ (DataLoader prefetch is not
    counted), so state_dict() after k batches resumes at batch k + 1. Position is in global samples, so a
    run may resume with another world size or micro-batch size. load_state_dict() is O(1) in the position:
    it only recreates the DataLoader iterator (one epoch permutation, no batches read)."""

    def __init__(self, dataset: TokenSequenceDataset, micro_batch_size: int, rank: int, world_size: int,
                 seed: int, num_workers: int = 0, prefetch_factor: int = 2, pin_memory: bool = False):
        if len(dataset) < 1:
            raise ValueError("ResumableLoader needs a dataset with at least one sequence")
        self.dataset = dataset
        self.micro_batch_size, self.rank, self.world_size, self.seed = micro_batch_size, rank, world_size, seed
        if pin_memory and not torch.cuda.is_available():
            warnings.warn("ResumableLoader(pin_memory=True) without CUDA: batches will not be pinned")
            pin_memory = False
        self.num_workers, self.prefetch_factor, self.pin_memory = num_workers, prefetch_factor, pin_memory
        self.num_samples = len(dataset)
        self.global_batch = micro_batch_size * world_size
        ShardedBatchSampler(self.num_samples, micro_batch_size, rank, world_size, seed)  # validates arguments
        self._position = 0
        self._iterator = None

    @property
    def position(self) -> int:
        return self._position

    @property
    def epoch(self) -> int:
        return self._position // self.num_samples

    def _make_iterator(self):
        sampler = ShardedBatchSampler(self.num_samples, self.micro_batch_size, self.rank, self.world_size,
                                      self.seed, start_position=self._position)
        if self.num_workers == 0:
            # Read here, without a DataLoader (its per-batch bookkeeping costs more than the read), in the
            # wire dtype: no per-row conversion buffer; __next__ widens the whole batch once.
            return (self.dataset.get_batch(indices, dtype=self.dataset.wire_dtype) for indices in sampler)
        # batch_size=None: the sampler already yields whole micro-batches, each produced once in this
        # process and handed to one worker, which returns a ready [B, seq_len] array (no collate).
        loader = DataLoader(_BatchView(self.dataset, self.dataset.wire_dtype), sampler=sampler, batch_size=None,
                            collate_fn=_as_is, num_workers=self.num_workers, worker_init_fn=_ignore_stop_signals,
                            prefetch_factor=self.prefetch_factor, persistent_workers=False)
        return iter(loader)

    def __iter__(self) -> "ResumableLoader":
        return self

    def __next__(self) -> torch.Tensor:
        if self._iterator is None:
            self._iterator = self._make_iterator()
        batch = torch.from_numpy(next(self._iterator).astype(np.int64, copy=False))
        if self.pin_memory:
            batch = batch.pin_memory()
        self._position += self.global_batch
        return batch

    def state_dict(self) -> dict:
        epoch, consumed = divmod(self._position, self.num_samples)
        return {"position": self._position, "epoch": epoch, "consumed_in_epoch": consumed,
                "seed": self.seed, "num_samples": self.num_samples, "global_batch": self.global_batch}

    def load_state_dict(self, state: dict) -> None:
        """Continue at `state["position"]`. The saved seed is adopted (the order must stay the one the
        run started with); a different dataset size is refused."""
        try:
            position, num_samples, seed = int(state["position"]), int(state["num_samples"]), int(state["seed"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"data cursor state is malformed ({e!r}); expected the dict from "
                             "ResumableLoader.state_dict()") from None
        if num_samples != self.num_samples:
            raise ValueError(
                f"the data changed since the checkpoint: its cursor was saved over {num_samples:,} sequences "
                f"but this dataset has {self.num_samples:,}. Restore the same shards and "
                "seq_len/max_files/val_files to resume, or start a fresh run")
        if position < 0 or seed < 0:
            raise ValueError(f"data cursor state has position={position}, seed={seed}; both must be >= 0")
        self.close()
        self._position, self.seed = position, seed

    def close(self) -> None:
        """Stop DataLoader workers (also done when the loader is garbage-collected)."""
        it, self._iterator = self._iterator, None
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()


def build_eval_batches(dataset: TokenSequenceDataset, micro_batch_size: int, rank: int, world_size: int,
                       max_batches: int) -> list[torch.Tensor]:
    """This rank's share of the first `max_batches` global batches of `dataset` in file order.

    Global batch b covers sequences [b * G, (b + 1) * G), G = micro_batch_size * world_size; rank r takes
    [b * G + r * micro, b * G + (r + 1) * micro). There are min(max_batches, ceil(N / G)) batches on every
    rank; a last, partial global batch wraps around to the first sequences so that all ranks run the same
    number of eval steps."""
    n = len(dataset)
    if n == 0 or max_batches < 1:
        return []
    g = micro_batch_size * world_size
    count = min(max_batches, -(-n // g))
    batches = []
    for b in range(count):
        first = b * g + rank * micro_batch_size
        indices = [(first + k) % n for k in range(micro_batch_size)]
        batches.append(torch.from_numpy(dataset.get_batch(indices)))
    return batches
