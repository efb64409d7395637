"""Who runs a prepare's partitions: `local` (a process pool on this machine, the default) or `ray` (Ray core
tasks, one per partition, on a Ray cluster or a local one).

Both run `utils.data.partition.tokenize_partition` on each job and yield its completion record as each
partition finishes, in whatever order; the merge puts the partitions back in plan order, so the output is
the same bytes whatever runs them. A bad input (a PrepareError: the message names the file and line) or a
full disk stops the run at once; a partition that fails otherwise (a worker killed, a node lost, a bucket's
read or write that broke off) is retried by Ray up to RAY_RETRIES times, while the local pool stops and the
next run redoes only what is missing. The tokenizer travels to each worker once (the pool's initializer, Ray's object store), not with
every job; a Ray task tokenizes on one thread (it asks Ray for one CPU).
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Iterator

from utils.data.corpus import PrepareError
from utils.data.partition import PartitionJob, tokenize_partition
from utils.errors import DiskFullError

EXECUTORS = ("local", "ray")
RAY_RETRIES = 3
RAY_PIN = "ray==2.60.0"
UTILS_PACKAGE = Path(__file__).resolve().parent.parent  # what a Ray worker imports the task from


def make_executor(name: str, workers: int, ray_address: str | None = None) -> "LocalExecutor | RayExecutor":
    if name == "local":
        if ray_address:
            raise PrepareError("--ray-address goes with --executor ray")
        return LocalExecutor(workers)
    if name == "ray":
        return RayExecutor(workers, ray_address)
    raise PrepareError(f"--executor {name}: choose one of {', '.join(EXECUTORS)}")


class LocalExecutor:
    """`workers` processes (spawned: the tokenizers library must not be forked after use), or this process
    alone for one worker or one partition (the tokenizer then encodes each batch on every core). With fewer
    partitions than workers, each process encodes on its share of the cores."""

    def __init__(self, workers: int):
        self.workers = workers
        self.startup_seconds = 0.0

    def run(self, jobs: list[PartitionJob], tokenizer_json: str) -> Iterator[dict]:
        if self.workers == 1 or len(jobs) <= 1:
            for job in jobs:
                yield tokenize_partition(job, tokenizer_json)
            return
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed
        from concurrent.futures.process import BrokenProcessPool

        started = time.perf_counter()
        processes = min(self.workers, len(jobs))
        # concurrent.futures' pool, not multiprocessing.Pool: a worker that dies (the kernel's OOM killer, a
        # signal) breaks it, and every wait on it ends, where multiprocessing.Pool waits forever for its task
        pool = ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_init_pool_worker, initargs=(tokenizer_json, self.workers // processes))
        finished = False
        try:
            futures = [pool.submit(_pool_task, job) for job in jobs]
            self.startup_seconds = time.perf_counter() - started
            for future in as_completed(futures):
                try:
                    record = future.result()
                except BrokenProcessPool:
                    raise PrepareError("a worker process died while tokenizing (killed by the kernel for memory, "
                                       "or by a signal); the partitions done are kept: run the same command again "
                                       "(with fewer --workers if memory is short)") from None
                yield record
            finished = True
        finally:
            _stop_pool(pool, finished)


_POOL_TOKENIZER: list[str] = []


def _stop_pool(pool, finished: bool) -> None:
    """Every job done: the pool's ordinary shutdown. Otherwise (an error in one worker, a dead worker, a stop
    signal) nothing waits on the others' partitions: pending jobs are cancelled and the workers ended."""
    if finished:
        pool.shutdown(wait=True)
        return
    workers = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for process in workers:
        if process.is_alive():
            process.terminate()
    for process in workers:
        process.join(timeout=5)
        if process.is_alive():
            process.kill()
            process.join(timeout=5)


def _init_pool_worker(tokenizer_json: str, threads: int) -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process stops the pool (no traceback per worker)
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if threads > 1 else "false"
    os.environ["RAYON_NUM_THREADS"] = str(threads)  # the tokenizer's thread pool, read when it starts
    _POOL_TOKENIZER[:] = [tokenizer_json]


def _pool_task(job: PartitionJob) -> dict:
    return tokenize_partition(job, _POOL_TOKENIZER[0])


class RayExecutor:
    """Joins the cluster at `address` (its CPUs run the tasks), or starts a local Ray with `workers` CPUs.
    Workers import the task from this repository's `utils` package, which Ray ships to them
    (`runtime_env.py_modules`); they need the repository's requirements installed, and must reach the
    inputs and the output: gs:// URLs, or a filesystem every node mounts at the same path."""

    def __init__(self, workers: int, address: str | None):
        """Refuses, before any work, a machine without Ray and an address nothing answers at."""
        try:
            import ray  # noqa: F401
        except ImportError:
            raise PrepareError(f"--executor ray needs Ray: pip install '{RAY_PIN}' (or use --executor local)") from None
        if address:
            _check_reachable(address)
        self.workers, self.address = workers, address
        self.startup_seconds = 0.0

    def run(self, jobs: list[PartitionJob], tokenizer_json: str) -> Iterator[dict]:
        if not jobs:
            return
        import ray

        started = time.perf_counter()
        env = {"py_modules": [str(UTILS_PACKAGE)], "env_vars": {"TOKENIZERS_PARALLELISM": "false"}}
        options = {"address": self.address} if self.address else {"num_cpus": self.workers, "include_dashboard": False,
                                                                   "_temp_dir": self._start_reaper()}
        handlers = _stop_handlers()
        try:
            ray.init(runtime_env=env, logging_level="ERROR", log_to_driver=False, **options)
            _restore_handlers(handlers)  # Ray's own (a stack dump, exit 1) replaced prepare's SIGTERM handler
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise PrepareError(f"--ray-address {self.address}: cannot join the Ray cluster "
                               f"({str(exc).splitlines()[0][:200]}); check the address (ray://HOST:10001 or "
                               f"HOST:6379) and that the cluster runs") from None
        try:
            task = ray.remote(num_cpus=1, max_retries=RAY_RETRIES, retry_exceptions=True)(_ray_task)
            tokenizer = ray.put(tokenizer_json)
            pending = {task.remote(job, tokenizer): job.index for job in jobs}
            self.startup_seconds = time.perf_counter() - started
            while pending:
                (done,), _ = ray.wait(list(pending), num_returns=1)
                index = pending.pop(done)
                try:
                    outcome = ray.get(done)
                except ray.exceptions.RayError as exc:
                    cause = str(exc).strip().splitlines()[-1][:300]
                    raise PrepareError(f"partition {index} failed on Ray, {RAY_RETRIES + 1} attempt(s) ({cause}); "
                                       f"the partitions done are kept: run the same command again") from None
                if "error" in outcome:
                    raise PrepareError(outcome["error"])
                yield outcome["record"]
        finally:
            ray.shutdown()
            self._stop_reaper()

    _reaper = None

    def _start_reaper(self) -> str:
        """A temp dir for a local Ray's session, and the process that ends that session's processes when
        this one ends, however (utils/data/ray_reaper.py); Ray's socket paths must stay short: /tmp/ray-XXXX."""
        import subprocess
        import sys
        import tempfile

        directory = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
        self._reaper = subprocess.Popen([sys.executable, "-m", "utils.data.ray_reaper", directory],
                                        stdin=subprocess.PIPE, cwd=UTILS_PACKAGE.parent, start_new_session=True,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return directory

    def _stop_reaper(self) -> None:
        if self._reaper is not None:
            self._reaper.stdin.close()  # it ends what ray.shutdown() left, removes the temp dir, and exits
            try:
                self._reaper.wait(timeout=10)
            except Exception:  # noqa: BLE001 - it finishes on its own
                pass
            self._reaper = None


def _stop_handlers() -> dict:
    """The Python handlers of the stop signals, where this is the main thread (signal handlers live there)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
            if signal.getsignal(sig) is not None}


def _restore_handlers(handlers: dict) -> None:
    import signal

    for sig, handler in handlers.items():
        signal.signal(sig, handler)


def _check_reachable(address: str, timeout: float = 10.0) -> None:
    """One line at once for a cluster address nothing answers at (Ray itself retries for minutes)."""
    import socket

    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return  # "auto", or a form Ray resolves itself
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as exc:
        raise PrepareError(f"--ray-address {address}: nothing answers there ({exc.strerror or exc}); check the "
                           f"address (ray://HEAD:10001, or HEAD:6379 on a node of the cluster) and that the "
                           f"cluster runs") from None


def _ray_task(job: PartitionJob, tokenizer_json: str) -> dict:
    """Bad input or a full disk comes back as a value, so Ray does not retry it; anything else (a bucket's
    read or write that failed, a bug) raises, and Ray retries the task."""
    try:
        return {"record": tokenize_partition(job, tokenizer_json)}
    except (PrepareError, DiskFullError) as exc:
        return {"error": str(exc)}
