"""utils/data/ on real .npz files: validation, order, sharding, resume, caching, memory."""
from __future__ import annotations

import json
import os
import pickle
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from utils.data import dataset as data_dataset
from utils.data import index as data_index
from utils.data.dataset import TokenSequenceDataset
from utils.data.index import DataDirError, ShardIndex
from utils.data.loader import Readers, ResumableLoader, build_eval_batches
from utils.data.mixture import DEFAULT_SOURCE, EpochOrder, source_key
from utils.data.shards import ShardError
from utils.io import files

SEQ = 8
VOCAB = 10_000
TAIL = 9_999  # ids that must never reach a batch (stream tails, truncated row ends)
N_MIXED = 36


def quiet(*_args, **_kwargs):
    pass


def save(path: Path, arr, compressed: bool = False, key: str = "input_ids") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    (np.savez_compressed if compressed else np.savez)(path, **{key: arr})
    return path


def seqs(first: int, count: int, dtype, seq_len: int = SEQ) -> np.ndarray:
    """`count` sequences whose tokens all equal their global number, as [count, seq_len]."""
    return np.repeat(np.arange(first, first + count, dtype=dtype)[:, None], seq_len, axis=1)


def make_mixed(root: Path) -> Path:
    """36 sequences over a nested tree: a uint16 stream with a tail, int32 rows longer than SEQ,
    a compressed int64 stream. Sequence g (in sorted file order) is SEQ copies of g."""
    stream = np.concatenate([seqs(0, 10, np.uint16).ravel(), np.full(SEQ - 3, TAIL, np.uint16)])
    save(root / "a" / "00.npz", stream)
    rows = np.concatenate([seqs(10, 14, np.int32), np.full((14, 3), TAIL, np.int32)], axis=1)
    save(root / "a" / "b" / "01.npz", rows)
    save(root / "c.npz", seqs(24, 12, np.int64).ravel(), compressed=True)
    return root


@pytest.fixture
def mixed(tmp_path) -> TokenSequenceDataset:
    index = ShardIndex.build(make_mixed(tmp_path / "data"), SEQ, VOCAB, log=quiet)
    return TokenSequenceDataset(index)


def sample_ids(batch: torch.Tensor) -> list[int]:
    assert batch.dtype == torch.int64 and batch.shape[1] == SEQ
    assert torch.equal(batch, batch[:, :1].expand_as(batch)), "a sequence mixes ids: wrong cut or offset"
    return batch[:, 0].tolist()


def global_order(dataset, world: int, micro: int, seed: int, workers: int, global_batches: int) -> list[list[int]]:
    """Run one loader per simulated rank; return per-rank id lists, each of global_batches * micro ids."""
    shares = []
    for rank in range(world):
        loader = ResumableLoader(dataset, micro, rank, world, seed, readers=Readers(workers, 2))
        shares.append([i for _ in range(global_batches) for i in sample_ids(next(loader))])
        loader.close()
    return shares


def interleave(shares: list[list[int]], micro: int) -> list[int]:
    out = []
    for b in range(len(shares[0]) // micro):
        for share in shares:
            out.extend(share[b * micro:(b + 1) * micro])
    return out


# ----------------------------------------------------------------------------------------------------
# Order, sharding, epochs


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_one_epoch_reads_every_sample_once_with_disjoint_ranks(mixed, world, workers):
    micro = 2
    shares = global_order(mixed, world, micro, seed=7, workers=workers, global_batches=N_MIXED // (micro * world))
    everything = [i for share in shares for i in share]
    assert sorted(everything) == list(range(N_MIXED))
    for a in range(world):
        assert len(shares[a]) == N_MIXED // world
        for b in range(a + 1, world):
            assert not set(shares[a]) & set(shares[b])


def test_order_depends_on_seed_only(mixed):
    def order(seed, world, workers):
        return interleave(global_order(mixed, world, 2, seed, workers, N_MIXED // (2 * world)), 2)

    base = order(3, 1, 0)
    assert base != list(range(N_MIXED))  # shuffled
    assert order(3, 1, 0) == base
    assert order(3, 1, 2) == base  # workers do not change the order
    assert order(3, 2, 2) == base  # nor does sharding: the global stream is the same
    assert order(3, 3, 0) == base
    assert order(4, 1, 0) != base


def test_global_batch_straddles_epochs_and_drops_nothing(mixed):
    micro, world = 4, 2  # G = 8 does not divide N = 36
    shares = global_order(mixed, world, micro, seed=1, workers=0, global_batches=9)  # 72 positions = 2 epochs
    stream = interleave(shares, micro)
    assert sorted(stream[:N_MIXED]) == list(range(N_MIXED))
    assert sorted(stream[N_MIXED:]) == list(range(N_MIXED))
    assert stream[:N_MIXED] != stream[N_MIXED:]  # a new permutation per epoch


# ----------------------------------------------------------------------------------------------------
# Cursor


@pytest.mark.parametrize("workers", [0, 2])
def test_cursor_round_trip_continues_exactly(mixed, workers):
    micro, world, rank, k, more = 2, 2, 1, 7, 14  # 21 batches of G=4 cross the epoch boundary (9 per epoch)
    straight = ResumableLoader(mixed, micro, rank, world, seed=5, readers=Readers(workers, 4))
    first = [next(straight) for _ in range(k)]
    state = straight.state_dict()
    # prefetching workers ran ahead; the state counts only what was returned
    assert state == {"position": 28, "epoch": 0, "consumed_in_epoch": 28, "seed": 5, "num_samples": N_MIXED,
                     "global_batch": 4}
    expected = [next(straight) for _ in range(more)]
    straight.close()

    resumed = ResumableLoader(mixed, micro, rank, world, seed=999, readers=Readers(workers, 4))
    resumed.load_state_dict(state)
    got = [next(resumed) for _ in range(more)]
    resumed.close()
    assert [sample_ids(b) for b in got] == [sample_ids(b) for b in expected]
    assert resumed.position == (k + more) * 4 and resumed.epoch == (k + more) * 4 // N_MIXED == 2
    assert resumed.seed == 5  # the checkpoint's order wins
    assert not {i for b in first for i in sample_ids(b)} & {i for b in got[:2] for i in sample_ids(b)}


def test_skip_to_moves_the_cursor_forward_past_the_data_between(mixed):
    """The spike guard's rollback: a loader put back at an earlier cursor skips to a later one and continues
    exactly as the loader that read the data between; it never moves back."""
    reader = ResumableLoader(mixed, 2, 1, 2, seed=3)
    [next(reader) for _ in range(3)]
    earlier = reader.state_dict()
    [next(reader) for _ in range(5)]
    later = reader.state_dict()
    expected = [sample_ids(next(reader)) for _ in range(4)]
    rolled_back = ResumableLoader(mixed, 2, 1, 2, seed=3)
    rolled_back.load_state_dict(earlier)
    assert rolled_back.skip_to(later) == 5 * 4 and rolled_back.position == later["position"]
    assert [sample_ids(next(rolled_back)) for _ in range(4)] == expected
    with pytest.raises(ValueError, match="a skip only moves forward"):
        rolled_back.skip_to(earlier)


@pytest.mark.parametrize("world,micro", [(1, 4), (4, 1)])
def test_resume_with_another_world_size_continues_the_global_stream(mixed, world, micro):
    shares = global_order(mixed, 2, 2, seed=2, workers=0, global_batches=8)
    stream = interleave(shares, 2)  # 32 positions of the global stream
    state = ResumableLoader(mixed, 2, 0, 2, seed=2).state_dict()
    state.update(position=12, consumed_in_epoch=12)
    tail = []
    for rank in range(world):
        loader = ResumableLoader(mixed, micro, rank, world, seed=2)
        loader.load_state_dict(state)
        tail.append([i for _ in range(5) for i in sample_ids(next(loader))])
    assert interleave(tail, micro) == stream[12:32]


def test_load_state_refuses_changed_data(mixed):
    state = ResumableLoader(mixed, 2, 0, 1, seed=0).state_dict()
    state["num_samples"] = N_MIXED + 1
    with pytest.raises(ValueError, match="data changed since the checkpoint"):
        ResumableLoader(mixed, 2, 0, 1, seed=0).load_state_dict(state)
    with pytest.raises(ValueError, match="malformed"):
        ResumableLoader(mixed, 2, 0, 1, seed=0).load_state_dict({"epoch": 0})


def test_restore_time_does_not_grow_with_position(tmp_path):
    # 1M sequences of 4 tokens in one 8 MB stream; positions 8 and 8e6 (epoch 8) are 10^6 apart.
    tokens = (np.arange(4 << 20, dtype=np.int64) % 65_536).astype(np.uint16)
    save(tmp_path / "big.npz", tokens)
    dataset = TokenSequenceDataset(ShardIndex.build(tmp_path, 4, 65_536, log=quiet))
    assert len(dataset) == 1 << 20
    template = ResumableLoader(dataset, 8, 0, 1, seed=0).state_dict()

    def restore_and_read(position: int) -> float:
        best = float("inf")
        for _ in range(3):
            loader = ResumableLoader(dataset, 8, 0, 1, seed=0)
            t0 = time.perf_counter()
            loader.load_state_dict(dict(template, position=position))
            batch = next(loader)
            best = min(best, time.perf_counter() - t0)
        # the stream's definition: position p is sample perm(seed, p // N)[p % N]
        order = EpochOrder(len(dataset), source_key(0, DEFAULT_SOURCE))
        expected = order.at(np.arange(position, position + 8)).tolist()
        assert torch.equal(batch, torch.from_numpy(dataset.get_batch(expected)))
        return best

    small, large = restore_and_read(8), restore_and_read(8_000_000)
    assert large < 5 * small + 0.01, f"restore at 8e6 took {large:.4f}s vs {small:.4f}s at 8"


# ----------------------------------------------------------------------------------------------------
# Bad shards


class _Tripwire:
    """Unpickling this touches a file: proof that a shard was (or was not) unpickled."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def _truncated(path: Path):
    save(path, seqs(0, 4, np.uint16).ravel())
    path.write_bytes(path.read_bytes()[:150])


def _bit_flip(path: Path):
    save(path, seqs(0, 4, np.uint16).ravel())
    raw = bytearray(path.read_bytes())
    raw[200] ^= 0x01  # inside the array data: still a valid id, but not the bytes that were written
    path.write_bytes(bytes(raw))


BAD_SHARDS = {
    "wrong key": (lambda p: save(p, seqs(0, 4, np.uint16), key="tokens"), ["no 'input_ids' array", "tokens"]),
    "float dtype": (lambda p: save(p, seqs(0, 4, np.float32)), ["dtype float32", "not allowed"]),
    "int8 dtype": (lambda p: save(p, seqs(0, 4, np.int8)), ["dtype int8", "not allowed"]),
    "id >= vocab": (lambda p: save(p, seqs(VOCAB + 33, 2, np.int32)), [f"id {VOCAB + 34}", f"vocab_size is {VOCAB}"]),
    "negative id": (lambda p: save(p, seqs(-5, 2, np.int32)), ["id -5 < 0"]),
    "3-D": (lambda p: save(p, np.zeros((2, 2, SEQ), np.uint16)), ["3-D", "must be 1-D"]),
    "empty": (lambda p: save(p, np.zeros((0,), np.uint16)), ["0 sequences"]),
    "stream shorter than seq_len": (lambda p: save(p, np.zeros((SEQ - 1,), np.uint16)), ["0 sequences"]),
    "empty rows": (lambda p: save(p, np.zeros((0, SEQ), np.uint16)), ["0 sequences"]),
    "rows too short": (lambda p: save(p, np.zeros((3, SEQ - 4), np.uint16)),
                       [f"rows hold {SEQ - 4} tokens but seq_len is {SEQ}"]),
    "truncated zip": (_truncated, ["not a readable .npz"]),
    "not a zip": (lambda p: p.write_text("input_ids = [1, 2, 3]\n"), ["not a readable .npz"]),
    "corrupt data": (_bit_flip, ["crc32"]),
}


@pytest.mark.parametrize("case", list(BAD_SHARDS))
def test_bad_shard_stops_the_build_naming_file_and_rule(tmp_path, case):
    make, fragments = BAD_SHARDS[case]
    save(tmp_path / "good.npz", seqs(0, 4, np.uint16))
    (tmp_path / "sub").mkdir()
    make(tmp_path / "sub" / "bad.npz")
    with pytest.raises(ShardError) as err:
        ShardIndex.build(tmp_path, SEQ, VOCAB, log=quiet)
    message = str(err.value)
    assert "sub/bad.npz" in message and "good.npz" not in message.replace("sub/bad.npz", "")
    for fragment in fragments:
        assert fragment in message


def test_object_array_is_rejected_without_unpickling(tmp_path):
    marker = tmp_path / "unpickled"
    payload = np.empty(SEQ * 2, dtype=object)
    payload[:] = [_Tripwire(str(marker))] * len(payload)
    save(tmp_path / "obj.npz", payload)
    with pytest.raises(ShardError, match=r"obj\.npz: 'input_ids' is an object array"):
        ShardIndex.build(tmp_path, SEQ, VOCAB, log=quiet)
    assert not marker.exists()
    np.load(tmp_path / "obj.npz", allow_pickle=True)["input_ids"]  # the tripwire works when unpickled
    assert marker.exists()


def test_all_bad_files_are_reported_at_once(tmp_path):
    save(tmp_path / "a.npz", seqs(0, 2, np.float64))
    save(tmp_path / "b.npz", seqs(0, 4, np.uint16))
    save(tmp_path / "c.npz", seqs(VOCAB, 2, np.int64))
    with pytest.raises(ShardError) as err:
        ShardIndex.build(tmp_path, SEQ, VOCAB, log=quiet)
    message = str(err.value)
    assert message.startswith(f"2 shard files in {tmp_path} break the shard format")
    assert f"{tmp_path}/a.npz: 'input_ids' has dtype float64" in message
    assert f"{tmp_path}/c.npz: holds id {VOCAB + 1} but vocab_size is {VOCAB}" in message


def test_missing_or_empty_data_dir(tmp_path):
    with pytest.raises(DataDirError, match=r"does not exist.*download_training_data\.py.*--data-dir"):
        ShardIndex.build(tmp_path / "nope", SEQ, VOCAB, log=quiet)
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    (tmp_path / "empty" / "notes.txt").write_text("x")
    with pytest.raises(DataDirError, match=r"empty holds no \.npz shards.*download_training_data\.py"):
        ShardIndex.build(tmp_path / "empty", SEQ, VOCAB, log=quiet)


# ----------------------------------------------------------------------------------------------------
# Layouts, selection, split


def test_streams_are_cut_rows_truncated_and_files_ordered(mixed):
    index = mixed.index
    assert [(s.path, s.kind, s.num_sequences, s.dtype) for s in index.shards] == [
        ("a/00.npz", "stream", 10, "uint16"), ("a/b/01.npz", "rows", 14, "int32"), ("c.npz", "stream", 12, "int64")]
    assert index.shards[0].num_tokens == 10 * SEQ + SEQ - 3
    everything = mixed.get_batch(range(N_MIXED))
    assert everything.dtype == np.int64 and (everything == np.arange(N_MIXED)[:, None]).all()
    assert torch.equal(mixed[11], torch.full((SEQ,), 11, dtype=torch.long))
    assert index.num_sequences == len(mixed) == N_MIXED


def test_fortran_ordered_rows_read_correctly(tmp_path):
    rows = np.asfortranarray(np.concatenate([seqs(0, 5, np.int64), np.full((5, 2), TAIL, np.int64)], axis=1))
    save(tmp_path / "f.npz", rows)
    dataset = TokenSequenceDataset(ShardIndex.build(tmp_path, SEQ, VOCAB, log=quiet))
    assert np.array_equal(dataset.get_batch([4, 0, 2]), seqs(0, 5, np.int64)[[4, 0, 2]])


def test_compressed_shards_read_like_uncompressed(tmp_path):
    array = np.random.default_rng(0).integers(0, VOCAB, size=(50 * SEQ,), dtype=np.int64)
    save(tmp_path / "plain" / "x.npz", array)
    save(tmp_path / "packed" / "x.npz", array, compressed=True)
    lines = []
    plain = TokenSequenceDataset(ShardIndex.build(tmp_path / "plain", SEQ, VOCAB, log=quiet))
    packed = TokenSequenceDataset(ShardIndex.build(tmp_path / "packed", SEQ, VOCAB, log=lines.append))
    assert sum("shards are compressed" in line for line in lines) == 1
    order = [3, 49, 0, 17, 17]
    assert np.array_equal(plain.get_batch(order), packed.get_batch(order))
    assert np.array_equal(packed.get_batch(range(50)), array.reshape(50, SEQ))


def test_max_files_split_fingerprint_and_files_consumed(tmp_path):
    make_mixed(tmp_path)
    two = ShardIndex.build(tmp_path, SEQ, VOCAB, max_files=2, log=quiet)
    assert [s.path for s in two.shards] == ["a/00.npz", "a/b/01.npz"] and two.num_sequences == 24

    index = ShardIndex.build(tmp_path, SEQ, VOCAB, log=quiet)
    train, val = index.split(1)
    assert [s.path for s in train.shards] == ["a/00.npz", "a/b/01.npz"]
    assert [s.path for s in val.shards] == ["c.npz"] and val.num_sequences == 12
    assert train.split(0)[1].num_sequences == 0 and build_eval_batches(
        TokenSequenceDataset(train.split(0)[1]), 2, 0, 1, 5) == []
    with pytest.raises(DataDirError, match="val_files=3 leaves no training file"):
        index.split(3)

    fp = index.fingerprint()
    assert fp["num_files"] == 3 and fp["num_sequences"] == N_MIXED and fp["seq_len"] == SEQ
    assert fp == ShardIndex.build(tmp_path, SEQ, VOCAB, log=quiet).fingerprint()
    assert two.fingerprint() == train.fingerprint() and fp["sha256"] != two.fingerprint()["sha256"]
    assert fp["sha256"] != ShardIndex.build(tmp_path, SEQ, VOCAB, max_files=1, log=quiet).fingerprint()["sha256"]
    assert fp != ShardIndex.build(tmp_path, SEQ // 2, VOCAB, log=quiet).fingerprint()

    # per-file counts 10, 14, 12 (cumulative 10, 24, 36)
    got = [index.files_consumed(p) for p in (0, 9, 10, 23, 24, 35, 36, 36 + 10, 3 * 36 + 24)]
    assert got == [0, 0, 1, 1, 2, 2, 3, 4, 3 * 3 + 2]


def test_eval_batches_are_file_order_and_disjoint(mixed):
    micro, world = 2, 3
    per_rank = [build_eval_batches(mixed, micro, r, world, max_batches=4) for r in range(world)]
    assert all(len(b) == 4 for b in per_rank)
    assert interleave([[i for b in batches for i in sample_ids(b)] for batches in per_rank], micro) == list(range(24))
    again = build_eval_batches(mixed, micro, 1, world, max_batches=4)
    assert all(torch.equal(a, b) for a, b in zip(again, per_rank[1]))
    # more batches asked than the data holds: ceil(36 / 8) = 5 on every rank, the last wrapping around
    wide = [build_eval_batches(mixed, 4, r, 2, max_batches=100) for r in range(2)]
    assert [len(w) for w in wide] == [5, 5]
    assert interleave([[i for b in w for i in sample_ids(b)] for w in wide], 4) == list(range(36)) + [0, 1, 2, 3]


# ----------------------------------------------------------------------------------------------------
# Validation cache


def test_validation_is_cached_and_invalidated_by_changes(tmp_path, monkeypatch):
    make_mixed(tmp_path)
    scanned = []
    real = data_index.inspect_shard
    def counting(path, name, seq_len):
        scanned.append(Path(path).relative_to(tmp_path).as_posix())
        return real(path, name, seq_len)

    monkeypatch.setattr(data_index, "inspect_shard", counting)

    first = ShardIndex.build(tmp_path, SEQ, VOCAB, log=quiet).fingerprint()
    assert sorted(scanned) == ["a/00.npz", "a/b/01.npz", "c.npz"]
    assert (tmp_path / data_index.CACHE_NAME).is_file()
    scanned.clear()
    again = ShardIndex.build(tmp_path, SEQ, VOCAB, log=quiet)
    assert scanned == [] and again.fingerprint() == first
    # seq_len and vocab_size come from the run, not the cache: checked again without a re-scan
    assert ShardIndex.build(tmp_path, SEQ // 2, VOCAB, log=quiet).num_sequences == 10 * 2 + 1 + 14 + 24
    with pytest.raises(ShardError, match=r"c\.npz: holds id 35 but vocab_size is 30"):
        ShardIndex.build(tmp_path, SEQ, 30, log=quiet)
    assert scanned == []

    # a changed file is re-validated (and a now-bad one caught); the others are not
    save(tmp_path / "a" / "b" / "01.npz", seqs(10, 14, np.int32) + VOCAB)
    with pytest.raises(ShardError, match=r"a/b/01\.npz: holds id"):
        ShardIndex.build(tmp_path, SEQ, VOCAB, log=quiet)
    assert scanned == ["a/b/01.npz"]
    save(tmp_path / "a" / "b" / "01.npz", seqs(10, 14, np.int32))
    stat = (tmp_path / "a" / "00.npz").stat()
    os.utime(tmp_path / "a" / "00.npz", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1000))  # touched: re-checked
    scanned.clear()
    ShardIndex.build(tmp_path, SEQ, VOCAB, log=quiet)
    assert sorted(scanned) == ["a/00.npz", "a/b/01.npz"]

    # a corrupt cache costs a re-scan, not a failed start
    (tmp_path / data_index.CACHE_NAME).write_text('{"version": 1, "files": {"c.npz": {"size": ')
    scanned.clear()
    lines = []
    assert ShardIndex.build(tmp_path, SEQ, VOCAB, log=lines.append).fingerprint() == first
    assert len(scanned) == 3 and any("ignoring unreadable shard cache" in line for line in lines)
    cache = json.loads((tmp_path / data_index.CACHE_NAME).read_text())
    cache["files"]["c.npz"]["size"] = "x"  # one malformed entry: only that file is re-scanned
    (tmp_path / data_index.CACHE_NAME).write_text(json.dumps(cache))
    scanned.clear()
    assert ShardIndex.build(tmp_path, SEQ, VOCAB, log=quiet).fingerprint() == first and scanned == ["c.npz"]
    assert not [p for p in tmp_path.iterdir() if files.is_temp_name(p.name)]


# ----------------------------------------------------------------------------------------------------
# Processes and memory


def test_open_files_are_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(data_dataset, "MAX_OPEN_FILES", 2)
    for f in range(5):
        save(tmp_path / f"{f}.npz", seqs(3 * f, 3, np.uint16))
    dataset = TokenSequenceDataset(ShardIndex.build(tmp_path, SEQ, VOCAB, log=quiet))
    order = [14, 0, 7, 3, 12, 1, 9, 6, 13, 2]
    assert dataset.get_batch(order)[:, 0].tolist() == order and len(dataset._fds) == 2


def test_dataset_pickles_without_open_files(mixed):
    before = mixed.get_batch([0, 30])  # opens a file and fills the decompression cache
    assert mixed._fds and mixed._decompressed
    clone = pickle.loads(pickle.dumps(mixed))
    assert not clone._fds and not clone._decompressed
    assert np.array_equal(clone.get_batch([0, 30]), before)


def _write_stream_npz(path: Path, total_tokens: int, chunk: int = 1 << 24) -> None:
    """A uint16 stream npz written piecewise, so the test itself never holds the array in memory."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf, zf.open("input_ids.npy", "w", force_zip64=True) as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "<u2", "fortran_order": False, "shape": (total_tokens,)})
        for start in range(0, total_tokens, chunk):
            f.write((np.arange(start, min(start + chunk, total_tokens)) % 50_000).astype(np.uint16).tobytes())


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def test_indexing_and_reading_a_big_shard_keeps_memory_small(tmp_path):
    total = 100 << 20  # 100 M uint16 tokens: a 200 MB file
    _write_stream_npz(tmp_path / "big.npz", total)
    size = (tmp_path / "big.npz").stat().st_size
    assert size > 200e6
    baseline = _rss_bytes()
    index = ShardIndex.build(tmp_path, 2048, 50_257, log=quiet)
    loader = ResumableLoader(TokenSequenceDataset(index), 8, 0, 1, seed=0)
    batches = [next(loader) for _ in range(10)]
    growth = _rss_bytes() - baseline
    assert index.num_sequences == total // 2048
    assert growth < size / 8, f"RSS grew {growth / 1e6:.0f} MB for a {size / 1e6:.0f} MB shard"
    assert all(b.shape == (8, 2048) for b in batches)
    assert np.array_equal(loader.dataset.get_batch([0, 3])[:, :4], [[0, 1, 2, 3], [6144, 6145, 6146, 6147]])
