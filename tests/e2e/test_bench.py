"""benchmarks/bench_train.py end to end at its smallest size: the real train.py, the HF Trainer and the bare
loop (and the Trainer at its defaults, `naive`, the engine under FSDP in one process, and the engine with
attention=document) each train the micro model, and the table and JSON carry a positive figure for every one. Not a
timing assertion: the ratios printed here are noise at this size."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.trainkit import REPO_ROOT

# | contender | tokens/s | step ms | MFU (null on the CPU) | peak mem GiB | data wait % | CPU ms/step |
#   optimizer CPU % | Newton-Schulz GFLOP/step/rank | first step s |
ROW = re.compile(r"^\| (engine|trainer|naive|bare|fsdp|document) \| ([\d,]+) \| ([\d.]+) \| null \| ([\d.]+) \| "
                 r"([\d.]+) \| ([\d.]+) \| ([\d.]+|null) \| ([\d.e+-]+|null) \| ([\d.]+) \|$", re.M)


def _micro_newton_schulz_gflop() -> float:
    from configs import get_model_spec
    from utils.model.families import family_of
    from utils.training.optim.muon import newton_schulz_flops

    spec = get_model_spec("micro")
    shapes = family_of(spec).muon_matrices(spec).values()
    return spec.num_hidden_layers * sum(newton_schulz_flops(shape) for shape in shapes) / 1e9


NS_GFLOP = _micro_newton_schulz_gflop()


@pytest.mark.slow
def test_bench_table_has_every_contender(tmp_path, subprocess_env):
    out = tmp_path / "bench.json"
    env = dict(subprocess_env, CUDA_VISIBLE_DEVICES="")  # the CPU path, wherever the suite runs
    cmd = [sys.executable, str(REPO_ROOT / "benchmarks" / "bench_train.py"), "--steps", "4", "--warmup", "2",
           "--repeats", "1", "--slice-s", "0.5", "--json", str(out),
           "--only", "engine,trainer,naive,bare,fsdp,document", "--optimizer", "muon"]
    proc = subprocess.run(cmd, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"

    rows = {m[1]: m for m in ROW.finditer(proc.stdout)}
    assert set(rows) == {"engine", "trainer", "naive", "bare", "fsdp", "document"}, proc.stdout
    for _name, m in rows.items():
        tokens_per_s, step_ms = float(m[2].replace(",", "")), float(m[3])
        assert tokens_per_s > 0 and step_ms > 0, m[0]
        assert abs(tokens_per_s * step_ms / 1e3 - 16 * 32) / (16 * 32) < 0.01, m[0]  # 512 tokens per step
        assert 0 < float(m[9]) < 170, m[0]  # time to first step, from the process start
        if _name in ("trainer", "naive"):  # the Trainer keeps AdamW and is not timed inside
            assert m[7] == m[8] == "null", m[0]
        else:  # the optimizer step's share of the CPU time; Muon's Newton-Schulz on the micro model's one layer
            assert 0 < float(m[7]) < 100 and float(m[8]) == pytest.approx(NS_GFLOP, rel=1e-3), m[0]
    assert re.search(r"^engine/bare: \d+\.\d{3} tokens/s \(median of the per-round ratios", proc.stdout, re.M)
    assert re.search(r"^engine/trainer: \d+\.\d{3} tokens/s", proc.stdout, re.M)
    assert re.search(r"^engine/naive: \d+\.\d{3} tokens/s", proc.stdout, re.M)
    assert re.search(r"^fsdp/engine: \d+\.\d{3} tokens/s", proc.stdout, re.M)
    assert re.search(r"^document/engine: \d+\.\d{3} tokens/s", proc.stdout, re.M)
    assert "micro-batch 16 x accum 1 x seq 32" in proc.stdout and "optimizer muon" in proc.stdout

    summary = json.loads(out.read_text())
    assert summary["settings"]["model"] == "micro" and summary["meta"]["device"].startswith("cpu")
    for name in ("engine", "trainer", "naive", "bare", "fsdp", "document"):
        (run,) = summary["runs"][name]
        assert len(run["windows"]) == 2 and all(w > 0 for w in run["windows"])  # 4 timed steps, windows of 2
        assert run["final_loss"] > 0
    assert summary["median"]["bare"]["data_wait_frac"] == 0.0
    assert 0 < summary["ratios"]["engine/bare"]["paired"] < 10


def test_profile_step_prints_top_operators_and_writes_a_chrome_trace(tmp_path):
    import json
    import subprocess
    import sys

    from tests.trainkit import REPO_ROOT

    trace = tmp_path / "trace.json"
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "profile_step.py"), "--model", "micro",
                           "--micro-batch", "2", "--seq-len", "16", "--warmup", "1", "--steps", "1", "--top", "5",
                           "--out", str(trace)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "tokens/s" in proc.stdout and "aten::" in proc.stdout and "Self CPU" in proc.stdout
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("name") == "train_step" for e in events)


@pytest.mark.slow
def test_bench_threads_prints_every_configuration_alone_and_beside_busy_loops(tmp_path, subprocess_env):
    """benchmarks/bench_threads.py at toy size, pinned to one CPU (so every process it starts is single-threaded):
    the real start_training.sh per configuration, one round of slices alone and beside a busy loop; the table,
    the losses line, each run's thread line and the two checks are printed. Not a timing assertion."""
    out = tmp_path / "threads.json"
    cpu = str(min(__import__("os").sched_getaffinity(0)))
    cmd = [sys.executable, str(REPO_ROOT / "benchmarks" / "bench_threads.py"), "--workloads", "demo",
           "--configs", "one,spin,default", "--rounds", "1", "--slice-s", "0.3", "--busy", "1", "--cpus", cpu,
           "--data-dir", str(tmp_path / "data"), "--set", "model=tiny", "--set", "per_device_train_batch_size=2",
           "--json", str(out)]
    proc = subprocess.run(cmd, env=subprocess_env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"

    # | config | alone tok/s | beside 1 busy loops | beside/alone | vs one, beside (rounds) | vs spin, alone (rounds) |
    rows = dict(re.findall(r"^\| (one|spin|default) \| ([\d,]+ \| [\d,]+ \| [\d.]+ \| [\d.]+ \([\d. ]+\) \| "
                           r"[\d.]+ \([\d. ]+\)) \|$", proc.stdout, re.M))
    assert set(rows) == {"one", "spin", "default"}, proc.stdout
    assert rows["one"].split(" | ")[3] == "1.00 (1.00)" and rows["spin"].split(" | ")[4] == "1.00 (1.00)"
    assert "1 thread(s): one, spin, default: losses identical at the" in proc.stdout
    assert "default: cpu threads: 1 per process (start_training.sh: 1 core(s) / 1 process(es) per node)" in proc.stdout
    assert "one: cpu threads: 1 per process (OMP_NUM_THREADS=1, yours)" in proc.stdout
    assert re.search(r"^demo: default beside 1 busy loops / one thread beside them: [\d.]+x .*must be >= 0\.8$",
                     proc.stdout, re.M)
    assert re.search(r"^demo: default alone / 1 spinning threads alone: [\d.]+x .*must be >= 0\.9$", proc.stdout, re.M)
    assert "on libgomp" in proc.stdout

    summary = json.loads(out.read_text())
    slices = summary["results"]["demo"]["slices"]
    for name in ("one", "spin", "default"):
        for scenario in ("alone", "busy"):
            (s,) = slices[name][scenario]
            assert s["tokens_per_s"] > 0 and s["rows"] and all(r["tokens"] > 0 for r in s["rows"])
        assert slices[name]["alone"][0]["loop_cores"] < 0.05 < slices[name]["busy"][0]["loop_cores"]  # frozen, running
    assert 0 < summary["checks"]["default_vs_one_busy"] < 10
