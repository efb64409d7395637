"""start_training.sh: argument handling, GPU counting, and real launches of a probe script through accelerate."""
from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, free_port

# Launched in place of train.py: records what each process saw, and proves the processes form one
# gloo group by all-reducing (rank + 1).
PROBE = '''
import json, os, sys
from accelerate import Accelerator
import torch, torch.distributed as dist

state = Accelerator().state  # as train.py builds it: reads ACCELERATE_USE_CPU and the torchrun variables
total = None
if state.num_processes > 1:
    t = torch.tensor([float(state.process_index + 1)])
    dist.all_reduce(t)
    total = t.item()
record = {"rank": state.process_index, "local_rank": state.local_process_index,
          "world_size": state.num_processes, "device": state.device.type,
          "backend": state.backend, "all_reduce": total, "argv": sys.argv[1:],
          "env": {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}}
with open(os.path.join(os.environ["PROBE_OUT"], f"rank{state.process_index}.json"), "w") as f:
    json.dump(record, f)
if dist.is_initialized():
    dist.destroy_process_group()  # without it gloo may abort at exit ("terminate called without an active exception")
from utils.runtime.run_status import RunStatus
RunStatus(0).write()  # as train.py does: the launcher takes exit 0 without it for a run that ended early
'''


@pytest.fixture
def launcher(repo_root) -> Path:
    return repo_root / "start_training.sh"


@pytest.fixture
def probe(tmp_path) -> Path:
    path = tmp_path / "probe.py"
    path.write_text(PROBE)
    (tmp_path / "out").mkdir()
    return path


def fake_gpus(tmp_path: Path, env: dict, count: int) -> dict:
    """`env` with a fake `nvidia-smi` first on PATH listing `count` GPUs (none: fails like the real one)."""
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir(exist_ok=True)
    lines = "".join(f'echo "GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i:08d})"\n' for i in range(count))
    body = lines if count else 'echo "No devices were found"\nexit 6\n'
    script = bin_dir / "nvidia-smi"
    script.write_text('#!/bin/sh\n[ "$1" = "-L" ] || exit 2\n' + body)
    script.chmod(0o755)
    env = dict(env, PATH=f"{bin_dir}{os.pathsep}{env['PATH']}")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def start(launcher: Path, args: list[str], env: dict) -> subprocess.Popen:
    """The launcher in its own process group, so a hung run can be stopped with all its workers."""
    return subprocess.Popen([str(launcher), *args], env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: int = 120) -> subprocess.CompletedProcess:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{proc.args} ran past {timeout}s:\n{out}\n{err}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run(launcher: Path, args: list[str], env: dict, timeout: int = 120) -> subprocess.CompletedProcess:
    return finish(start(launcher, args, env), timeout)


def printed_command(stdout: str) -> list[str]:
    """The launcher's `+ ...` line as argv, environment assignments included."""
    lines = [line for line in stdout.splitlines() if line.startswith("+ ")]
    assert len(lines) == 1, stdout
    return shlex.split(lines[0][2:])


def accelerate_args(argv: list[str]):
    """Parse the printed command with accelerate's own parser: proves every flag exists in this version. The
    program is accelerate's `accelerate-launch` entry point: the `launch` of its CLI (the same parser and
    launch_command) without the CLI's other commands."""
    from importlib.metadata import entry_points

    from accelerate.commands.launch import launch_command_parser

    i = next(i for i, word in enumerate(argv) if word.endswith("accelerate-launch"))
    (script,) = entry_points(group="console_scripts", name="accelerate-launch")
    assert script.value == "accelerate.commands.launch:main"
    args = launch_command_parser().parse_args(argv[i + 1:])
    modes = [m for m in ("cpu", "multi_gpu", "use_fsdp", "use_deepspeed", "tpu") if getattr(args, m)]
    assert len(modes) <= 1, f"accelerate refuses more than one of {modes}"
    return args


def records(out_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out_dir.glob("rank*.json"))]


def test_help(launcher, subprocess_env):
    res = run(launcher, ["--help"], subprocess_env)
    assert res.returncode == 0
    for flag in ("--config", "--gpus", "--cpu", "--nodes", "--node-rank", "--node-rank-from", "--main-addr",
                 "--main-port", "--resume", "--max-steps", "--strategy", "--stop-exit-code", "--dry-run",
                 "TRAIN_SCRIPT"):
        assert flag in res.stdout


@pytest.mark.parametrize("args, message", [
    (["--config", "demo", "--bogus"], "unknown option '--bogus'"),
    (["--gpus", "1"], "--config NAME is required"),
    (["--config", "demo", "--nodes", "2"], "needs --main-addr"),
    (["--config", "demo", "--nodes", "2", "--node-rank", "2", "--main-addr", "h"], "must be below --nodes 2"),
    (["--config", "demo", "--strategy", "zero3"], "use ddp or fsdp"),
    (["--config", "demo", "--gpus", "two"], "not a whole number"),
    (["--config"], "--config needs a value"),
    (["--config", "demo", "--nodes", "2", "--main-addr", "h", "--node-rank-from", "NEOX_UNSET_VAR"],
     "--node-rank-from NEOX_UNSET_VAR: the variable is not set (a Kubernetes Indexed Job sets JOB_COMPLETION_INDEX"),
    (["--config", "demo", "--node-rank-from", "JOB-INDEX"], "'JOB-INDEX' is not an environment variable's name"),
    (["--config", "demo", "--node-rank", "1", "--node-rank-from", "HOME"], "--node-rank R or --node-rank-from VAR"),
    (["--config", "demo", "--stop-exit-code", "2"], "--stop-exit-code '2': give a status from 4 to 255"),
])
def test_usage_errors_exit_2(launcher, subprocess_env, args, message):
    res = run(launcher, args, subprocess_env)
    assert res.returncode == 2
    assert res.stderr.startswith("start_training.sh: error: ") and res.stderr.count("\n") == 1, res.stderr
    assert message in res.stderr
    assert res.stdout == ""


def test_gpus_without_gpu_suggests_cpu(launcher, tmp_path, subprocess_env):
    env = fake_gpus(tmp_path, subprocess_env, 0)
    res = run(launcher, ["--config", "demo", "--gpus", "3"], env)
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0, res.stderr
    assert "asked for 3 GPU(s) but no NVIDIA GPU is visible" in res.stderr and "--cpu" in res.stderr


def test_more_gpus_than_visible(launcher, tmp_path, subprocess_env):
    env = fake_gpus(tmp_path, subprocess_env, 8)
    res = run(launcher, ["--config", "production", "--gpus", "9"], env)
    assert res.returncode == 2
    assert "asked for 9 GPUs but 8 are visible" in res.stderr
    res = run(launcher, ["--config", "production", "--gpus", "3"], dict(env, CUDA_VISIBLE_DEVICES="4,5"))
    assert res.returncode == 2
    assert "asked for 3 GPUs but 2 are visible" in res.stderr


def test_gpu_count_comes_from_nvidia_smi(launcher, tmp_path, subprocess_env, probe):
    env = dict(fake_gpus(tmp_path, subprocess_env, 8), TRAIN_SCRIPT=str(probe))
    res = run(launcher, ["--config", "production", "--dry-run"], env)
    assert res.returncode == 0, res.stderr
    argv = printed_command(res.stdout)
    assert not any(a.startswith("ACCELERATE_USE_CPU") for a in argv)
    args = accelerate_args(argv)
    assert (args.num_processes, args.num_machines, args.multi_gpu, args.cpu) == (8, 1, True, False)
    # one machine without --main-port: a port free now, not torchrun's 29500 (runs side by side never meet)
    assert args.main_process_port not in (None, 29500)
    with socket.socket() as s:
        s.bind(("127.0.0.1", args.main_process_port))
    res = run(launcher, ["--config", "production", "--dry-run", "--main-port", "29511"], env)
    assert accelerate_args(printed_command(res.stdout)).main_process_port == 29511
    res = run(launcher, ["--config", "production", "--dry-run"], dict(env, CUDA_VISIBLE_DEVICES="1,3,5"))
    assert accelerate_args(printed_command(res.stdout)).num_processes == 3
    res = run(launcher, ["--config", "production", "--gpus", "1", "--dry-run"], env)
    args = accelerate_args(printed_command(res.stdout))
    assert (args.num_processes, args.multi_gpu) == (1, False)
    assert list(tmp_path.joinpath("out").iterdir()) == [], "--dry-run must not start anything"


def test_no_gpu_runs_one_cpu_process_with_forwarded_args(launcher, tmp_path, subprocess_env, probe):
    env = dict(fake_gpus(tmp_path, subprocess_env, 0), TRAIN_SCRIPT=str(probe), PROBE_OUT=str(tmp_path / "out"))
    forwarded = ["--resume", "checkpoint-epoch0-step5-files1", "--max-steps", "7", "--no-background-upload",
                 "--mixed-precision", "no"]
    extra = ["--set", "save_steps=5", "--output-dir", str(tmp_path / "with space")]
    res = run(launcher, ["--config", "demo", *forwarded, "--", *extra], env)
    assert res.returncode == 0, res.stderr
    assert "no NVIDIA GPU visible: running one CPU process" in res.stdout
    argv = printed_command(res.stdout)
    assert "ACCELERATE_USE_CPU=true" in argv
    assert argv[-(len(extra) + len(forwarded) + 3):] == [str(probe), "--config", "demo", *forwarded, *extra]
    args = accelerate_args(argv)
    assert (args.num_processes, args.cpu, args.multi_gpu) == (1, True, False)
    [rec] = records(tmp_path / "out")
    assert (rec["rank"], rec["world_size"], rec["device"]) == (0, 1, "cpu")
    assert rec["argv"] == ["--config", "demo", *forwarded, *extra]


def test_cpu_two_processes_really_start(launcher, tmp_path, subprocess_env, probe):
    env = dict(subprocess_env, TRAIN_SCRIPT=str(probe), PROBE_OUT=str(tmp_path / "out"))
    res = run(launcher, ["--config", "demo", "--cpu", "--gpus", "2", "--main-port", str(free_port()),
                         "--max-steps", "3", "--", "--set", "logging_steps=1"], env)
    assert res.returncode == 0, res.stdout + res.stderr
    args = accelerate_args(printed_command(res.stdout))
    assert (args.num_processes, args.multi_gpu, args.cpu) == (2, True, False)
    recs = records(tmp_path / "out")
    assert len(recs) == 2
    assert {r["rank"] for r in recs} == {0, 1} and {r["local_rank"] for r in recs} == {0, 1}
    for r in recs:
        assert (r["world_size"], r["device"], r["backend"], r["all_reduce"]) == (2, "cpu", "gloo", 3.0)
        assert r["env"]["WORLD_SIZE"] == "2"
        assert r["argv"] == ["--config", "demo", "--max-steps", "3", "--set", "logging_steps=1"]


def test_multi_node_command(launcher, tmp_path, subprocess_env, probe):
    env = dict(fake_gpus(tmp_path, subprocess_env, 8), TRAIN_SCRIPT=str(probe))
    res = run(launcher, ["--config", "production", "--gpus", "8", "--nodes", "2", "--node-rank", "1",
                         "--main-addr", "10.1.2.3", "--dry-run"], env)
    assert res.returncode == 0, res.stderr
    args = accelerate_args(printed_command(res.stdout))
    assert (args.num_processes, args.num_machines, args.machine_rank) == (16, 2, 1)
    assert (args.main_process_ip, args.main_process_port, args.multi_gpu) == ("10.1.2.3", 29500, True)


def test_the_node_rank_from_an_environment_variable(launcher, tmp_path, subprocess_env, probe):
    """--node-rank-from VAR (a Kubernetes Indexed Job's JOB_COMPLETION_INDEX): the rank accelerate gets; a
    value out of range is named with its variable, one that is not a number is refused without being shown (the
    variable may hold anything)."""
    env = dict(fake_gpus(tmp_path, subprocess_env, 8), TRAIN_SCRIPT=str(probe))
    common = ["--config", "production", "--nodes", "2", "--main-addr", "neox-0.neox", "--node-rank-from",
              "JOB_COMPLETION_INDEX", "--dry-run"]
    res = run(launcher, common, dict(env, JOB_COMPLETION_INDEX="1"))
    assert res.returncode == 0, res.stderr
    args = accelerate_args(printed_command(res.stdout))
    assert (args.machine_rank, args.main_process_ip, args.num_machines) == (1, "neox-0.neox", 2)
    res = run(launcher, common, dict(env, JOB_COMPLETION_INDEX="2"))
    assert res.returncode == 2 and res.stderr == "start_training.sh: error: --node-rank-from JOB_COMPLETION_INDEX " \
        "(JOB_COMPLETION_INDEX=2) must be below --nodes 2\n", res.stderr
    res = run(launcher, common, dict(env, JOB_COMPLETION_INDEX="s3cr3t"))
    assert res.returncode == 2 and "its value is not a whole number" in res.stderr and "s3cr3t" not in res.stderr


def test_fsdp_strategy_is_a_field_not_accelerate_flags(launcher, tmp_path, subprocess_env, probe):
    env = dict(fake_gpus(tmp_path, subprocess_env, 8), TRAIN_SCRIPT=str(probe))
    res = run(launcher, ["--config", "production", "--gpus", "4", "--strategy", "fsdp", "--dry-run"], env)
    assert res.returncode == 0, res.stderr
    cmd = printed_command(res.stdout)
    args = accelerate_args(cmd)
    assert not args.use_fsdp and args.multi_gpu and args.num_processes == 4  # train.py shards the model itself
    assert "--set strategy=fsdp" in " ".join(cmd)
    res = run(launcher, ["--config", "demo", "--cpu", "--gpus", "2", "--strategy", "fsdp", "--dry-run"], env)
    assert res.returncode == 0 and "strategy=fsdp" in res.stdout, res.stderr


@pytest.mark.slow
def test_two_nodes_on_localhost(launcher, tmp_path, subprocess_env, probe):
    """Two launcher invocations, as on two machines, form one 2-process group through --main-addr/--main-port."""
    env = dict(subprocess_env, TRAIN_SCRIPT=str(probe), PROBE_OUT=str(tmp_path / "out"))
    common = ["--config", "demo", "--cpu", "--gpus", "1", "--nodes", "2", "--main-addr", "127.0.0.1",
              "--main-port", str(free_port())]
    procs = [start(launcher, [*common, "--node-rank", str(rank)], env) for rank in (0, 1)]
    try:
        results = [finish(p) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert [r.returncode for r in results] == [0, 0], [r.stdout + r.stderr for r in results]
    recs = records(tmp_path / "out")
    assert sorted(r["rank"] for r in recs) == [0, 1]
    assert all(r["world_size"] == 2 and r["all_reduce"] == 3.0 and r["local_rank"] == 0 for r in recs)


# ------------------------------------------------------------------ --set, the preset check, precision

def test_set_is_passed_and_the_precision_reaches_accelerate(launcher, subprocess_env):
    proc = subprocess.run([str(launcher), "--config", "production", "--cpu", "--set", "mixed_precision=no",
                           "--set", "save_steps=7", "--dry-run"], env=subprocess_env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("+ "))
    args = shlex.split(line[2:])
    assert args[args.index("--mixed_precision") + 1] == "no"  # from --set, not the preset's bf16
    assert args[args.index("--set") + 1] == "mixed_precision=no" and "save_steps=7" in args
    fp8 = subprocess.run([str(launcher), "--config", "production", "--cpu", "--mixed-precision", "fp8", "--dry-run"],
                         env=subprocess_env, capture_output=True, text=True)
    args = shlex.split(next(ln for ln in fp8.stdout.splitlines() if ln.startswith("+ "))[2:])
    assert args[args.index("--mixed_precision") + 1] == "bf16"  # fp8 runs torchao's float8 inside bf16
    # a config warning (warmup longer than the run) is not taken for the precision
    short = subprocess.run([str(launcher), "--config", "demo", "--cpu", "--set", "max_steps=4", "--dry-run"],
                           env=subprocess_env, capture_output=True, text=True)
    assert short.returncode == 0, short.stderr
    args = shlex.split(next(ln for ln in short.stdout.splitlines() if ln.startswith("+ "))[2:])
    assert args[args.index("--mixed_precision") + 1] == "no"


@pytest.mark.parametrize("argv, fragment", [
    (["--config", "prodution"], "did you mean 'production'"),
    (["--config", "demo", "--set", "save_step=3"], "did you mean 'save_steps'"),
    (["--config", "demo", "--set", "oops"], "--set 'oops': expected KEY=VALUE"),
    (["--config", "demo", "--output-dir", "x"], "--output-dir is a train.py option: put it after --"),
    (["--config", "demo", "--bogus"], "train.py options go after --"),
])
def test_bad_config_or_option_stops_before_launching(launcher, subprocess_env, argv, fragment):
    proc = subprocess.run([str(launcher), *argv, "--cpu"], env=subprocess_env, capture_output=True, text=True)
    assert proc.returncode == 2 and fragment in proc.stderr, proc.stderr
    assert "accelerate-launch" not in proc.stdout and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_torchrun_runs_train_py_directly(subprocess_env, tmp_path, repo_root):
    """`torchrun --nproc-per-node 2 train.py ...` (no launcher): two CPU ranks train, in sync."""
    from tests.trainkit import TINY, make_shards, train_rows

    data, out = make_shards(tmp_path / "data"), tmp_path / "out"
    env = dict(subprocess_env, ACCELERATE_USE_CPU="true")
    cmd = ["torchrun", "--nproc-per-node", "2", "--master-port", str(free_port()), str(repo_root / "train.py"),
           "--config", "demo", "--output-dir", str(out), "--data-dir", str(data)]
    for s in TINY + ["max_steps=3", "save_steps=100", "per_device_train_batch_size=2"]:
        cmd += ["--set", s]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=repo_root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 process(es) on cpu" in proc.stdout and max(train_rows(out)) == 3
    final = [json.loads(row) for row in (out / "logs" / "metrics.jsonl").read_text().splitlines() if '"final"' in row]
    assert final and final[-1]["weights_in_sync"] is True and len(final[-1]["weight_sums"]) == 2


# ------------------------------------------------------------------------- errors after the launch

# A rank that ends as train.py does, through the status record's own writer: `stopped_by` (empty: finished), exit 0;
# "fail" marks a trained step and exits 1.
RANK_THAT_ENDS = """import sys
from utils.runtime.run_status import RunStatus, mark_trained
mark_trained()
if sys.argv[1] == "fail":
    sys.exit(1)
RunStatus(0, stopped_by=sys.argv[1] or None, step=3, final_model=None if sys.argv[1] else "final_model").write()
"""


@pytest.mark.parametrize("stopped_by, status", [("SIGTERM", 143), ("a signal on another rank", 143),
                                                ("stop_at_step", 0), ("", 0)])
def test_the_stop_exit_code_is_a_stop_signal_s_before_the_run_finished(repo_root, subprocess_env, stopped_by,
                                                                        status):
    """--stop-exit-code N (a Kubernetes pod): N where the ranks stopped on a signal, theirs or another rank's (the
    mark beside the status record, which the launchers of nodes without rank 0 read), 0 for a finished run and for
    one that stopped where its config said."""
    proc = subprocess.run([sys.executable, "-S", str(repo_root / "utils/runtime/launch.py"), "--stop-exit-code", "143",
                           "--", sys.executable, "-c", RANK_THAT_ENDS, stopped_by], env=subprocess_env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == status, proc.stderr


def test_a_stop_signal_during_a_restart_s_wait_exits_with_the_stop_exit_code(repo_root, subprocess_env):
    proc = subprocess.Popen([sys.executable, "-S", str(repo_root / "utils/runtime/launch.py"), "--max-restarts", "1",
                             "--restart-delay", "60", "--stop-exit-code", "143", "--", sys.executable, "-c",
                             RANK_THAT_ENDS, "fail"], env=subprocess_env, stderr=subprocess.PIPE, text=True)
    try:
        assert "restart 1 of 1 in 60 s" in proc.stderr.readline()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 143
        assert "stopped by SIGTERM before restart 1; nothing running" in proc.stderr.read()
    finally:
        proc.kill()


def test_an_error_after_launch_is_one_line_and_train_py_s_exit_status(launcher, subprocess_env, tmp_path):
    """train.py's `error:` line is all of stderr (no accelerate traceback), and the launcher exits 2, as
    train.py did, not accelerate's 1."""
    proc = subprocess.run([str(launcher), "--config", "demo", "--cpu", "--resume", "latest", "--",
                           "--output-dir", str(tmp_path / "empty")], env=subprocess_env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [proc.stderr.strip()] and proc.stderr.startswith("error: --resume latest")


CATCHES_BOTH = "import os, signal, subprocess, sys, time\n" \
    "for s in (signal.SIGTERM, signal.SIGINT): signal.signal(s, lambda *a: None)\n"


def test_a_stop_signal_waits_for_a_rank_to_exec_not_for_the_copy_of_its_parent_that_fork_made():
    """Between fork and exec a rank is a copy of its parent (torchrun's agent, or the supervisor), which
    catches SIGTERM and SIGINT: /proc shows the parent's handlers, while CPython's subprocess blocks every
    signal there and resets them to the default before exec, so a Ctrl-C forwarded then killed the rank
    (rank 1 "killed by SIGINT" in a CI run). The supervisor's check (`_acts_on`) says no to the copy and yes
    to the rank once it has exec'd and installed its own handlers; a fresh interpreter (SIGINT alone, Python's
    default) is not yet acting on it either."""
    import sys

    from utils.runtime.launch import _acts_on, _catches

    parent = subprocess.Popen([sys.executable, "-c", CATCHES_BOTH + """
copy = os.fork()
if copy == 0:
    time.sleep(60)
    os._exit(0)
rank = subprocess.Popen([sys.executable, "-c", sys.argv[1] + "print('ready', flush=True); time.sleep(60)"],
                        stdout=subprocess.PIPE, text=True)
fresh = subprocess.Popen([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(60)"],
                         stdout=subprocess.PIPE, text=True)
rank.stdout.readline(), fresh.stdout.readline()
print(copy, rank.pid, fresh.pid, flush=True)
time.sleep(60)
""", CATCHES_BOTH], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        copy, rank, fresh = (int(pid) for pid in parent.stdout.readline().split())
        assert _catches(copy, signal.SIGTERM) and _catches(copy, signal.SIGINT)  # what the check read before
        assert not _acts_on(copy, signal.SIGINT) and not _acts_on(copy, signal.SIGTERM)
        assert _acts_on(rank, signal.SIGINT) and _acts_on(rank, signal.SIGTERM)
        assert _catches(fresh, signal.SIGINT) and not _acts_on(fresh, signal.SIGINT)
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()


def test_stderr_filter_keeps_a_rank_s_words_and_drops_the_launcher_s_repetition():
    import io

    from utils.runtime.launch import StderrFilter

    sink = io.BytesIO()
    f = StderrFilter(sink)
    for chunk in (b"error: bad thing\n", b"error: bad thing\n",  # two ranks say the same
                  b"\rtrain:  10%|#  ", b"| 1/10\n",  # a progress bar's partial line shows at once
                  b"Traceback (most recent call last):\n  File \"train.py\", line 1\nValueError: a real bug\n",
                  b"W1123 12:00:00.0 1 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 9 "
                  b"closing signal SIGTERM\n",
                  b"Traceback (most recent call last):\n  File \"run.py\", line 9, in main\n"
                  b"    raise ChildFailedError(\n"
                  b"torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n====\ntrain.py FAILED\n"):
        f.feed(chunk)
    f.close()
    assert sink.getvalue() == (b"error: bad thing\n\rtrain:  10%|#  | 1/10\nTraceback (most recent call last):\n"
                               b"  File \"train.py\", line 1\nValueError: a real bug\n")
    sink = io.BytesIO()
    f = StderrFilter(sink)
    f.feed(b"Trace")
    assert sink.getvalue() == b""  # may be a traceback's start: held
    f.feed(b"back (most recent call last):\n  File \"x\"\nsubprocess.CalledProcessError: Command '[...]' returned "
           b"non-zero exit status 2.\n")
    f.close()
    assert sink.getvalue() == b""
    # node 1 after node 0 ended the run with status 1: torch's C++ dump and exit-barrier traceback -> one line
    sink = io.BytesIO()
    f = StderrFilter(sink)
    agent = (b"E1123 22:28:36.382000 21157 .venv/lib/python3.11/site-packages/torch/distributed/elastic/agent/server/"
             b"api.py:1008] ")
    f.feed(b"warning: this node's shards did not reach GCS\n"
           b"[W1123 22:28:36.742 TCPStore.cpp:138] [c10d] recvValueWithTimeout failed: Failed to recv, got 0 bytes.\n"
           b"Exception raised from recvBytes at /__w/pytorch/torch/csrc/distributed/c10d/Utils.hpp:787 (most recent "
           b"call first):\nframe #0: c10::Error::Error(c10::SourceLocation) + 0x9d (0x7f in libc10.so)\n"
           b"<omitting python frames>\nframe #29: _start + 0x21 (0x55 in python)\n\n"
           + agent + b"Error waiting on exit barrier. Elapsed: 1.98 seconds\n"
           + agent + b"Traceback (most recent call last):\n"
           + agent + b"  File \"api.py\", line 994, in _exit_barrier\n"
           + agent + b"torch.distributed.DistNetworkError: Failed to recv, got 0 bytes.\n"
           b"start_training.sh: finished after step 2\n")
    f.close()
    assert sink.getvalue() == (b"warning: this node's shards did not reach GCS\n"
                               b"[W1123 22:28:36.742 TCPStore.cpp:138] [c10d] recvValueWithTimeout failed: Failed to "
                               b"recv, got 0 bytes.\n" + StderrFilter.EXIT_BARRIER_SAID +
                               b"start_training.sh: finished after step 2\n")
    sink = io.BytesIO()
    f = StderrFilter(sink)
    f.feed(b"\rtrain:   0%| 0/3\r")  # a progress bar clearing itself before a log line on stdout: nothing held
    assert sink.getvalue() == b"\rtrain:   0%| 0/3\r"


# ------------------------------------------------------------- every exit code of docs/contracts.md, through it

def _kill_the_rank_after_step_1(out: Path, proc: subprocess.Popen) -> None:
    """Once step 1 is logged (the rank then hangs after step 2: NEOX_DEBUG_HANG_AFTER_STEP=2, the watchdog off),
    SIGKILL it."""
    import time

    from tests.trainkit import training_process

    rows, deadline = out / "logs" / "metrics.jsonl", time.time() + 240
    while not (rows.exists() and '"loss"' in rows.read_text()):
        assert proc.poll() is None and time.time() < deadline, "no training step in time"
        time.sleep(0.2)
    os.kill(training_process(out), signal.SIGKILL)


def _train_py_exiting_0_at_step_3(tmp_path: Path) -> str:
    """A TRAIN_SCRIPT: train.py, whose process exits 0 as step 3 begins (os._exit: no status record, no
    final_model/, no word), as a rank that ends halfway without a stop."""
    script = tmp_path / "exits_0_at_step_3.py"
    script.write_text("import os, runpy, sys\n"
                      "from utils.run.trainer import Trainer\n"
                      "step = Trainer.train_step\n"
                      "def exit_at_3(self, data):\n"
                      "    if self.state.step == 3:\n"
                      "        os._exit(0)\n"
                      "    step(self, data)\n"
                      "Trainer.train_step = exit_at_3\n"
                      f"sys.argv[0] = {str(REPO_ROOT / 'train.py')!r}\n"
                      "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    return str(script)


EXIT_CODES = {  # id: (exit status, start_training.sh options, --set values, environment, action, a line it prints)
    "0-finished": (0, [], ["max_steps=2"], {}, None, "start_training.sh: finished after step 2"),
    "1-upload-failed": (1, [], ["max_steps=2", "save_steps=1", "gcs_bucket=nowhere", "run_name=r",
                                "upload_timeout_s=1"], {"STORAGE_EMULATOR_HOST": "http://127.0.0.1:9"}, None,
                        "error: upload of"),
    "2-input-error": (2, ["--resume", "latest"], [], {}, None, "error: --resume latest"),
    "3-hang-1-process": (3, [], ["max_steps=100", "hang_timeout_s=3"], {"NEOX_DEBUG_HANG_AFTER_STEP": "2"}, None,
                         "hang watchdog: rank 0 made no training progress"),
    "3-hang-2-ranks": (3, ["--gpus", "2"], ["max_steps=100", "hang_timeout_s=3"],
                       {"NEOX_DEBUG_HANG_AFTER_STEP": "2:1"}, None, "hang watchdog: rank 1 made no training progress"),
    "137-rank-killed": (128 + signal.SIGKILL, [], ["max_steps=100", "logging_steps=1", "hang_timeout_s=0"],
                        {"NEOX_DEBUG_HANG_AFTER_STEP": "2"}, _kill_the_rank_after_step_1, "was killed by SIGKILL"),
    "1-exit-0-at-step-3": (1, [], ["max_steps=8", "save_steps=2"], {"TRAIN_SCRIPT": _train_py_exiting_0_at_step_3},
                           None, "start_training.sh: error: training exited with status 0 before its run finished"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", EXIT_CODES, ids=list(EXIT_CODES))
def test_every_exit_code_of_the_contract_reaches_the_caller(launcher, tmp_path, subprocess_env, case):
    """docs/contracts.md's exit codes, each from a real run through start_training.sh (accelerate exits 1
    whatever its rank's status; torchrun too): 0 finished, 1 a checkpoint that did not reach GCS or a rank that
    exited 0 halfway (step 3 of 8: it was exit 0, without a word), 2 an input error, 3 the hang watchdog (one
    process, and a rank of two that hangs), 128+N a rank killed by signal N."""
    from tests.trainkit import TINY, make_shards

    code, options, sets, env, action, said = EXIT_CODES[case]
    env = {name: value(tmp_path) if callable(value) else value for name, value in env.items()}
    data, out = make_shards(tmp_path / "data"), tmp_path / "out"
    args = ["--config", "demo", "--cpu", "--main-port", str(free_port()), *options]
    for s in TINY + ["per_device_train_batch_size=2", *sets]:
        args += ["--set", s]
    proc = start(launcher, args + ["--", "--output-dir", str(out), "--data-dir", str(data)],
                 dict(subprocess_env, **env))
    if action:
        action(out, proc)
    res = finish(proc, timeout=300)
    text = res.stdout + res.stderr
    assert res.returncode == code, text[-3000:]
    assert said in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    if case in ("0-finished", "1-exit-0-at-step-3"):
        assert (out / "final_model").is_dir() == (code == 0), text[-3000:]


@pytest.mark.parametrize("trained", [True, False])
def test_a_command_that_exits_0_before_its_run_finished_is_a_failure(subprocess_env, trained):
    """The supervisor knows a run ended as it should by its status record (utils/runtime/run_status.py): a command
    that exits 0 without one (a rank that ended halfway, os._exit(0)) is one error line and exit 1, restarted
    under --max-restarts when it had trained a step (a failure like any other), never before its first step."""
    rank = ("import os, sys\n"
            "from utils.runtime.run_status import mark_trained\n"
            + ("mark_trained()\n" if trained else "") +
            "os._exit(0)\n")
    proc = subprocess.run([sys.executable, "-S", str(REPO_ROOT / "utils" / "runtime" / "launch.py"), "--max-restarts",
                           "1", "--restart-delay", "0", "--", sys.executable, "-c", rank], env=subprocess_env,
                          capture_output=True, text=True, timeout=60)
    said = "training exited with status 0 before its run finished (no status record: no final model, no stop)"
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert proc.returncode == 1 and len(errors) == 1 and said in errors[0], proc.stderr
    if trained:
        assert f"{said}: a process ended early; restart 1 of 1 in 0 s" in proc.stderr, proc.stderr
        assert "gave up after 1 restart(s) (--max-restarts 1)" in proc.stderr, proc.stderr
    else:
        assert "not restarting: the run failed before its first training step" in proc.stderr, proc.stderr
        assert "restart 1" not in proc.stderr, proc.stderr
