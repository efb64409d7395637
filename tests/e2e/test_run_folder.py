"""A run's own folder, its stops and its summary: a SIGKILL of the launcher
or of one rank, a console that goes away under Ctrl-C, the closing summary's numbers, one folder per run
(a second fresh run never touches the first's files), the launcher's own usage errors."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from tests.e2e.test_preemption import launcher_cmd, leftovers, wait_for_steps
from tests.trainkit import REPO_ROOT, TINY, make_shards, run, train_cmd, train_rows
from utils.checkpoint.format import list_checkpoints, verify_checkpoint
from utils.runtime.signals import parent_pid


def _children(pid: int) -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and parent_pid(int(p)) == pid]


def _rank_pids(launcher_pid: int) -> dict[int, int]:
    """{RANK: pid} of the training processes under the launcher (start_training.sh -> its supervisor ->
    accelerate's torchrun -> the ranks): the descendants whose environment has RANK."""
    found, todo = {}, _children(launcher_pid)
    while todo:
        pid = todo.pop()
        try:
            env = dict(v.split(b"=", 1) for v in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in v)
        except OSError:
            continue
        if b"RANK" in env and b"python" in Path(f"/proc/{pid}/cmdline").read_bytes():
            found[int(env[b"RANK"])] = pid
        else:
            todo += _children(pid)
    return found


def _wait_until_gone(marker: str, timeout: float) -> list[str]:
    deadline = time.time() + timeout
    while leftovers(marker) and time.time() < deadline:
        time.sleep(0.3)
    left = leftovers(marker)
    for line in left:  # no stray trainer outlives a failed test
        os.kill(int(line.split(":")[0]), signal.SIGKILL)
    return left


def _missing_tracker() -> str | None:
    return next((name for name in ("wandb", "mlflow") if importlib.util.find_spec(name) is None), None)


# ------------------------------------------------------------------ a killed launcher, a killed rank (item 10)

@pytest.mark.slow
def test_sigkill_of_the_launcher_stops_every_rank_with_a_checkpoint(tmp_path, subprocess_env):
    """`kill -9` of the launcher of 2 CPU ranks: the ranks notice, stop at one step with a checkpoint that
    verifies, free the lock and leave no process. The run then resumes from it on 2 ranks with another
    global batch and a tracker whose package is missing: each warning is printed once, not once a rank."""
    from utils.io.lock import OutputDirLock

    data, out = make_shards(tmp_path / "data"), tmp_path / "out"
    console = tmp_path / "console.log"
    with open(console, "w") as sink:
        proc = subprocess.Popen(launcher_cmd(out, data, 2, 0), env=subprocess_env, cwd=REPO_ROOT, stdout=sink,
                                stderr=subprocess.STDOUT, start_new_session=True)
    wait_for_steps(out, proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert _wait_until_gone(str(out), timeout=120) == []
    log = (out / "logs" / "training.log").read_text()
    stopped = re.search(rf"Stopped by the loss of its launcher \(pid {proc.pid}\) after step (\d+): checkpoint (\S+)",
                        log)
    assert stopped, log[-3000:]
    step, path = int(stopped.group(1)), Path(stopped.group(2))
    verify_checkpoint(path)
    assert list_checkpoints(out / "checkpoints") == [path] and max(train_rows(out)) == step
    lock = OutputDirLock(out)
    lock.acquire(log=lambda msg: None)  # free: nothing holds it
    lock.release()

    missing = _missing_tracker()
    resume = launcher_cmd(out, data, 2, 0) + ["--set", f"max_steps={step + 1}",
                                              "--set", "per_device_train_batch_size=1",
                                              "--set", f"report_to=tensorboard{',' + missing if missing else ''}",
                                              "--resume", "auto"]
    proc = subprocess.run(resume, env=subprocess_env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout + proc.stderr
    assert f"start_training.sh: finished after step {step + 1}" in text
    assert text.count("global batch changes from 4 to 2 sequences per step") == 1, text
    if missing:
        assert text.count(f"warning: report_to={missing}: the {missing} package is not installed") == 1, text


@pytest.mark.slow
def test_sigkill_of_one_rank_is_one_line_naming_it(tmp_path, subprocess_env):
    """`kill -9` of rank 1 of 2: the launcher's one line names the rank, its pid and the signal; no
    traceback of rank 0 about the peer it lost, no torchrun report; exit 128 + 9; nothing left running."""
    data, out = make_shards(tmp_path / "data"), tmp_path / "out"
    with open(tmp_path / "stdout", "w") as stdout, open(tmp_path / "stderr", "w") as stderr:
        proc = subprocess.Popen(launcher_cmd(out, data, 2, 0), env=subprocess_env, cwd=REPO_ROOT, stdout=stdout,
                                stderr=stderr, start_new_session=True)
    wait_for_steps(out, proc)
    victim = _rank_pids(proc.pid)[1]
    os.kill(victim, signal.SIGKILL)
    assert proc.wait(timeout=120) == 128 + signal.SIGKILL
    assert _wait_until_gone(str(out), timeout=30) == []
    said = (tmp_path / "stdout").read_text() + (tmp_path / "stderr").read_text()
    killed = [line for line in said.splitlines() if "killed by" in line]
    assert killed == [f"start_training.sh: rank 1 (pid {victim}) was killed by SIGKILL, and the other ranks stopped "
                      f"with it; continue from the newest checkpoint with --resume auto"], said[-3000:]
    for noise in ("Traceback", "[rank0]", "Connection closed by peer", "exitcode", "ChildFailedError"):
        assert noise not in said, said[-3000:]


def test_stderr_filter_names_the_killed_rank_from_torchruns_report():
    """What accelerate/torchrun print when rank 1 of 2 is SIGKILLed (recorded): the surviving rank's
    `[rank0]:` traceback about the lost peer and torchrun's report are not shown; the root cause is read."""
    import io

    from utils.runtime.launch import StderrFilter

    recorded = b"""[rank0]: Traceback (most recent call last):
[rank0]:   File "/repo/train.py", line 670, in <module>
[rank0]:     sys.exit(main())
Step 7: a line another process wrote in between
[rank0]:   File "/venv/torch/distributed/distributed_c10d.py", line 3252, in all_reduce
[rank0]:     work.wait()
[rank0]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:553] \
Connection closed by peer [127.0.0.1]:24460. This is typically caused by a remote worker crashing.
W1124 03:51:04.913000 11963 torch/distributed/elastic/multiprocessing/api.py:1028] \
Sending process 12233 closing signal SIGTERM
E1124 03:51:04.952000 11963 torch/distributed/elastic/multiprocessing/api.py:1002] \
failed (exitcode: -9) local_rank: 1 (pid: 12234) of binary: /venv/bin/python
Traceback (most recent call last):
  File "/venv/bin/accelerate", line 8, in <module>
    sys.exit(main())
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\x20
=======================================================
/repo/train.py FAILED
-------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-24_03:51:04
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 12233)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 12233
-------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-24_03:51:04
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 12234)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 12234
=======================================================
"""
    sink = io.BytesIO()
    f = StderrFilter(sink)
    f.feed(recorded[:12])  # "[rank0]: Tra": held back until it is known not to start a traceback
    for line in recorded[12:].splitlines(keepends=True):
        f.feed(line)
    f.close()
    assert sink.getvalue() == b"Step 7: a line another process wrote in between\n"
    assert f.killed_rank == (1, 12234, signal.SIGKILL)
    assert f.peer_lost.startswith("RuntimeError: ") and "Connection closed by peer" in f.peer_lost
    closing = b"W1124 03:51:04.913000 11963 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process "
    tie = recorded.replace(closing + b"12233 closing signal SIGTERM\n", b"")  # both had ended: none to stop
    assert tie != recorded
    # the report's two entries swapped: rank 1's SIGKILL among the failures, rank 0 (exit status 1) the root cause
    head, failures = tie.split(b"Failures:\n")
    rank0, rest = failures.split(b"-------------------------------------------------------\n", 1)
    root_header, rank1 = rest.split(b"\n", 1)
    rank1, end = rank1.split(b"=====", 1)
    rank0 = rank0.replace(b"exitcode  : -15 (pid: 12233)  (SIGTERM)", b"exitcode  : 1 (pid: 12233)").replace(
        b"Signal 15 (SIGTERM) received by PID 12233", b"To enable traceback see: https://pytorch.org/docs/stable/"
        b"elastic/errors.html")
    tie = (head + b"Failures:\n" + rank1.replace(b"[0]:", b"[1]:") + b"-" * 55 + b"\n" + root_header + b"\n" +
           rank0.replace(b"[1]:", b"[0]:") + b"=====" + end)
    assert b"rank      : 0 (local_rank: 0)\n  exitcode  : 1 (pid: 12233)\n" in tie.split(root_header)[1]
    # torchrun saw both ranks ended in one poll and its "first observed failure" (timestamps in whole seconds,
    # a tie to the lower rank) is rank 0's lost connection: the SIGKILLed rank is still the cause, and torchrun's
    # line for rank 0's exit status 1 is not shown either
    tie = tie.replace(b"failed (exitcode: -9) local_rank: 1 (pid: 12234)", b"failed (exitcode: 1) local_rank: 0 "
                      b"(pid: 12233)")
    sink = io.BytesIO()
    f = StderrFilter(sink)
    f.feed(tie)
    f.close()
    assert sink.getvalue() == b"Step 7: a line another process wrote in between\n"
    assert f.killed_rank == (1, 12234, signal.SIGKILL)
    closed = StderrFilter(io.BytesIO())  # a rank torchrun itself SIGTERMed is never the cause
    closed.feed(recorded.replace(b"exitcode  : -9 (pid: 12234)  (SIGKILL)", b"exitcode  : 1 (pid: 12234)"))
    closed.close()
    assert closed.killed_rank is None
    one_process = StderrFilter(io.BytesIO())  # accelerate's launch of a single process
    one_process.feed(b"Traceback (most recent call last):\n  File x\nsubprocess.CalledProcessError: Command "
                     b"'['python', 'train.py']' died with <Signals.SIGKILL: 9>.\n")
    assert one_process.killed_rank == (0, None, signal.SIGKILL)


# ------------------------------------------------------------------------ a console that goes away (item 17)

@pytest.mark.slow
def test_ctrl_c_with_tee_whose_reader_died_still_stops_with_a_checkpoint(tmp_path, subprocess_env):
    """`train.py | tee`, tee killed (as a terminal's Ctrl-C kills it), then SIGINT to the process group as a
    terminal sends it: the run keeps training with its console gone, then stops as documented: a verified
    checkpoint, exit 0; logs/training.log says the console went and goes on."""
    data, out = make_shards(tmp_path / "data"), tmp_path / "out"
    cmd = train_cmd(out, data, "per_device_train_batch_size=2", "max_steps=100000", "save_steps=100000")
    pipeline = f"{shlex.join(cmd)} | tee {tmp_path / 'console.txt'} > /dev/null; exit ${{PIPESTATUS[0]}}"
    with open(tmp_path / "stderr", "w") as stderr:
        shell = subprocess.Popen(["bash", "-c", pipeline], env=subprocess_env, cwd=REPO_ROOT, stderr=stderr,
                                 start_new_session=True)
    try:
        wait_for_steps(out, shell)
        tee = next(pid for pid in _children(shell.pid) if Path(f"/proc/{pid}/comm").read_text().strip() == "tee")
        os.kill(tee, signal.SIGKILL)
        log = out / "logs" / "training.log"
        steps_then = log.read_text().count(": loss=")
        deadline = time.time() + 60
        while log.read_text().count(": loss=") < steps_then + 3 and time.time() < deadline:
            assert shell.poll() is None, (tmp_path / "stderr").read_text()[-3000:]
            time.sleep(0.2)
        os.killpg(shell.pid, signal.SIGINT)
        assert shell.wait(timeout=120) == 0, (tmp_path / "stderr").read_text()[-3000:]
    finally:
        if shell.poll() is None:
            os.killpg(shell.pid, signal.SIGKILL)
    text = log.read_text()
    after = text[text.index("console: stdout went away (Broken pipe)"):]
    assert re.search(r"Step \d+: loss=", after), text[-3000:]  # training went on after the pipe broke
    stopped = re.search(r"Stopped by SIGINT after step (\d+): checkpoint (\S+)", after)
    assert stopped, text[-3000:]
    verify_checkpoint(Path(stopped.group(2)))
    assert max(train_rows(out)) == int(stopped.group(1))
    assert "Traceback" not in (tmp_path / "stderr").read_text()


def test_a_console_write_that_fails_drops_the_console_and_tells_once(tmp_path):
    """utils/io/console.py on a pipe whose reader is gone: writes and flushes succeed from then on, the
    descriptor points at /dev/null, and the listeners hear of it once."""
    from utils.io import console

    read_end, write_end = os.pipe()
    os.close(read_end)
    stream = console.SurvivingStream(os.fdopen(write_end, "w", buffering=1), "stdout")
    heard = []
    console.on_lost(lambda name, why: heard.append((name, why)))
    try:
        for _ in range(3):
            print("a line nobody reads", file=stream, flush=True)
        stream.flush()
    finally:
        console._LISTENERS.pop()
    assert heard == [("stdout", "Broken pipe")] and stream.lost == "Broken pipe"
    assert os.readlink(f"/proc/self/fd/{stream.fileno()}") == os.devnull
    stream.close()


# ----------------------------------------------------------------------------- the closing summary (item 11)

def test_the_summary_s_tok_s_is_tokens_over_training_time_not_a_mean_of_window_rates():
    """Two windows of one step each, 0.05 s and 0.45 s: the session trained 2 steps' tokens in ~0.5 s. The
    mean of the two rows' rates would be ~2.8x that."""
    from accelerate import Accelerator

    from utils.observe.metrics import MetricsWindow, closing_summary

    os.environ.setdefault("ACCELERATE_USE_CPU", "true")
    window = MetricsWindow(Accelerator(cpu=True), tokens_per_step=1000, flops_per_token=1.0, peak=None,
                           precision="no")
    window.restart(first_step=1)
    rates = []
    for step, seconds in ((1, 0.05), (2, 0.45)):
        window.begin_step()
        time.sleep(seconds)
        window.add(torch.tensor(1.0))
        rates.append(window.row(step, 1000 * step, 1e-3, torch.tensor(0.0))["tokens_per_sec"])
        time.sleep(0.3)  # an eval after the row, between steps: not training time
    true_rate = 2000 / sum(1000 / r for r in rates)
    text = closing_summary(Path("/nonexistent/metrics.jsonl"), step=2, tokens=2000, session_s=1.0, window=window,
                           checkpoint=None, final_model=None)
    said = float(re.search(r"([\d,]+) tok/s", text).group(1).replace(",", ""))
    assert abs(said - true_rate) <= 1 and 2000 / 0.6 < said < 2000 / 0.45, (text, rates)
    assert said < 0.6 * sum(rates) / 2  # not the arithmetic mean of the rows' rates
    assert re.search(r"2,000 tokens trained in 0\.[56] s of training steps \(eval, samples and checkpoints left out\)",
                     text), text


def test_a_mixture_s_summary_compares_each_source_s_own_val_loss():
    """After a resume that changed the weights, the weighted val_loss of step 0 and of the last step are two
    different averages: the summary compares each source's own loss and gives the weighted one at the end."""
    import tempfile

    from accelerate import Accelerator

    from utils.observe.metrics import MetricsWindow, closing_summary

    rows = [{"step": 0, "tokens": 0, "val_loss": 8.0, "val_loss/web": 8.0, "val_loss/code": 8.0},  # 0.5/0.5
            {"step": 10, "tokens": 640, "val_loss": 5.0, "val_loss/web": 4.0, "val_loss/code": 6.0},
            {"step": 20, "tokens": 1280, "val_loss": 5.25, "val_loss/web": 3.0, "val_loss/code": 6.0}]  # 0.25/0.75
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "metrics.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        os.environ.setdefault("ACCELERATE_USE_CPU", "true")
        window = MetricsWindow(Accelerator(cpu=True), 64, 1.0, None, "no")
        text = closing_summary(path, step=20, tokens=1280, session_s=1.0, window=window, checkpoint=None,
                               final_model=None)
    lines = text.splitlines()
    assert "  val_loss/code 8.0000 at step 0 -> 6.0000 at step 20 (-25.0%)" in lines
    assert "  val_loss/web 8.0000 at step 0 -> 3.0000 at step 20 (-62.5%)" in lines
    assert not any(line.startswith("  val_loss 8.0000") for line in lines), text
    assert "  val_loss (the sources' weighted mean) 5.2500 at step 20" in lines


# ----------------------------------------------------------------------- one folder per run (item 16)

@pytest.mark.slow
def test_a_stopped_run_s_summary_and_a_fresh_run_into_its_folder(tmp_path, subprocess_env):
    """A run stopped at step 5 (logging every 4 steps) says 5 steps, not the last logged 4. A fresh run (no
    --resume) into its folder is refused in one line naming --resume and --output-dir, before it touches
    anything there; --resume auto continues it."""
    data, out = make_shards(tmp_path / "data"), tmp_path / "out"
    sets = ("per_device_train_batch_size=2", "logging_steps=4", "max_steps=6", "save_steps=100")
    first = run(train_cmd(out, data, *sets, "stop_at_step=5"), subprocess_env)
    assert re.search(r"^Summary: 5 steps, 640 tokens; this session \d+ s, 640 tokens trained in", first.stdout, re.M), \
        first.stdout[-2000:]
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".run.lock"}
    fresh = run(train_cmd(out, make_shards(tmp_path / "other-data", seed=3), *sets), subprocess_env, check=False)
    assert fresh.returncode == 2, fresh.stderr[-2000:]
    error = fresh.stderr.strip().splitlines()[-1]
    assert error.startswith(f"error: {out} holds another run's 1 checkpoint(s) (newest checkpoint-epoch0-step5-files")
    assert "--resume auto" in error and "--output-dir" in error and "Traceback" not in fresh.stderr
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".run.lock"} == before
    resumed = run(train_cmd(out, data, *sets, extra=("--resume", "auto")), subprocess_env)
    assert "at step 5" in resumed.stdout and max(train_rows(out)) == 6


def test_what_counts_as_another_run_s_files(tmp_path):
    """Any checkpoint (complete or not), final_model/, or rows in logs/metrics.jsonl (a run that trained and
    never saved): a fresh run is refused there. An empty folder, or logs without rows (a run stopped during
    setup), is free."""
    from utils.errors import UserError
    from utils.run.output_dir import refuse_another_run

    out = tmp_path / "out"
    (out / "logs").mkdir(parents=True)
    (out / "logs" / "training.log").write_text("Stopped: stopped by SIGTERM during setup\n")
    (out / "logs" / "metrics.jsonl").write_text("")
    refuse_another_run(out, defaulted=False)
    (out / "logs" / "metrics.jsonl").write_text('{"step": 0, "tokens": 0, "val_loss": 6.2}\n')
    with pytest.raises(UserError,
                       match=r"holds another run's logs/metrics\.jsonl, .*--resume auto.*a new --output-dir"):
        refuse_another_run(out, defaulted=False)
    (out / "logs" / "metrics.jsonl").unlink()
    (out / "final_model").mkdir()
    with pytest.raises(UserError, match=r"holds another run's final_model/, .*--set run_name=NAME"):
        refuse_another_run(out, defaulted=True)
    (out / "final_model").rmdir()
    for step in (9, 10):  # an incomplete one too: no manifest
        (out / "checkpoints" / f"checkpoint-epoch0-step{step}-files0").mkdir(parents=True)
    with pytest.raises(UserError, match=r"holds another run's 2 checkpoint\(s\) \(newest checkpoint-epoch0-step10-"):
        refuse_another_run(out, defaulted=False)


@pytest.mark.slow
def test_each_run_has_its_own_folder_under_runs_by_default(tmp_path, subprocess_env):
    """Without --output-dir a run writes runs/<run name>/ in the repository (git-ignored): the demo's and an
    own-data run's (`cpu`) folders differ, a config file's run is named by its file."""
    from configs.settle import settle_config
    from utils.run.output_dir import default_output_dir

    name = f"pytest-{uuid.uuid4().hex[:8]}"
    folders = {preset: default_output_dir(settle_config(preset, [], {})[0].effective_run_name, REPO_ROOT)
               for preset in ("demo", "cpu")}
    assert folders == {"demo": REPO_ROOT / "runs" / "demo", "cpu": REPO_ROOT / "runs" / "cpu"}
    config = tmp_path / "configs" / "my-run.yaml"
    config.parent.mkdir()
    config.write_text("base: demo\n")
    folder = default_output_dir(settle_config(str(config), [], {})[0].effective_run_name, REPO_ROOT)
    assert folder.parent == REPO_ROOT / "runs" and folder.name.startswith("my-run")
    data = make_shards(tmp_path / "data")
    cmd = [sys.executable, str(REPO_ROOT / "train.py"), "--config", "demo", "--data-dir", str(data)]
    for s in TINY + ["max_steps=1", "save_steps=100", f"run_name={name}"]:
        cmd += ["--set", s]
    folder = REPO_ROOT / "runs" / name
    try:
        proc = run(cmd, subprocess_env)
        assert f"Model exported to {folder / 'final_model'}" in proc.stdout
        assert [p.name for p in (folder / "checkpoints").iterdir()] == ["checkpoint-epoch0-step1-files0"]
        assert (folder / "logs" / "metrics.jsonl").is_file()
        ignored = subprocess.run(["git", "-C", str(REPO_ROOT), "check-ignore", "-q", str(folder / "logs" / "x")])
        assert ignored.returncode == 0, "runs/ is not git-ignored"
    finally:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)


def test_readme_commands_put_each_run_in_its_own_folder():
    """The docs' (README.md's and docs/'s) demo and own-data commands train into different folders, and the
    generate and plot commands name those folders (final_model is runs/<name>/final_model)."""
    from configs.settle import settle_config
    from utils.run.output_dir import default_output_dir

    text = "".join(page.read_text() for page in [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))])
    commands = [line.split("#")[0].strip() for block in re.findall(r"```bash\n(.*?)```", text, re.S)
                for line in block.splitlines()]
    trains = [c for c in commands if c.startswith("./start_training.sh --config demo") or
              c.startswith("./start_training.sh --config cpu")]
    folders = set()
    for command in trains:
        words = shlex.split(command)
        preset = words[words.index("--config") + 1]
        name = settle_config(preset, [], {})[0].effective_run_name
        folders.add(default_output_dir(name, REPO_ROOT).relative_to(REPO_ROOT))
    assert {Path("runs/demo"), Path("runs/cpu")} <= folders
    generate = next(c for c in commands if "generate.py" in c)
    assert shlex.split(generate)[2] == "runs/cpu/final_model"
    plot = next(c for c in commands if "plot_run.py" in c)
    assert "runs/demo runs/cpu" in plot


def test_a_checkpoint_of_another_shape_of_the_same_named_model_is_said_plainly():
    """The same model name with another vocabulary (another dataset's tokenizer): no advice to set the name
    it already has."""
    from utils.checkpoint.checkpointer import _check_fits
    from utils.checkpoint.format import CheckpointError
    from utils.checkpoint.run_record import RunRecord

    saved = RunRecord(1, model={"name": "demo", "padded_vocab_size": 2048}, seq_len=64)
    run_now = RunRecord(1, model={"name": "demo", "padded_vocab_size": 50304}, seq_len=64, max_steps=10)
    with pytest.raises(CheckpointError) as caught:
        _check_fits(Path("ck"), saved, 2, run_now)
    message = str(caught.value)
    assert "another shape of model 'demo' (padded_vocab_size 2048 vs 50304" in message and "--set model=" not in message


# ------------------------------------------------------------------------ the launcher's usage (item 18)

@pytest.mark.parametrize("args, fragment", [
    (["--config", "demo", "--bogus"], "unknown option '--bogus'"),
    (["--cpu"], "--config NAME is required"),
    (["--config", "demo", "--gpus", "0"], "--gpus must be at least 1"),
    (["--config", "demo", "--gpus", "3"], "--gpus 3: asked for 3 GPU(s) but no NVIDIA GPU is visible"),
])
def test_the_launcher_s_usage_errors_are_one_line_and_exit_2(tmp_path, subprocess_env, args, fragment):
    from tests.e2e.test_launcher import fake_gpus

    proc = subprocess.run([str(REPO_ROOT / "start_training.sh"), *args], env=fake_gpus(tmp_path, subprocess_env, 0),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("start_training.sh: error: "), proc.stderr
    assert fragment in proc.stderr


def test_the_supervisor_without_a_command_is_one_line_and_exit_2(subprocess_env):
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "utils" / "runtime" / "launch.py")], env=subprocess_env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "error: no command to run" in proc.stderr


def test_a_stop_signal_that_ends_the_launcher_layer_after_the_run_finished_is_exit_0(tmp_path, subprocess_env):
    """Slurm's scancel --signal=TERM reaches every process of the step: the ranks have just finished and
    exported (their status record says so) when accelerate/torchrun dies of the SIGTERM. The run finished: exit
    0 and the finished line, not "training was killed by SIGTERM" (143, which a batch script counts a failure)."""
    ready = tmp_path / "ready"
    finished_rank = ("import pathlib, sys, time\n"
                     "from utils.runtime.run_status import RunStatus\n"
                     "RunStatus(0, step=5, checkpoint='ckpt-5', final_model='out/final_model').write()\n"
                     "import os\npathlib.Path(sys.argv[2]).write_text(str(os.getpid()))\ntime.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-S", str(REPO_ROOT / "utils" / "runtime" / "launch.py"), "--",
                             sys.executable, "-c", finished_rank, str(REPO_ROOT), str(ready)],
                            env=subprocess_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not (ready.exists() and ready.read_text()):
        assert time.time() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)  # as scancel --signal=TERM: the supervisor, and the launcher layer under it,
    time.sleep(0.5)
    os.kill(int(ready.read_text()), signal.SIGTERM)  # which does not catch it here (it dies of it)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, (out, err)
    assert "finished after step 5" in out and "killed" not in err, (out, err)
