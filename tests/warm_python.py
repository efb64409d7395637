"""Entry points run as their own processes forked from a warm interpreter: for sweeps of many short commands.

A Python command of the engine spends about 2 CPU-s importing torch, transformers and the engine before its
first line of its own; a sweep of 80 bad inputs (tests/e2e/test_one_line_errors.py) spent most of its time there.
`WarmPython` starts one interpreter that imports those once, then forks a child per command: the child is a real
process of its own (its pid, its stdout and stderr in files, its exit status, its signal handlers, its threads and
atexit handlers ended as an interpreter's exit ends them), running the script as `python SCRIPT ARGS` would
(`__main__`, sys.argv, sys.path[0] the script's folder, the working directory), with the modules it imports
already loaded. What this cannot see is an import-time failure of a module the warm interpreter preloaded; the
rest of the suite starts every entry point cold."""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

PRELOAD = ("numpy", "torch", "torch._dynamo", "accelerate", "safetensors.torch", "tokenizers", "transformers",
           "transformers.modeling_utils", "configs", "utils.run.trainer", "utils.model.hf", "utils.data.prepare",
           "utils.io.storage")

_SERVER = r'''
import atexit, json, os, runpy, sys, threading
for name in json.loads(sys.argv[1]):
    try:
        __import__(name)
    except Exception:
        pass
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
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER, json.dumps(preload)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True,
                                     bufsize=0)  # unbuffered: select() sees every reply line not yet read

    def run(self, argv: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
        """`argv` = [script, args...] (a Python script's path, relative to `cwd` or absolute), as `python script
        args` would run it in `cwd`; killed (SIGKILL) past `timeout` seconds."""
        self.count += 1
        out, err = self.workdir / f"{self.count}.out", self.workdir / f"{self.count}.err"
        job = {"argv": [str(a) for a in argv], "cwd": str(cwd), "stdout": str(out), "stderr": str(err)}
        self.proc.stdin.write((json.dumps(job) + "\n").encode())
        self.proc.stdin.flush()
        pid = json.loads(self._reply(timeout=600))["pid"]
        try:
            code = json.loads(self._reply(timeout))["code"]
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)
            code = json.loads(self._reply(60))["code"]
        return subprocess.CompletedProcess(argv, code, out.read_text(errors="replace"), err.read_text(errors="replace"))

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
