#!/usr/bin/env python
"""CPU threads: how fast a CPU run trains with each thread count and wait policy, alone and beside busy loops.

    python benchmarks/bench_threads.py                                  # demo, cpu and a 2-rank gloo run
    python benchmarks/bench_threads.py --workloads demo --rounds 5      # the demo only
    python benchmarks/bench_threads.py --configs one,spin,default,s10k=OMP_NUM_THREADS={T}+GOMP_SPINCOUNT=10000

Each workload is the real `./start_training.sh --config PRESET --cpu --gpus P` (the README's command), once per
configuration: the environment the launcher and the ranks start with (`--configs`, below; `{T}` is the launcher's
thread count before this benchmark existed, cores / processes). Every configuration's run is started, trained to
its first metrics row, then frozen (SIGSTOP to its whole process tree); then, round after round, each is let run
in turn for one slice (`--slice-s` seconds of measured steps after one settling row) while the others stay frozen,
once alone and once beside `--busy` busy loops (Python `while True: pass`, frozen too while a run is alone). So
every configuration meets the same machine within seconds of the others: on a machine other people load, the
paired ratios (a configuration against `one` or `spin` in the same round and scenario) are the figures to read;
the medians over rounds are printed with each round's ratio. The settling row after a thaw is left out: it spans
the freeze, and a policy that watches the machine has seen a stale one.

Printed per workload: tokens/s alone and beside the loops (medians of the rounds' slices), beside/alone, each
configuration against `one` beside the loops and against `spin` alone (median of the per-round ratios, the
rounds' ratios after it), the thread count the run said it chose and its final loss row. At the end the two
checks of issue 51 on the demo: `default` beside the loops against `one` beside them (>= 0.8), `default` alone
against `spin` alone (>= 0.9); and the load other programs put on the machine while the runs were alone
(cores busy outside this benchmark's processes, from /proc/stat, median over the alone slices).

Configurations (`--configs`: names below, or NAME=VAR=VALUE+VAR=VALUE for another):
  one       OMP_NUM_THREADS=1
  spin      OMP_NUM_THREADS={T} OMP_WAIT_POLICY=ACTIVE (threads spin while they wait)
  passive   OMP_NUM_THREADS={T} OMP_WAIT_POLICY=PASSIVE (threads sleep at once)
  before    OMP_NUM_THREADS={T} GOMP_SPINCOUNT=300000 (libgomp's own default wait, set by the user, which turns the
            core sharing off: what runs got before issue 51)
  default   nothing set: the engine's own choice (utils/runtime/threads.py: the same 300,000 spins while the cores
            are free; utils/runtime/cpu_share.py: fewer cores and libgomp's throttled wait while others use them)

`--cpus 0` pins the benchmark and everything it starts to those CPUs (the cores then counted; the test runs it
on one). `--json OUT` writes every slice. Linux only (/proc, SIGSTOP).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
BIG = 10**9  # eval_interval / save_steps that never fire inside the run
THREAD_VARS = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "MKL_NUM_THREADS", "NEOX_CPU_THREADS")
CONFIGS = {
    "one": {"OMP_NUM_THREADS": "1"},
    "spin": {"OMP_NUM_THREADS": "{T}", "OMP_WAIT_POLICY": "ACTIVE"},
    "passive": {"OMP_NUM_THREADS": "{T}", "OMP_WAIT_POLICY": "PASSIVE"},
    "before": {"OMP_NUM_THREADS": "{T}", "GOMP_SPINCOUNT": "300000"},
    "default": {},
}
WORKLOADS = {"demo": ("demo", 1), "cpu": ("cpu", 1), "gloo2": ("demo", 2)}  # name: (preset, processes)
SCENARIOS = ("alone", "busy")
HZ = os.sysconf("SC_CLK_TCK")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="demo,cpu,gloo2", help=f"comma-separated: {', '.join(WORKLOADS)}")
    p.add_argument("--configs", default="one,spin,passive,before,default",
                   help="comma-separated configuration names, or NAME=VAR=VALUE+VAR=VALUE")
    p.add_argument("--busy", type=int, default=2, help="busy loops beside the runs in the `busy` scenario")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--slice-s", type=float, default=4.0, help="seconds of measured steps per slice")
    p.add_argument("--logging-steps", type=int, default=2, help="steps per metrics row (a row is a window)")
    p.add_argument("--data-dir", type=Path, help="the demo's data (built here by the first run when missing; "
                                                  "default: a temporary folder)")
    p.add_argument("--cpu-data", type=Path, help="a prepared dataset for the cpu workload (default: the demo's "
                                                  "corpus; benchmarks/make_text_corpus.py makes one)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="passed to every run")
    p.add_argument("--cpus", help="pin to these CPUs (e.g. 0 or 0-1): sched_setaffinity, inherited by every run")
    p.add_argument("--quiet-below", type=float, help="measure a slice again while other programs use more than "
                                                      "this many cores (default: take what comes)")
    p.add_argument("--quiet-wait-s", type=float, default=120, help="how long a slice may wait for --quiet-below")
    p.add_argument("--timeout", type=float, default=600, help="seconds a run may take to write its next row")
    p.add_argument("--json", type=Path, help="write every slice here")
    args = p.parse_args(argv)
    unknown = [w for w in args.workloads.split(",") if w not in WORKLOADS]
    if unknown:
        p.error(f"--workloads: unknown {', '.join(unknown)} (one of {', '.join(WORKLOADS)})")
    args.configs = dict(parse_config(p, c) for c in args.configs.split(","))
    if "one" not in args.configs or "spin" not in args.configs:
        p.error("--configs must hold one and spin: the ratios are against them")
    return args


def parse_config(p, text: str) -> tuple[str, dict]:
    if "=" not in text:
        if text not in CONFIGS:
            p.error(f"--configs: unknown {text!r} (one of {', '.join(CONFIGS)}, or NAME=VAR=VALUE+...)")
        return text, CONFIGS[text]
    name, _, assignments = text.partition("=")
    env = dict(a.split("=", 1) for a in assignments.split("+") if "=" in a)
    if not name or not env:
        p.error(f"--configs: {text!r} is not NAME=VAR=VALUE+VAR=VALUE")
    return name, env


# ----------------------------------------------------------------------------------------------- processes
def parent_map() -> dict[int, int]:
    """pid -> parent pid of every process now."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat[stat.rindex(")") + 2:].split()[1])
    return parents


def process_tree(root: int) -> list[int]:
    """`root` and every process below it."""
    parents, tree = parent_map(), [root]
    for pid in tree:
        tree.extend(child for child, parent in parents.items() if parent == pid)
    return tree


def cpu_ticks(pids) -> int:
    """User + system clock ticks the processes have used (their own, not their waited-for children's)."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total


def machine_busy_ticks() -> int:
    """Clock ticks every CPU has spent not idle (/proc/stat's first line, less idle and iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
    return sum(fields) - fields[3] - fields[4]


def signal_tree(pids, sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


class Run:
    """One configuration's start_training.sh, frozen between its slices; its metrics rows as they come."""

    def __init__(self, workload: str, name: str, env: dict, cmd: list, out: Path):
        self.workload, self.name, self.out = workload, name, out
        self.log = open(out.with_suffix(".log"), "w")  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.metrics = out / "logs" / "metrics.jsonl"
        self.rows: list[dict] = []
        self._read = 0

    def new_rows(self) -> list[dict]:
        try:
            with open(self.metrics) as f:
                f.seek(self._read)
                text = f.read()
        except FileNotFoundError:
            return []
        complete = text[:text.rfind("\n") + 1]
        self._read += len(complete)
        rows = [r for r in map(json.loads, complete.splitlines()) if "loss" in r]
        self.rows += rows
        return rows

    def wait_rows(self, count: int, timeout: float) -> list[dict]:
        got, deadline = [], time.monotonic() + timeout
        while len(got) < count:
            got += self.new_rows()
            if len(got) >= count:
                break
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.workload}/{self.name}: start_training.sh exited {self.proc.returncode}:\n"
                                 + self.tail())
            if time.monotonic() > deadline:
                raise SystemExit(f"{self.workload}/{self.name}: no metrics row in {timeout:.0f} s:\n" + self.tail())
            time.sleep(0.02)
        return got

    def tail(self) -> str:
        self.log.flush()
        return "".join(open(self.log.name).readlines()[-30:])

    def threads_line(self) -> str:
        return next((line.strip() for line in open(self.log.name) if "cpu threads:" in line), "(not said)")

    def freeze(self) -> None:
        signal_tree(process_tree(self.proc.pid), signal.SIGSTOP)

    def thaw(self) -> None:
        signal_tree(process_tree(self.proc.pid), signal.SIGCONT)

    def stop(self) -> None:
        """SIGTERM, as a scheduler stops a run: a checkpoint, exit 0; SIGKILL to the tree if it will not."""
        tree = process_tree(self.proc.pid)
        signal_tree(tree, signal.SIGCONT)
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            signal_tree(process_tree(self.proc.pid) + tree, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


class BusyLoops:
    """The other programs of the `busy` scenario: `count` Python busy loops, frozen while the runs are alone."""

    def __init__(self, count: int):
        # each in a session of its own, as independent programs are: with the kernel's autogroup scheduling (on by
        # default) each session shares the cores as one, so loops in one session would hold only one core's worth
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
                      for _ in range(count)]
        self.freeze()

    def freeze(self):
        signal_tree([p.pid for p in self.procs], signal.SIGSTOP)

    def thaw(self):
        signal_tree([p.pid for p in self.procs], signal.SIGCONT)

    def ticks(self) -> int:
        return cpu_ticks(p.pid for p in self.procs)

    def close(self):
        for p in self.procs:
            p.kill()
            p.wait()


# ----------------------------------------------------------------------------------------------- measuring
def measure_slice(run: Run, loops: BusyLoops, slice_s: float, timeout: float) -> dict:
    """Thaw the run, let one row settle, then rows until `slice_s` seconds of steps; freeze it again. Also the
    cores the run, the busy loops and everything else on the machine used meanwhile."""
    run.new_rows()  # rows written before the freeze: stale
    thawed = time.time()
    run.thaw()
    settle = None
    while settle is None:  # the first row written after the thaw (its window spans the freeze: left out)
        settle = next((row for row in run.wait_rows(1, timeout) if row["time"] >= thawed), None)
    ticks0, t0 = (cpu_ticks(process_tree(run.proc.pid)), loops.ticks(), machine_busy_ticks()), time.monotonic()
    rows, last = [], settle
    while sum(r["seconds"] for r in rows) < slice_s:
        for row in run.wait_rows(1, timeout):
            rows.append({"tokens": row["tokens"] - last["tokens"], "seconds": row["time"] - last["time"]})
            last = row
    ticks1, t1 = (cpu_ticks(process_tree(run.proc.pid)), loops.ticks(), machine_busy_ticks()), time.monotonic()
    run.freeze()
    run_cores, loop_cores, machine = ((b - a) / HZ / (t1 - t0) for a, b in zip(ticks0, ticks1))
    tokens, seconds = sum(r["tokens"] for r in rows), sum(r["seconds"] for r in rows)
    return {"tokens_per_s": tokens / seconds if seconds > 0 else 0.0, "rows": rows, "run_cores": run_cores,
            "loop_cores": loop_cores, "others_cores": max(0.0, machine - run_cores - loop_cores)}


def quiet_slice(run: Run, loops: BusyLoops, args) -> dict:
    """measure_slice, again (after a pause) while other programs used more than --quiet-below cores, for at
    most --quiet-wait-s; the slice then keeps what it met (`quiet`: False)."""
    deadline = time.monotonic() + args.quiet_wait_s
    while True:
        s = measure_slice(run, loops, args.slice_s, args.timeout)
        s["quiet"] = args.quiet_below is None or s["others_cores"] <= args.quiet_below
        if s["quiet"] or time.monotonic() > deadline:
            return s
        time.sleep(min(5.0, max(0.0, deadline - time.monotonic())))


def run_workload(workload: str, args, base_env: dict, cores: int, work: Path, loops: BusyLoops) -> dict:
    preset, processes = WORKLOADS[workload]
    threads = max(1, cores // processes)
    runs = []
    for name, config in args.configs.items():
        env = dict(base_env, **{k: v.replace("{T}", str(threads)) for k, v in config.items()})
        out = work / f"{workload}-{name}"
        cmd = ["bash", str(REPO_ROOT / "start_training.sh"), "--config", preset, "--cpu", "--gpus", str(processes),
               "--max-steps", str(BIG), "--set", f"logging_steps={args.logging_steps}",
               "--set", f"eval_interval={BIG}", "--set", f"save_steps={BIG}", "--set", "sample_every=0",
               "--set", f"data_dir={args.cpu_data if workload == 'cpu' and args.cpu_data else args.data_dir}"]
        if workload == "cpu" and not args.cpu_data:
            cmd += ["--set", "demo_data=true"]  # the cpu preset on the demo's corpus: the same model and batch
        for kv in args.set:
            cmd += ["--set", kv]
        cmd += ["--", "--output-dir", str(out)]
        chosen = " ".join(f"{k}={v}" for k, v in env.items() if k in THREAD_VARS) or "nothing set"
        print(f"  {workload}/{name}: starting ({chosen})", flush=True)
        run = Run(workload, name, env, cmd, out)
        runs.append(run)
        run.wait_rows(1, args.timeout)  # the first row: start-up and the first steps, never measured
        run.freeze()
    slices = {run.name: {s: [] for s in SCENARIOS} for run in runs}
    try:
        for r in range(args.rounds):
            order = runs[r % len(runs):] + runs[:r % len(runs)]
            for scenario in (SCENARIOS if r % 2 == 0 else SCENARIOS[::-1]):
                (loops.thaw if scenario == "busy" else loops.freeze)()
                for run in order:
                    s = quiet_slice(run, loops, args)
                    s["round"] = r
                    slices[run.name][scenario].append(s)
                    print(f"  {workload} round {r + 1}/{args.rounds} {scenario:5s} {run.name:>10s}: "
                          f"{s['tokens_per_s']:8,.0f} tokens/s (cores: run {s['run_cores']:.2f}, busy loops "
                          f"{s['loop_cores']:.2f}, other programs {s['others_cores']:.2f})", flush=True)
                loops.freeze()
    finally:
        loops.freeze()
        said = {run.name: run.threads_line() for run in runs}
        losses = {run.name: {row["step"]: row["loss"] for row in run.rows} for run in runs}
        for run in runs:
            run.stop()
    return {"threads": threads, "processes": processes, "preset": preset, "slices": slices, "said": said,
            "losses": losses}


def paired(slices: dict, name: str, ref: str, scenario: str) -> tuple[float, list[float]]:
    """Median over rounds of name's tokens/s over ref's in the same round and scenario, and each round's."""
    ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(slices[name][scenario], slices[ref][scenario])
              if b["tokens_per_s"] > 0]
    return (statistics.median(ratios) if ratios else float("nan")), ratios


def median_of(slices: list, key: str) -> float:
    return statistics.median(s[key] for s in slices) if slices else float("nan")


def same_losses(result: dict, configs: dict) -> list[str]:
    """Which configurations' losses agree bit for bit at the steps they both logged, grouped by thread count."""
    by_threads: dict[str, list[str]] = {}
    for name, config in configs.items():
        count = config.get("OMP_NUM_THREADS", "{T}").replace("{T}", str(result["threads"]))
        by_threads.setdefault(count, []).append(name)
    lines = []
    for count, names in sorted(by_threads.items()):
        ref = result["losses"][names[0]]
        common = [step for step in ref if all(step in result["losses"][n] for n in names)]
        agree = all(result["losses"][n][step] == ref[step] for n in names for step in common)
        lines.append(f"{count} thread(s): {', '.join(names)}: losses {'identical' if agree else 'DIFFERENT'} at "
                     f"the {len(common)} step(s) all of them logged")
    return lines


def render(workload: str, result: dict, args) -> str:
    slices, busy = result["slices"], args.busy
    lines = [f"\n### {workload}: `start_training.sh --config {result['preset']} --cpu --gpus {result['processes']}` "
             f"({result['threads']} thread(s) per process = {{T}})\n",
             f"| config | alone tokens/s | beside {busy} busy loops | beside/alone | vs one, beside the loops "
             f"(rounds) | vs spin, alone (rounds) |", "|---|---:|---:|---:|---:|---:|"]
    def rounds(ratios):
        return " ".join(f"{x:.2f}" for x in ratios)

    for name in slices:
        alone = median_of(slices[name]["alone"], "tokens_per_s")
        shared = median_of(slices[name]["busy"], "tokens_per_s")
        vs_one, one_r = paired(slices, name, "one", "busy")
        vs_spin, spin_r = paired(slices, name, "spin", "alone")
        lines.append(f"| {name} | {alone:,.0f} | {shared:,.0f} | {shared / alone:.2f} | {vs_one:.2f} "
                     f"({rounds(one_r)}) | {vs_spin:.2f} ({rounds(spin_r)}) |")
    every = [s for per in slices.values() for s in per["alone"]]
    shared = [s for per in slices.values() for s in per["busy"]]
    lines.append(f"\nOther programs on the machine (cores, median over slices): {median_of(every, 'others_cores'):.2f} "
                 f"while the runs were alone, {median_of(shared, 'others_cores'):.2f} beside the busy loops (which "
                 f"used {median_of(shared, 'loop_cores'):.2f}); {sum(not s['quiet'] for s in every + shared)} of "
                 f"{len(every + shared)} slice(s) over --quiet-below")
    lines += same_losses(result, args.configs)
    lines += [f"{name}: {said}" for name, said in result["said"].items()]
    return "\n".join(lines)


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def machine_versions() -> str:
    """torch's version and the OpenMP runtime it loaded (the library mapped into this process)."""
    import torch  # here, for the record only: the runs are other processes

    torch.ones(2).sum()
    maps = Path("/proc/self/maps").read_text()
    runtime = next((name for name in ("libgomp", "libiomp5", "libomp") if f"/{name}" in maps), "no OpenMP runtime")
    return f"torch {torch.__version__} on {runtime}"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.cpus:
        wanted = set()
        for part in args.cpus.split(","):
            lo, _, hi = part.partition("-")
            wanted.update(range(int(lo), int(hi or lo) + 1))
        os.sched_setaffinity(0, wanted)
    cores = len(os.sched_getaffinity(0))
    work = Path(tempfile.mkdtemp(prefix="bench-threads-"))
    args.data_dir = (args.data_dir or work / "data").resolve()
    base_env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}
    base_env.update(PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", CUDA_VISIBLE_DEVICES="")
    started, load0 = time.time(), os.getloadavg()
    print(f"bench_threads: {cores} core(s), workloads {args.workloads}, configs {', '.join(args.configs)}, "
          f"{args.rounds} round(s) of {args.slice_s:g} s slices, {args.busy} busy loop(s); load average "
          f"{load0[0]:.2f} at the start", flush=True)
    loops = BusyLoops(args.busy)
    results = {}
    try:
        for workload in args.workloads.split(","):
            results[workload] = run_workload(workload, args, base_env, cores, work, loops)
            print(render(workload, results[workload], args), flush=True)
    finally:
        loops.close()
        shutil.rmtree(work, ignore_errors=True)

    checks = {}
    if "demo" in results and "default" in results["demo"]["slices"]:
        demo = results["demo"]
        shared, shared_r = paired(demo["slices"], "default", "one", "busy")
        alone, alone_r = paired(demo["slices"], "default", "spin", "alone")
        checks = {"default_vs_one_busy": shared, "default_vs_spin_alone": alone}
        print(f"\ndemo: default beside {args.busy} busy loops / one thread beside them: {shared:.2f}x (rounds "
              f"{' '.join(f'{x:.2f}' for x in shared_r)}); must be >= 0.8")
        print(f"demo: default alone / {demo['threads']} spinning threads alone: {alone:.2f}x (rounds "
              f"{' '.join(f'{x:.2f}' for x in alone_r)}); must be >= 0.9")
    load1 = os.getloadavg()
    print(f"load average {load0[0]:.2f} at the start, {load1[0]:.2f} at the end; {time.time() - started:.0f} s")
    print(f"{platform.node()}, {cpu_model()}, {os.cpu_count()} CPUs, {machine_versions()}, {date.today()}; "
          f"{' '.join(sys.argv)}")
    if args.json:
        args.json.write_text(json.dumps({"cores": cores, "busy": args.busy, "checks": checks,
                                         "configs": args.configs, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
