"""Earlier engines and today's: a sharded (FSDP) checkpoint an old engine wrote resumes on today's code with the
command that started it and continues the losses the old engine logged. The engine before the package layout, the
Trainer and typed settings (commit a3d8304), of a run on the demo preset's own recipe (AdamW at 2e-3 then, Muon at
8e-3 now), and the engine before each rank orthogonalised only its share of Muon's matrices (40dd9a8), whose Muon
checkpoint of 2 FSDP ranks resumes on 4 DDP ranks. (DDP checkpoints of a3d8304, GPT-NeoX and Llama, resume bitwise
and export byte for byte: tests/e2e/test_model_io.py.)"""
from __future__ import annotations

import math

import pytest

from tests.trainkit import REPO_ROOT, TINY, demo_recipe_cmd, engine_at, make_shards, run, train_rows

BEFORE_THE_HOUSE = "a3d8304"
BEFORE_DISTRIBUTED_MUON = "40dd9a8"


@pytest.fixture(scope="module")
def old_engine(tmp_path_factory):
    return engine_at(BEFORE_THE_HOUSE, tmp_path_factory.mktemp("engines") / "a3d8304")


@pytest.mark.slow
@pytest.mark.parametrize("model, strategy", [("tiny", "fsdp")])
def test_a_checkpoint_of_a3d8304_resumes_and_continues_its_losses(model, strategy, old_engine, tmp_path,
                                                                   subprocess_env):
    data = make_shards(tmp_path / "data")
    sets = (f"model={model}", f"strategy={strategy}", "per_device_train_batch_size=4", "max_steps=6",
            "save_steps=3", "spike_guard=warn")
    old_env = dict(subprocess_env, PYTHONPATH=str(old_engine))

    def old(out, *more):
        return run(demo_recipe_cmd(old_engine, out, data, *sets, *more), old_env)

    split, straight = tmp_path / "split", tmp_path / "straight"
    old(split, "stop_at_step=3")
    old(straight)
    proc = run(demo_recipe_cmd(REPO_ROOT, split, data, *sets, extra=("--resume", "latest")), subprocess_env)
    assert "Resumed from" in proc.stdout and "at step 3" in proc.stdout, proc.stdout
    assert "the run continues the recipe it started with (optimizer=adamw, learning_rate=0.002)" in proc.stdout
    resumed, reference = train_rows(split), train_rows(straight)
    for step in (4, 5, 6):
        assert abs(resumed[step]["loss"] - reference[step]["loss"]) <= 1e-6, (step, resumed[step], reference[step])
    assert (split / "final_model" / "config.json").is_file()


def _launch(engine, out, data, ranks: int, strategy: str, *sets: str, env: dict, extra: tuple = ()):
    cmd = [str(engine / "start_training.sh"), "--config", "demo", "--cpu", "--gpus", str(ranks), "--strategy",
           strategy, "--", "--output-dir", str(out), "--data-dir", str(data), *extra]
    for s in TINY + list(sets):
        cmd += ["--set", s]
    return run(cmd, env, timeout=600)


@pytest.mark.slow
def test_a_muon_checkpoint_of_40dd9a8_resumes_on_four_ddp_ranks_and_continues_its_losses(tmp_path_factory, tmp_path,
                                                                                        subprocess_env):
    """The engine before distributed Muon trains 8 fp32 Muon steps on 2 FSDP ranks (global batch 4), saving at
    step 4; today's engine resumes that sharded checkpoint on 4 DDP ranks (each orthogonalising its share) and
    logs the old run's losses for steps 5 to 8, 1e-6 relative (the gradients' sums differ in order)."""
    old_engine = engine_at(BEFORE_DISTRIBUTED_MUON, tmp_path_factory.mktemp("engines") / BEFORE_DISTRIBUTED_MUON)
    data = make_shards(tmp_path / "data")
    sets = ("optimizer=muon", "max_steps=8", "save_steps=4", "save_total_limit=3")
    old, new = tmp_path / "old", tmp_path / "new"
    _launch(old_engine, old, data, 2, "fsdp", *sets, "per_device_train_batch_size=2",
            env=dict(subprocess_env, PYTHONPATH=str(old_engine)))
    ckpt = next((old / "checkpoints").glob("checkpoint-*-step4-*"))
    assert (ckpt / "dcp").is_dir()
    proc = _launch(REPO_ROOT, new, data, 4, "ddp", *sets, "per_device_train_batch_size=1", env=subprocess_env,
                   extra=("--resume", str(ckpt)))
    assert "Resumed from" in proc.stdout and "at step 4" in proc.stdout, proc.stdout[-3000:]
    assert "each rank its share" in (new / "logs" / "training.log").read_text()
    reference, resumed = train_rows(old), train_rows(new)
    assert sorted(resumed) == [5, 6, 7, 8] and reference[8]["loss"] < reference[1]["loss"]
    for step in (5, 6, 7, 8):
        assert math.isclose(resumed[step]["loss"], reference[step]["loss"], rel_tol=1e-6), (step, resumed[step],
                                                                                             reference[step])
