"""benchmarks/bench_convergence.py's data and its tokens-to-target arithmetic (the runs themselves are
benchmarks, not tests)."""
from __future__ import annotations

import numpy as np

from benchmarks.bench_convergence import load_rows, tokens_to_reach


def _shard(path, ids):
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, input_ids=np.asarray(ids, dtype=np.uint16))


def test_a_prepared_datasets_val_split_is_the_validation_set(tmp_path):
    # prepare_data.py's layout: 1-D shards under part-*/ and val/part-*/; "val" sorts before "zz", so the
    # split must come from the folder, not from the last files by name
    _shard(tmp_path / "part-00000" / "shard-00000.npz", range(0, 40))
    _shard(tmp_path / "val" / "part-00000" / "shard-00000.npz", range(100, 120))
    _shard(tmp_path / "zz-part" / "shard-00000.npz", range(200, 216))
    train, val = load_rows(tmp_path, seq_len=8, val_files=5)
    assert train.shape == (7, 8) and val.shape == (2, 8)
    assert val.min() >= 100 and val.max() < 120 and not ((train >= 100) & (train < 120)).any()

    plain = tmp_path / "plain"  # no val/: the last val_files shards by path, as the engine
    for i in range(3):
        _shard(plain / f"part-00000/shard-{i:05d}.npz", range(16 * i, 16 * i + 16))
    train, val = load_rows(plain, seq_len=8, val_files=1)
    assert train.shape == (4, 8) and val.tolist() == [list(range(32, 40)), list(range(40, 48))]


def test_tokens_to_reach_interpolates_between_evaluations():
    curve = [(0, 5.0), (100, 4.0), (200, 3.0)]
    assert tokens_to_reach(curve, 3.5) == 150
    assert tokens_to_reach(curve, 4.0) == 100
    assert tokens_to_reach(curve, 2.9) is None
