"""Weighted data mixtures: the realised shares counted from the batches, resume (bitwise, with changed
weights, an added source), epochs caps, refusals, config parsing; end to end through train.py (slow)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from configs.model_config import ConfigError
from configs.training_config import get_training_config, parse_overrides, read_config_file
from utils.data.dataset import TokenSequenceDataset
from utils.data.dataset_info import DatasetInfo
from utils.data.index import ShardIndex
from utils.data.loader import EvalBatches, Readers, ResumableLoader
from utils.data.mixture import DEFAULT_SOURCE, MixtureError, MixturePlan, check_tokenizers
from utils.data.source import Source
from utils.errors import UserError

SEQ = 4
VOCAB = 4096
OFFSET = {"web": 0, "code": 1000, "books": 2000}  # sequence g of a source is SEQ copies of OFFSET + g


def quiet(*_args):
    pass


def make_source(root: Path, name: str, count: int, files: int = 2) -> TokenSequenceDataset:
    """`count` sequences in `files` shards; every token of sequence g is OFFSET[name] + g."""
    per = -(-count // files)
    for f in range(files):
        ids = np.arange(f * per, min(count, (f + 1) * per)) + OFFSET[name]
        path = root / name / f"{f:02d}.npz"
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path, input_ids=np.repeat(ids[:, None], SEQ, axis=1).astype(np.uint16))
    return TokenSequenceDataset(ShardIndex.build(root / name, SEQ, VOCAB, log=quiet))


def who(batch: torch.Tensor) -> list[tuple[str, int]]:
    """(source, sequence number) of every row, read from the tokens themselves."""
    assert torch.equal(batch, batch[:, :1].expand_as(batch))
    out = []
    for token in batch[:, 0].tolist():
        name = max((n for n in OFFSET if OFFSET[n] <= token), key=OFFSET.get)
        out.append((name, token - OFFSET[name]))
    return out


def steps(loaders: list[ResumableLoader], count: int, accumulation: int = 1) -> list[list[tuple[str, int]]]:
    """`count` optimizer steps of one loader per rank: each step's global batch, as (source, seq) pairs."""
    out = []
    for _ in range(count):
        batch = []
        for _ in range(accumulation):
            for loader in loaders:
                batch += who(next(loader))
        out.append(batch)
    return out


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    return {"web": make_source(root, "web", 400), "code": make_source(root, "code", 300),
            "books": make_source(root, "books", 12)}


def mixture(sources, weights: dict, micro=4, rank=0, world=1, seed=3, epochs=None, num_workers=0, prefetch_factor=2,
            **kw) -> ResumableLoader:
    mix = [Source(n, w, (epochs or {}).get(n), data=sources[n]) for n, w in weights.items()]
    return ResumableLoader(mix, micro, rank, world, seed, readers=Readers(num_workers, prefetch_factor), **kw)


def share(batches, name="web") -> float:
    flat = [s for b in batches for s, _ in b]
    return flat.count(name) / len(flat)


def test_realised_share_and_token_counts(sources):
    loader = mixture(sources, {"web": 0.75, "code": 0.25}, micro=2)
    batches, tokens = [], []
    for _ in range(100):  # global batch 4: 2 micro-batches of 2 per step
        batches += steps([loader], 1, accumulation=2)
        tokens.append(loader.source_tokens())
    assert abs(share(batches) - 0.75) <= 0.01
    for first in range(0, 81):
        assert abs(share(batches[first:first + 20]) - 0.75) <= 0.05, first
    for k, row in enumerate(tokens, 1):  # tokens/<name> == the count from the batches, exactly, at every step
        flat = [s for b in batches[:k] for s, _ in b]
        assert row == {"tokens/web": flat.count("web") * SEQ, "tokens/code": flat.count("code") * SEQ}
    seen = [x for b in batches for x in b if x[0] == "web"]
    assert len(seen) == len(set(seen)) == 300  # one permutation of web's 400: no repeat within the epoch
    assert loader.files_consumed() == 1  # web: 300 of 2 files of 200; code: 100 of 2 files of 150


def test_plan_is_chunking_free_and_low_discrepancy():
    """However the stream is cut into batches it is the same; every source's count stays within 1.5
    sequences of weight * position, so any window of L sequences is within 3 of weight * L."""
    rng = np.random.default_rng(0)
    for _ in range(20):
        w = rng.random(rng.integers(2, 6))
        w /= w.sum()
        specs = [Source(f"s{i}", float(x), data=range(10**9)) for i, x in enumerate(w)]
        chunked = MixturePlan(specs)
        src = np.concatenate([chunked.take(int(n))[0] for n in rng.integers(1, 40, size=200)])
        assert (MixturePlan(specs).take(len(src))[0] == src).all()
        counts = np.vstack([np.zeros(len(w)), np.cumsum(src[:, None] == np.arange(len(w)), axis=0)])
        assert np.abs(counts - np.arange(len(src) + 1)[:, None] * w).max() <= 1.5


@pytest.mark.parametrize("world,micro,accumulation", [(2, 4, 1), (4, 1, 2), (1, 2, 4)])
def test_same_stream_for_any_world_size_and_micro_batch(sources, world, micro, accumulation):
    weights = {"web": 0.6, "code": 0.3, "books": 0.1}
    reference = steps([mixture(sources, weights, micro=8)], 30)
    ranks = [mixture(sources, weights, micro=micro, rank=r, world=world) for r in range(world)]
    got = steps(ranks, 30, accumulation)
    assert [sorted(b) for b in got] == [sorted(b) for b in reference]  # the same global batches, step by step
    for r in range(world):  # ranks read disjoint shares
        mine = {x for _ in range(5) for x in who(next(ranks[r]))}
        others = {x for o in range(world) if o != r for _ in range(5) for x in who(next(ranks[o]))}
        assert not mine & others


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_continues_exactly(sources, workers):
    """Cursors saved before and after books reaches its 1-epoch cap both continue the straight stream."""
    weights, cap = {"web": 0.5, "code": 0.3, "books": 0.2}, {"books": 1}
    opened = [mixture(sources, weights, num_workers=workers, prefetch_factor=4, epochs=cap)]
    try:  # a failed assert must not leave worker processes behind (pytest would wait for them at exit)
        straight = opened[0]
        steps([straight], 7)
        before_drop = straight.state_dict()
        expected = steps([straight], 20)
        after_drop = straight.state_dict()
        assert after_drop["sources"]["books"]["consumed"] == 12 and after_drop["phase_weights"]["books"] == 0.0
        expected_tail = steps([straight], 5)
        for state, want in ((before_drop, expected), (after_drop, expected_tail)):
            resumed = mixture(sources, weights, seed=999, num_workers=workers, epochs=cap)
            opened.append(resumed)
            resumed.load_state_dict(state)
            assert steps([resumed], len(want)) == want and resumed.seed == 3
        assert resumed.state_dict() == straight.state_dict()
    finally:
        for loader in opened:
            loader.close()


def test_weights_changed_on_resume(sources):
    first = mixture(sources, {"web": 0.75, "code": 0.25})
    early = steps([first], 10)
    logged = []
    resumed = mixture(sources, {"web": 0.25, "code": 0.75}, log=logged.append)
    resumed.load_state_dict(first.state_dict())
    later = steps([resumed], 40)
    assert abs(share(later) - 0.25) <= 0.02
    assert any("web 0.75 -> 0.25, code 0.25 -> 0.75" in line for line in logged), logged
    # each source continued its permutation: none of the first 10 steps' sequences comes again (no epoch ends)
    assert not {x for b in early for x in b} & {x for b in later for x in b}
    web_before = [i for b in early for s, i in b if s == "web"]
    web_after = [i for b in later for s, i in b if s == "web"]
    continuous = mixture(sources, {"web": 1.0, "code": 0.0})
    web_alone = [i for b in steps([continuous], (len(web_before) + len(web_after)) // 4 + 1) for _, i in b]
    assert (web_before + web_after) == web_alone[:len(web_before) + len(web_after)]


def test_added_source_and_legacy_cursor(sources):
    single = ResumableLoader(sources["web"], 4, 0, 1, seed=3)  # a data_dir run: the source `data`
    early = steps([single], 5)
    legacy = single.state_dict()
    assert set(legacy) == {"position", "epoch", "consumed_in_epoch", "seed", "num_samples", "global_batch"}
    logged = []
    grown = ResumableLoader([Source(DEFAULT_SOURCE, 0.5, data=sources["web"]),
                             Source("code", 0.5, data=sources["code"])], 4, 0, 1, seed=3, log=logged.append)
    grown.load_state_dict(legacy)
    later = steps([grown], 10)
    assert "added code 0.5" in logged[0] and "data 1 -> 0.5" in logged[0]
    assert abs(share(later, "code") - 0.5) <= 0.01
    data_after = [i for b in later for s, i in b if s == "web"]
    alone = [i for b in steps([single], 10) for _, i in b]  # `data` keeps its own permutation
    assert data_after == alone[:len(data_after)]
    assert not {i for b in early for _, i in b} & set(data_after)


def test_refusals_are_one_line(sources, tmp_path):
    saved = mixture(sources, {"web": 0.5, "code": 0.5})
    steps([saved], 3)
    state = saved.state_dict()
    with pytest.raises(MixtureError, match=r"none of the checkpoint's sources \(web, code\) is in") as e:
        mixture(sources, {"books": 1.0}).load_state_dict(state)  # dropping some is allowed, all is not
    assert "\n" not in str(e.value) and isinstance(e.value, UserError)
    smaller = make_source(tmp_path, "code", 299)
    with pytest.raises(MixtureError, match="data changed since the checkpoint: source code's cursor was saved "
                                           "over 300 sequences but .* now has 299"):
        ResumableLoader([Source("web", 0.5, data=sources["web"]), Source("code", 0.5, data=smaller)],
                        4, 0, 1, 3).load_state_dict(state)
    with pytest.raises(MixtureError, match="seq_len=8 but this run has seq_len=4"):
        mixture(sources, {"web": 0.5, "code": 0.5}).load_state_dict(dict(state, seq_len=8))
    with pytest.raises(ValueError, match="malformed"):
        mixture(sources, {"web": 0.5, "code": 0.5}).load_state_dict(dict(state, sources={"web": {}}))


def test_epochs_cap_drops_a_source_once(sources):
    logged = []
    loader = mixture(sources, {"web": 0.5, "code": 0.25, "books": 0.25}, epochs={"books": 1}, log=logged.append)
    batches = steps([loader], 30)
    books = [x for b in batches for x in b if x[0] == "books"]
    assert sorted(books) == [("books", i) for i in range(12)]  # all 12 once, never twice
    drops = [line for line in logged if "drops out" in line]
    assert len(drops) == 1 and "books reached its cap of 1 epoch" in drops[0] and "web 0.6667, code 0.3333" in drops[0]
    after = [b for b in batches if not any(s == "books" for s, _ in b)][-20:]
    assert abs(share(after) - 2 / 3) <= 0.02  # the others renormalised
    everything_capped = mixture(sources, {"books": 1.0}, epochs={"books": 1})
    everything_capped.describe(steps_left=3, global_batch=4)  # 12 sequences: enough
    with pytest.raises(MixtureError, match="the epochs caps leave 12 sequences but the 4 planned steps need 16"):
        everything_capped.describe(steps_left=4, global_batch=4)
    with pytest.raises(MixtureError, match="every source with a positive weight has reached its epochs cap"):
        steps([everything_capped], 4)


def test_eval_rows_weight_average(sources):
    batches = EvalBatches({"web": [torch.zeros(1, SEQ)], "code": [torch.zeros(1, SEQ)], "books": []},
                          {"web": 3.0, "code": 1.0, "books": 5.0})
    assert list(batches.by_source) == ["web", "code"] and len(batches) == 2
    assert batches.row({"web": 2.0, "code": 4.0}) == {"val_loss": 2.5, "val_loss/web": 2.0, "val_loss/code": 4.0}
    alone = EvalBatches({DEFAULT_SOURCE: [torch.zeros(1, SEQ)]}, {DEFAULT_SOURCE: 1.0})
    assert alone.row({DEFAULT_SOURCE: 1.25}) == {"val_loss": 1.25}


def test_tokenizer_mismatch_is_one_line(tmp_path):
    def info(name, vocab, eos):
        d = tmp_path / name
        d.mkdir()
        (d / "dataset.json").write_text(json.dumps({
            "format": "gpt-neox-shards", "version": 1, "tokenizer": {"vocab_size": vocab, "eos_id": eos},
            "dtype": "uint16", "documents": 1, "tokens": 1, "shards": []}))
        return DatasetInfo.load(d)

    warned = []
    check_tokenizers({"web": info("web", 50277, 0), "plain": None, "code": info("code", 50277, 0)}, warned.append)
    assert len(warned) == 1 and "plain have no dataset.json" in warned[0]
    with pytest.raises(MixtureError) as e:
        check_tokenizers({"web": info("a", 50277, 0), "code": info("b", 32000, 2)}, warned.append)
    assert "\n" not in str(e.value)
    assert "sources web and code have different tokenizers" in str(e.value) and "a/dataset.json" in str(e.value)


def test_config_forms(tmp_path):
    cfg = get_training_config("demo", parse_overrides(["data_mix=web=data/web:0.7,code=data/code:0.3:2"]))
    assert cfg.data_mix == {"web": {"path": "data/web", "weight": 0.7},
                            "code": {"path": "data/code", "weight": 0.3, "epochs": 2}}
    assert cfg.data_dir == "data/web"  # the first source's folder stands for the mixture's tokenizer
    path = tmp_path / "mix.yaml"
    path.write_text("base: demo\ndata_mix:\n  web: {path: data/web, weight: 3}\n"
                    "  code: {path: data/code, weight: 1, epochs: 1, val_files: 0}\n")
    base, _, fields = read_config_file(path)
    assert base == "demo" and fields["data_mix"]["code"] == {"path": "data/code", "weight": 1.0, "epochs": 1,
                                                             "val_files": 0}
    bad = {"data_mix=web": "data_mix item 'web'", "data_mix=web=x:heavy": "weight must be a number",
           "data_mix=web=x:0": "every weight is 0", "data_mix=we/b=x:1": "a name is letters",
           "data_mix=web=x:1:0": "epochs must be at least 1"}
    for item, message in bad.items():
        with pytest.raises(ConfigError, match=message) as e:
            get_training_config("demo", parse_overrides([item]))
        assert "\n" not in str(e.value)
    path.write_text("data_mix:\n  web: {path: data/web, weigth: 1}\n")
    with pytest.raises(ConfigError, match="needs path and weight"):
        read_config_file(path)


@pytest.mark.slow
def test_train_py_mixture_resume_rows_and_changed_weights(tmp_path, subprocess_env):
    """Through train.py: 20 steps straight == 10 + resume 10 (bitwise); tokens/<name> and val_loss/<name>
    rows and TensorBoard tags; the first lines list the sources; a resume on 2 processes with weights
    0.75/0.25 -> 0.25/0.75 is said in the log and realised (the per-rank shares of the same global stream
    are checked in-process above)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.trainkit import REPO_ROOT, load_weights, make_shards, metrics, run, train_cmd, train_rows
    from utils.training.schedules import lr_at

    web = make_shards(tmp_path / "web", ids=(0, 256))
    code = make_shards(tmp_path / "code", ids=(256, 512), seed=1)
    sets = ("per_device_train_batch_size=2", "gradient_accumulation_steps=2", "max_steps=20", "save_steps=10",
            "eval_interval=10", "lr_schedule=wsd", "decay_steps=6", "report_to=tensorboard")
    mix = f"data_mix=web={web}:0.75,code={code}:0.25"
    straight, split = tmp_path / "straight", tmp_path / "split"
    first = run(train_cmd(straight, web, mix, *sets), subprocess_env)
    assert f"source web: 192 sequences in {web}, weight 0.75" in first.stdout
    assert f"source code: 192 sequences in {code}, weight 0.25" in first.stdout
    run(train_cmd(split, web, mix, *sets, "stop_at_step=10"), subprocess_env)
    changed = tmp_path / "changed"
    shutil.copytree(split, changed)
    run(train_cmd(split, web, mix, *sets, extra=("--resume", "latest")), subprocess_env)

    a, b = train_rows(straight), train_rows(split)
    assert sorted(b) == list(range(1, 21))
    for step in range(1, 21):
        assert a[step]["loss"] == b[step]["loss"], step
        assert a[step]["tokens/web"] == b[step]["tokens/web"] == 3 * step * 64  # 3 of every 4 sequences
        assert a[step]["tokens/code"] == step * 64 and a[step]["tokens"] == 4 * step * 64
        assert abs(a[step]["lr"] - lr_at(step, peak_lr=3e-3, warmup_steps=2, max_steps=20, min_lr_ratio=0.1,
                                         schedule="wsd", decay_steps=6)) <= 1e-12
    wa, wb = (load_weights(d / "final_model" / "model.safetensors") for d in (straight, split))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    evals = [r for r in metrics(straight) if "val_loss" in r]
    assert [r["step"] for r in evals] == [0, 10, 20]
    for r in evals:
        assert abs(r["val_loss"] - (0.75 * r["val_loss/web"] + 0.25 * r["val_loss/code"])) < 1e-9
    events = next((straight / "logs" / "tensorboard").glob("events.out.tfevents.*"))
    tags = EventAccumulator(str(events)).Reload().Tags()["scalars"]
    assert {"train/tokens/web", "train/tokens/code", "eval/val_loss/web", "eval/val_loss/code"} <= set(tags)

    # the changed mixture, resumed on 2 processes (micro-batch 2, no accumulation: the same global batch),
    # and on 1 process (micro-batch 2 x accumulation 2): the same losses
    one = tmp_path / "changed-on-one"
    shutil.copytree(changed, one)
    run(train_cmd(one, web, f"data_mix=web={web}:0.25,code={code}:0.75", *sets, extra=("--resume", "latest")),
        subprocess_env)
    launch = [str(REPO_ROOT / "start_training.sh"), "--config", "demo", "--cpu", "--gpus", "2", "--"]
    resumed = run(launch + train_cmd(changed, web, f"data_mix=web={web}:0.25,code={code}:0.75", *sets,
                                     "gradient_accumulation_steps=1", extra=("--resume", "latest"))[4:],
                  subprocess_env, timeout=600)
    assert "2 process(es) on cpu" in resumed.stdout
    assert "the mixture changed since the checkpoint (web 0.75 -> 0.25, code 0.25 -> 0.75)" in resumed.stdout
    c = train_rows(changed)
    assert c[20]["tokens/web"] - c[10]["tokens/web"] == 10 * 64  # a quarter of the 40 sequences after step 10
    assert c[20]["tokens/code"] - c[10]["tokens/code"] == 30 * 64  # counted over both ranks' shares
    ones = train_rows(one)
    for step in range(11, 21):
        assert abs(c[step]["loss"] - ones[step]["loss"]) <= 1e-5 * abs(ones[step]["loss"]), step
        assert c[step]["tokens/web"] == ones[step]["tokens/web"]
