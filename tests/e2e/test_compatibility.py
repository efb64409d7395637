"""The engine before the package layout, the Trainer and typed settings (commit a3d8304) and today's: a sharded
(FSDP) checkpoint the old engine wrote of a run on the demo preset's own recipe (AdamW at 2e-3 then, Muon at 8e-3
now) resumes on today's code with the command that started it, and continues the losses the old engine logged.
(DDP checkpoints of a3d8304, GPT-NeoX and Llama, resume bitwise and export byte for byte:
tests/e2e/test_model_io.py.)"""
from __future__ import annotations

import pytest

from tests.trainkit import REPO_ROOT, demo_recipe_cmd, engine_at, make_shards, run, train_rows

BEFORE_THE_HOUSE = "a3d8304"


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
