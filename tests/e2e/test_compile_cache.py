"""A restart on a new machine: the compiled code travels with the checkpoint (utils/checkpoint/compile_cache.py).

One compiled run (the tiny model, compile on, checkpoints uploaded to a GCS emulator) is reused by each check:
a resume from the bucket into an empty folder with an empty Inductor cache loads its compiled code, compiles
nothing and continues its losses; a byte flipped in the bucket's copy is one line and a normal compile. The
checks of every other mismatch (another torch, model, device, secret; names leaving the cache) compile nothing
and are in tests/unit/checkpoint/test_compile_cache.py.
"""
from __future__ import annotations

import json
import math
import re

import pytest

from tests.conftest import Emulator, make_subprocess_env
from tests.trainkit import make_shards, run, train_cmd, train_rows
from utils.checkpoint import compile_cache as cc
from utils.checkpoint.format import COMPILE_CACHE_FILE, MANIFEST

SECRET = "the-runs-secret-0123456789"
SETS = ("compile_model=true", "max_steps=4", "save_steps=2", "init=hf")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """The uninterrupted compiled run: 4 steps, checkpoints at 2 and 4 uploaded to the emulator's bucket."""
    emu = Emulator()
    tmp = tmp_path_factory.mktemp("compile-cache")
    env = make_subprocess_env() | {"STORAGE_EMULATOR_HOST": emu.url, cc.KEY_ENV: SECRET,
                                   "TORCHINDUCTOR_CACHE_DIR": str(tmp / "inductor-first")}
    env.pop("GOOGLE_APPLICATION_CREDENTIALS", None)
    data = make_shards(tmp / "data")
    out = tmp / "first"
    proc = run(train_cmd(out, data, *SETS, f"gcs_bucket={emu.bucket}"), env, timeout=900)
    step2 = next((out / "checkpoints").glob("checkpoint-epoch0-step2-*"))
    yield {"emu": emu, "tmp": tmp, "env": env, "data": data, "out": out, "proc": proc, "step2": step2,
           "url": f"gs://{emu.bucket}/checkpoints/demo/{step2.name}"}
    emu.stop()


def resume(compiled, name: str, inductor: str):
    """--resume from the bucket into an empty output folder, with the Inductor cache folder `inductor`."""
    out = compiled["tmp"] / name
    env = compiled["env"] | {"TORCHINDUCTOR_CACHE_DIR": str(compiled["tmp"] / inductor)}
    proc = run(train_cmd(out, compiled["data"], *SETS, f"gcs_bucket={compiled['emu'].bucket}", f"run_name={name}",
                         extra=("--resume", compiled["url"])), env, timeout=600)
    return out, proc


def assert_losses_continue(compiled, out) -> None:
    first, resumed = train_rows(compiled["out"]), train_rows(out)
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        assert math.isclose(resumed[step]["loss"], first[step]["loss"], rel_tol=1e-6), (step, resumed, first)


def test_a_restart_on_an_empty_machine_loads_the_compiled_code_from_the_bucket(compiled):
    first_row = train_rows(compiled["out"])[1]
    assert compiled["step2"].joinpath(COMPILE_CACHE_FILE).is_file()
    assert COMPILE_CACHE_FILE in json.loads(compiled["step2"].joinpath(MANIFEST).read_text())["files"]

    out, proc = resume(compiled, "empty-machine", "inductor-empty")
    loaded = re.search(r"compile cache: loaded from (\S+) \((.*)\)", proc.stdout)
    assert loaded and loaded[1] == compiled["step2"].name and "signature verified" in loaded[2], proc.stdout[-3000:]
    assert_losses_continue(compiled, out)

    # nothing was compiled: every graph torch looked up and every kernel library it loaded is one the file holds
    blob = (out / "checkpoints" / compiled["step2"].name / COMPILE_CACHE_FILE).read_bytes()
    _, entries = cc._unpack(blob, "test")
    graphs = {a.key for a in cc.torch_artifacts(entries[cc.TORCH_ENTRY])["inductor"]}
    kernels = {name[len(cc.KERNEL_PREFIX):] for name in entries if name.startswith(cc.KERNEL_PREFIX)}
    cache = compiled["tmp"] / "inductor-empty"
    assert {p.parent.name for p in (cache / "fxgraph").rglob("*") if p.is_file()} == graphs
    assert {p.relative_to(cache).as_posix() for p in cache.glob("*/*.so")} == kernels
    row = train_rows(out)[3]
    assert row["start/compile_cache_s"] >= 0 and row["start/compile_s"] < 0.5 * first_row["start/compile_s"], (
        row, first_row)
    assert math.isclose(row["first_step_s"], sum(v for k, v in row.items() if k.startswith("start/")), rel_tol=0.01)
    # its own checkpoints carry all of it on, for the next machine (saved after step 3, and again after the
    # evaluation at step 4 compiled its graphs: two chunks of torch's artifacts, every one loaded)
    step4 = next((out / "checkpoints").glob("checkpoint-epoch0-step4-*"))
    assert COMPILE_CACHE_FILE in json.loads((step4 / MANIFEST).read_text())["files"]
    _, carried = cc._unpack((step4 / COMPILE_CACHE_FILE).read_bytes(), "test")
    assert {a.key for a in cc.torch_artifacts(carried[cc.TORCH_ENTRY])["inductor"]} == graphs
    assert {name for name in carried if name.startswith(cc.KERNEL_PREFIX)} == {cc.KERNEL_PREFIX + k for k in kernels}


def test_a_flipped_byte_in_the_buckets_copy_is_one_line_and_a_normal_compile(compiled, monkeypatch):
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", compiled["emu"].url)
    client = compiled["emu"].client()
    blob = client.bucket(compiled["emu"].bucket).blob(f"checkpoints/demo/{compiled['step2'].name}/{COMPILE_CACHE_FILE}")
    data = bytearray(blob.download_as_bytes())
    data[len(data) // 2] ^= 0x10
    blob.upload_from_string(bytes(data))

    out, proc = resume(compiled, "flipped", "inductor-first")  # this machine's own cache: the compile is quick
    said = [line for line in proc.stdout.splitlines() if line.startswith("compile cache: ")]
    assert len(said) == 1 and "does not match its manifest entry" in said[0], said
    assert said[0].endswith("it is corrupt; compiling") and "Traceback" not in proc.stderr
    assert_losses_continue(compiled, out)
