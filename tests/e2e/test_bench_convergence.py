"""benchmarks/bench_convergence.py's data and its tokens-to-target arithmetic (the runs themselves are
benchmarks, not tests)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

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


def test_recipes_run_at_their_references_best_rate_against_the_tuned_baseline(tmp_path, capsys):
    """A toy study end to end: the baseline (adamw+hf) swept, a levered recipe at the best rate of its swept
    reference (added when not listed), a shortened one at its own sweep, the tail average as a contender of its
    own; every ratio is against the baseline at its best rate; a rerun takes every run from the cache."""
    from benchmarks import bench_convergence as bench
    from tests.trainkit import make_shards

    data = make_shards(tmp_path / "data", n_files=3, rows=32, seq_len=64)
    out, cache = tmp_path / "out.json", tmp_path / "cache"
    argv = ["--set", "model=tiny", "--set", "demo_data=false", "--set", f"data_dir={data}", "--set", "val_files=1",
            "--set", "max_steps=6", "--set", "warmup_steps=2", "--set", "decay_fraction=0.5",
            "--set", "per_device_train_batch_size=4",
            "--eval-every", "2", "--val-batches", "2", "--seeds", "0", "1", "--adamw-lrs", "1e-3", "1e-2",
            "--muon-lrs", "2e-3", "2e-2", "--recipes", "muon+hf+wsd", "muon+hf+cautious:sweep@0.5",
            "muon+hf+cautious+wsd",
            "--averages", "tail", "--timing-steps", "3", "--cache", str(cache), "--json", str(out)]
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["adamw_lrs"] == [1e-3, 1e-2] and result["muon_lrs"] == [2e-3, 2e-2]
    assert result["recipes"] == ["adamw+hf:sweep", "muon+hf:sweep", "muon+hf+wsd", "muon+hf+cautious@0.5:sweep",
                                 "muon+hf+cautious+wsd"]
    finals = {name: [r["final_val"] for r in runs] for name, runs in result["runs"].items()}
    best = result["best_rates"]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    assert best["adamw+hf"] == min((1e-3, 1e-2), key=lambda lr: mean(
        finals[f"adamw+hf, lr {lr:g}" + (" (tuned baseline)" if lr == best["adamw+hf"] else "")]))
    tuned = result["tuned_baseline"]
    assert tuned == f"adamw+hf, lr {best['adamw+hf']:g} (tuned baseline)" and list(result["runs"])[0] == tuned
    assert best["muon+hf+wsd"] == best["muon+hf"]  # a lever runs at its optimizer's best rate
    assert f"muon+hf+wsd, lr {best['muon+hf']:g}" in result["runs"]
    assert best["muon+hf+cautious+wsd"] == best["muon+hf"]  # no swept lever of its own listed
    assert {f"muon+hf+cautious@0.5, lr {lr:g}" for lr in (2e-3, 2e-2)} <= set(result["runs"])
    short = result["runs"]["muon+hf+cautious@0.5, lr 0.02"]
    assert [t for t, _ in short[0]["curve"]] == [0, 512, 768]  # 3 of the budget's 6 steps of 4 x 64 tokens
    tail = result["runs"][f"muon+hf [tail], lr {best['muon+hf']:g}"]
    plain = result["runs"][f"muon+hf, lr {best['muon+hf']:g}"]
    assert tail[0]["curve"][:3] == plain[0]["curve"][:3] and tail[0]["curve"][-1] != plain[0]["curve"][-1]
    for name, s in result["summary"].items():  # each seed against the tuned baseline's final loss of that seed
        for run, ratio in zip(result["runs"][name], s["ratio_per_seed"]):
            target = result["runs"][tuned][run["seed"]]["final_val"]
            reached = bench.tokens_to_reach(run["curve"], target)
            assert ratio == (None if reached is None else reached / result["budget_tokens"])
    assert result["summary"][tuned]["ratio_mean"] == 1.0 and result["summary"][tuned]["wall_ratio_mean"] == 1.0
    # step times measured in turns, one per recipe (an average's row has its recipe's); wall = tokens x step
    summary = result["summary"]
    assert {s["step_ms_measured"] for s in summary.values()} == {"interleaved"}
    assert summary[f"muon+hf [tail], lr {best['muon+hf']:g}"]["step_ms"] == summary[
        f"muon+hf, lr {best['muon+hf']:g}"]["step_ms"] == summary["muon+hf, lr 0.02"]["step_ms"]
    for s in summary.values():
        assert s["step_time_ratio"] == s["step_ms"] / summary[tuned]["step_ms"]
        assert s["wall_ratio_mean"] == (None if s["ratio_mean"] is None else s["ratio_mean"] * s["step_time_ratio"])
    capsys.readouterr()

    def no_training(*args, **kwargs):
        raise AssertionError("a cached run was trained again")
    bench.train_one, kept = no_training, bench.train_one
    try:
        assert bench.main(argv) == 0
    finally:
        bench.train_one = kept
    again = json.loads(out.read_text())
    assert again["runs"] == result["runs"]  # the cached curves (the step times are measured anew)
    assert [s["ratio_per_seed"] for s in again["summary"].values()] == [
        s["ratio_per_seed"] for s in result["summary"].values()]


def test_a_run_claimed_by_a_live_process_is_left_to_it_and_a_dead_ones_claim_is_taken_over(tmp_path):
    from benchmarks.bench_convergence import Recipe, RunCache

    cache, recipe = RunCache(tmp_path, {"preset": "demo"}), Recipe.parse("muon+neox")
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        claim = cache._path(recipe, 1e-3, 0, ".claim")
        claim.write_text(str(other.pid))
        assert not cache.claim(recipe, 1e-3, 0)  # alive: its run
    finally:
        other.kill()
        other.wait()
    assert cache.claim(recipe, 1e-3, 0) and claim.read_text() == str(os.getpid())  # dead: taken over
    cache.put(recipe, 1e-3, 0, {"seed": 0, "final_val": 1.0})
    assert not claim.exists() and cache.get(recipe, 1e-3, 0) == {"seed": 0, "final_val": 1.0}
    assert cache.get(recipe, 2e-3, 0) is None
    assert RunCache(tmp_path, {"preset": "cpu"}).get(recipe, 1e-3, 0) is None  # other settings, other runs


def test_recipe_names_and_refusals():
    from benchmarks.bench_convergence import Recipe, with_references

    r = Recipe.parse("muon+neox+wsd+cautious@0.7")
    assert (r.optimizer, r.init, r.levers, r.sweep, r.fraction) == ("muon", "neox", ("wsd", "cautious"), False, 0.7)
    assert r.settings() == {"optimizer": "muon", "init": "neox", "lr_schedule": "wsd", "cautious_weight_decay": True}
    assert [x.name for x in with_references([r])] == ["muon+neox", "muon+neox+wsd+cautious", r.name]
    assert Recipe.parse("adamw+hf").sweep and Recipe.parse("muon+hf+wsd:sweep").sweep
    for bad in ("sgd+hf", "muon", "muon+neox+qk", "muon+neox:all"):
        with pytest.raises(SystemExit, match="error: --recipes"):
            Recipe.parse(bad)


def test_levers_together_run_at_the_best_rate_of_the_swept_lever_they_hold():
    import argparse

    from benchmarks.bench_convergence import Recipe, Study

    recipes = [Recipe.parse(t) for t in ("adamw+hf", "muon+neox", "muon+neox+wsd:sweep", "muon+neox+cautious",
                                         "muon+neox+wsd+cautious")]
    args = argparse.Namespace(seeds=[0], adamw_lrs=[1e-3], muon_lrs=[1e-3, 2e-3])
    study = Study(args, None, None, None, None, recipes)
    runs = {("muon+neox", 1e-3): 4.0, ("muon+neox", 2e-3): 3.0, ("muon+neox+wsd", 1e-3): 2.0,
            ("muon+neox+wsd", 2e-3): 2.5}
    study.runs = {key: [{"seed": 0, "final_val": v}] for key, v in runs.items()}
    assert study.rates(Recipe.parse("muon+neox+cautious")) == [2e-3]  # muon+neox's best
    assert study.rates(Recipe.parse("muon+neox+wsd+cautious")) == [1e-3]  # muon+neox+wsd's best
