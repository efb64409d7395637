"""The repo's scripts run as their own processes forked from a warm interpreter (trainkit.run, the sweep of bad
inputs in tests/e2e/test_one_line_errors.py).

A toy train.py run costs ~6 CPU-s, ~5 of them importing torch, torch._dynamo (the optimizer's step imports it),
transformers and its model classes (the export), and the engine, before and after well under a second of its
own work; the suite runs a few hundred. `WarmPython` starts one interpreter that imports those once, then forks a
child per command: the child is a real process of its own (its pid, its stdout and stderr in files, its exit
status, its signal handlers, its threads and atexit handlers ended as an interpreter's exit ends them), running the
script as `python SCRIPT ARGS` would (`__main__`, sys.argv, sys.path[0] the script's folder, the working directory,
the command's environment), with the modules it imports already loaded. What a forked process cannot show is what
happens before those imports or at them: an import-time failure, and the threads' wait, which libgomp reads once
when torch loads (the warm interpreter loads it with the engine's GOMP_SPINCOUNT, as a run would; the run's line
then says torch was imported first). Those are tested cold (trainkit.run(..., cold=True)), and so is every
command that trainkit.run does not start: start_training.sh and the ranks it launches, Popen, the docs walk.
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

from tests.trainkit import REPO_ROOT  # the warm interpreter imports the engine from there, as the repo's scripts do

PRELOAD = ("numpy", "yaml", "configs", "configs.settle", "torch", "torch._dynamo", "torch.utils.tensorboard",
           "accelerate", "safetensors.torch", "tokenizers", "transformers", "transformers.modeling_utils",
           "transformers.models.gpt_neox.modeling_gpt_neox", "transformers.models.llama.modeling_llama",
           "transformers.models.qwen3.modeling_qwen3", "transformers.models.gemma3.modeling_gemma3",
           "utils.run.trainer", "utils.run.export", "utils.model.hf", "utils.model.families", "utils.data.build",
           "utils.data.prepare", "utils.io.storage", "utils.checkpoint.checkpointer", "utils.run.output_dir")

_SERVER = r'''
import atexit, json, os, runpy, sys, threading
given = dict(os.environ)
if not (os.environ.get("OMP_WAIT_POLICY") or os.environ.get("GOMP_SPINCOUNT")):
    # libgomp reads how its threads wait once, when torch loads it: as settle_wait() would have set it for a run
    os.environ["GOMP_SPINCOUNT"] = sys.argv[2]
for name in json.loads(sys.argv[1]):
    try:
        __import__(name)
    except Exception:
        pass
os.environ.clear()  # the commands see the environment given, not the variable set for libgomp
os.environ.update(given)
sys.stdout.flush()
requests, replies = sys.stdin.buffer, os.fdopen(os.dup(1), "w")
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)


def child(job):
    fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(fd, 0)
    for target, path in ((1, job["stdout"]), (2, job["stderr"])):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(job["cwd"])
    if job.get("env") is not None:
        os.environ.clear()
        os.environ.update(job["env"])
    script = os.path.abspath(job["argv"][0])
    sys.argv = [job["argv"][0]] + job["argv"][1:]
    sys.path[0] = os.path.dirname(script)
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


for line in requests:
    job = json.loads(line)
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        replies.close()
        child(job)
    replies.write(json.dumps({"pid": pid}) + "\n")
    replies.flush()
    _, status = os.waitpid(pid, 0)
    replies.write(json.dumps({"code": os.waitstatus_to_exitcode(status)}) + "\n")
    replies.flush()
'''


class WarmPython:
    """One warm interpreter (the environment `env`, given once), running one command at a time."""

    def __init__(self, env: dict, workdir: Path, preload: tuple[str, ...] = PRELOAD):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.count = 0
        from utils.runtime.threads import SPINCOUNT

        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER, json.dumps(preload), str(SPINCOUNT)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True,
                                     cwd=REPO_ROOT, bufsize=0)  # unbuffered: select() sees every reply not yet read

    def run(self, argv: list[str], cwd: Path, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
        """`argv` = [script, args...] (a Python script's path, relative to `cwd` or absolute), as `python script
        args` would run it in `cwd` (with the environment `env`, else the interpreter's); past `timeout` seconds it is
        killed (SIGKILL) and subprocess.TimeoutExpired raised, as subprocess.run does."""
        self.count += 1
        out, err = self.workdir / f"{self.count}.out", self.workdir / f"{self.count}.err"
        job = {"argv": [str(a) for a in argv], "cwd": str(cwd), "stdout": str(out), "stderr": str(err), "env": env}
        self.proc.stdin.write((json.dumps(job) + "\n").encode())
        self.proc.stdin.flush()
        pid = json.loads(self._reply(timeout=600))["pid"]
        timed_out = False
        try:
            code = json.loads(self._reply(timeout))["code"]
        except TimeoutError:
            timed_out = True
            os.kill(pid, signal.SIGKILL)
            code = json.loads(self._reply(60))["code"]
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
        out.unlink()
        err.unlink()
        if timed_out:
            raise subprocess.TimeoutExpired(argv, timeout, stdout, stderr)
        return subprocess.CompletedProcess(argv, code, stdout, stderr)

    def _reply(self, timeout: float) -> bytes:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the warm interpreter ended (exit {self.proc.wait()})")
        return line

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
