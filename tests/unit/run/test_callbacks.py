"""The Trainer's callback seam (utils/run/callbacks.py): the hooks' order and rules, and an observer joining
it (the step profiler, NEOX_PROFILE_STEPS) in a real run."""
from __future__ import annotations

import json

from tests.trainkit import make_shards, run, train_cmd
from utils.run.callbacks import Callback, Callbacks


class Recorder(Callback):
    def __init__(self, name, log, veto=False, rewinds=False):
        self.name, self.log, self.veto, self.rewinds = name, log, veto, rewinds

    def approve_update(self, run):
        self.log.append((self.name, "approve_update"))
        return not self.veto

    def post_step(self, run):
        self.log.append((self.name, "post_step"))
        if self.rewinds:
            run.rewound = True

    def on_stop(self, run):
        self.log.append((self.name, "on_stop"))


class Run:
    rewound = False


def test_hooks_run_in_order_any_callback_may_refuse_the_update_and_a_rewind_ends_post_step():
    log = []
    callbacks = Callbacks([Recorder("a", log), Recorder("b", log, veto=True, rewinds=True), Recorder("c", log)])
    assert callbacks.approve_update(Run()) is False  # b refuses; every callback was still asked
    assert log == [("a", "approve_update"), ("b", "approve_update"), ("c", "approve_update")]
    log.clear()
    callbacks.post_step(Run())  # b rewinds the run: c does not see this step
    assert log == [("a", "post_step"), ("b", "post_step")]
    log.clear()
    callbacks.call("on_stop", Run())
    assert log == [("a", "on_stop"), ("b", "on_stop"), ("c", "on_stop")]
    assert Callbacks([Recorder("a", [])]).approve_update(Run()) is True


def test_the_step_profiler_writes_a_trace_and_the_top_operators_of_the_steps_asked(tmp_path, subprocess_env):
    data, out = make_shards(tmp_path / "data"), tmp_path / "out"
    proc = run(train_cmd(out, data, "max_steps=4", "per_device_train_batch_size=4"),
               dict(subprocess_env, NEOX_PROFILE_STEPS="2-3"))
    trace = json.loads((out / "logs" / "profile-rank0.json").read_text())
    names = {event.get("name", "") for event in trace["traceEvents"]}
    assert any(name.startswith("aten::") for name in names), sorted(names)[:20]
    assert "profile of steps 2-3" in proc.stdout and "aten::" in proc.stdout, proc.stdout[-3000:]
    bad = run(train_cmd(tmp_path / "bad", data, "max_steps=2"), dict(subprocess_env, NEOX_PROFILE_STEPS="3-1"),
              check=False)
    assert bad.returncode == 2 and "NEOX_PROFILE_STEPS='3-1'" in bad.stderr, bad.stderr
