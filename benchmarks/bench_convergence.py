"""Tokens to a target loss against a tuned baseline: AdamW + hf init (today's engine) at the best of its
learning rates, against recipes (an optimizer, an init, levers), each at its own best rate, 3 seeds each.

    python benchmarks/bench_convergence.py --set max_steps=200 --adamw-lrs 2e-3 4e-3 8e-3 \\
        --muon-lrs 4e-3 8e-3 1.6e-2 --recipes muon+neox muon+neox+wsd muon+neox+wsd:sweep@0.7 \\
        --averages tail --cache /tmp/conv-cache --json out.json
    python benchmarks/make_text_corpus.py SOURCES data/pydocs    # a real-text corpus (Python's docs)
    python benchmarks/bench_convergence.py --config cpu --set data_dir=data/pydocs ...

A recipe is `OPTIMIZER+INIT[+LEVER...][:sweep][@FRACTION]`: adamw | muon, hf | neox, levers `wsd`
(lr_schedule=wsd instead of the preset's cosine), `cautious` (cautious_weight_decay) and `qknorm` (the model with
qk_norm: a norm on each head of q and k, OLMo 2's placement). A recipe without
levers is swept over its optimizer's rates (`--adamw-lrs`, `--muon-lrs`); one with levers runs at the best
rate of the same recipe without them (a lever is measured at its optimizer's best rate), or of a listed swept
recipe holding some of its levers (`muon+neox+wsd:sweep` sets the rate of `muon+neox+wsd+cautious`), or is
swept itself with `:sweep`; `@F` runs it with max_steps (and so its schedule) F times the budget's, at the best rate of
the same recipe at the full budget unless swept. `--averages tail ema` also evaluates, in every recipe's runs,
an average of the weights over the decay tail (utils/training/weight_average.py; from max_steps - the wsd
decay's length on, for every schedule; the EMA's half-life a quarter of that): each is a contender of its own,
`RECIPE [tail]`.

Every run uses the engine's parts (utils.model.build_model, utils.training's optimizer and scheduler),
in this process, with the preset's settings (default `demo`): the data is the preset's corpus cut into rows
of seq_len tokens, a prepared dataset's val/ split or else the last `val_files` shards held out (a fixed
`--val-batches` x batch rows); the seed sets the initial weights and the data order, shared by every
contender (paired). A run's result goes to `--cache` as it ends: a rerun with the same settings reuses it, and
several processes given the same cache share the work (each claims a run before starting it).

Printed: for every contender and rate, the validation loss at 1/4, 1/2, 3/4 of the budget (mean over seeds
+- half the range), the final one, the tokens it needs to reach the tuned baseline's final validation loss of
the same seed as a ratio to the baseline's budget (linear between evaluations; mean and range over seeds),
the step time against the tuned baseline's, and the wall-clock time to that loss against the baseline's whole
run (the tokens ratio times the step-time ratio). Step times are measured after the study with every recipe
in this process, one step each in turn (`--timing-steps`), so that the machine's load, which changes over a
long study, falls on all alike; each run's own median step time is kept in the JSON (`runs_step_ms`).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from utils.runtime.threads import settle_wait

settle_wait()  # how CPU threads wait: before torch (and its OpenMP runtime) is imported

import torch

from configs import get_model_spec, get_training_config
from configs.training_config import parse_overrides

REPO_ROOT = Path(__file__).resolve().parent.parent

BASELINE = "adamw+hf"
LEVERS = {"wsd": {"lr_schedule": "wsd"}, "cautious": {"cautious_weight_decay": True}, "qknorm": {}}
MODEL_LEVERS = {"qknorm": {"qk_norm": True}}  # a lever of the model's spec: QK-norm (OLMo 2's placement)
OPTIMIZERS, INITS = ("adamw", "muon"), ("hf", "neox")


@dataclasses.dataclass(frozen=True)
class Recipe:
    optimizer: str
    init: str
    levers: tuple[str, ...] = ()
    sweep: bool = False
    fraction: float = 1.0

    @classmethod
    def parse(cls, text: str) -> "Recipe":
        body, _, fraction = text.partition("@")
        body, _, flag = body.partition(":")
        parts = body.split("+")
        if len(parts) < 2 or parts[0] not in OPTIMIZERS or parts[1] not in INITS or flag not in ("", "sweep") \
                or any(lever not in LEVERS for lever in parts[2:]):
            raise SystemExit(f"error: --recipes {text!r}: write OPTIMIZER+INIT[+LEVER...][:sweep][@FRACTION] with "
                             f"OPTIMIZER {'|'.join(OPTIMIZERS)}, INIT {'|'.join(INITS)}, LEVER {'|'.join(LEVERS)}")
        levers = tuple(parts[2:])
        return cls(parts[0], parts[1], levers, sweep=flag == "sweep" or not levers and not fraction,
                   fraction=float(fraction) if fraction else 1.0)

    @property
    def name(self) -> str:
        short = f"@{self.fraction:g}" if self.fraction != 1 else ""
        return "+".join((self.optimizer, self.init, *self.levers)) + short

    @property
    def reference(self) -> "Recipe":
        """The recipe whose best rate this one runs at when it is not swept."""
        if self.fraction != 1:
            return dataclasses.replace(self, fraction=1.0, sweep=not self.levers)
        return Recipe(self.optimizer, self.init, sweep=True)

    def settings(self) -> dict:
        out = {"optimizer": self.optimizer, "init": self.init}
        for lever in self.levers:
            out |= LEVERS[lever]
        return out

    def model_settings(self) -> dict:
        return {k: v for lever in self.levers for k, v in MODEL_LEVERS.get(lever, {}).items()}


def load_rows(data_dir: Path, seq_len: int, val_files: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train rows, validation rows) of seq_len tokens: each shard's tokens cut into rows; a prepared
    dataset's (prepare_data.py) validation split is its val/ folder, otherwise the last `val_files` shards
    (by path) are held out, as the engine does."""
    paths = sorted(Path(data_dir).rglob("*.npz"))
    val_dir = Path(data_dir) / "val"
    if val_dir.is_dir():
        held = [p for p in paths if val_dir in p.parents]
        paths = [p for p in paths if val_dir not in p.parents] + held
        val_files = len(held)

    def rows(ps):
        out = []
        for p in ps:
            flat = np.load(p)["input_ids"].reshape(-1).astype(np.int64)
            n = flat.size // seq_len
            out.append(flat[: n * seq_len].reshape(n, seq_len))
        return torch.from_numpy(np.concatenate(out))
    return rows(paths[:-val_files]), rows(paths[-val_files:])


@torch.no_grad()
def val_loss(model, val: torch.Tensor, batch: int) -> float:
    model.eval()
    losses = [model(val[i:i + batch]).item() for i in range(0, val.shape[0], batch)]
    model.train()
    return sum(losses) / len(losses)


class Contender:
    """A recipe at one rate and seed, built from the engine's parts: the model, the optimizer, the schedule."""

    def __init__(self, recipe: Recipe, lr: float, seed: int, cfg, spec):
        from utils.model import build_model
        from utils.training.lr_scheduler import build_scheduler
        from utils.training.optim import OptimizerSettings, build_optimizer
        from utils.training.schedules import ScheduleSettings

        self.cfg = dataclasses.replace(cfg, **recipe.settings(), seed=seed, learning_rate=lr,
                                       max_steps=max(1, round(cfg.max_steps * recipe.fraction)))
        self.model = build_model(dataclasses.replace(spec, **recipe.model_settings()), seed=seed, impl="native",
                                 init=recipe.init)
        self.schedule = ScheduleSettings.of(self.cfg)
        self.optimizer = build_optimizer(self.model, OptimizerSettings.of(self.cfg), fused=False)
        self.scheduler = build_scheduler(self.optimizer, self.schedule)
        self.params = list(self.model.parameters())

    def step(self, rows: torch.Tensor) -> float:
        """One training step on `rows`; returns its seconds."""
        started = time.perf_counter()
        loss = self.model(rows)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.cfg.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - started


def train_one(recipe: Recipe, lr: float, seed: int, cfg, spec, data, eval_every: int, averages=()) -> dict:
    """One run: the validation curve [(tokens, loss)], the training seconds at each of its points, and for
    each average in `averages` its own curve (the trained weights' until the average starts)."""
    from utils.training.weight_average import WeightAverage

    train, val = data
    run = Contender(recipe, lr, seed, cfg, spec)
    model, batch, steps = run.model, run.cfg.per_device_train_batch_size, run.cfg.max_steps
    tail = run.schedule.wsd_decay_steps  # the EMA's half-life: a quarter of the tail
    averaged = {kind: WeightAverage(run.params, kind, steps - tail, ema_decay=0.5 ** (4 / max(1, tail)))
                for kind in averages}
    order = torch.randperm(train.shape[0], generator=torch.Generator().manual_seed(seed))
    tokens_per_step = batch * train.shape[1]
    first = val_loss(model, val, batch)
    curve, seconds, curves = [(0, first)], [0.0], {kind: [(0, first)] for kind in averages}
    step_s, trained_s = [], 0.0
    for step in range(1, steps + 1):
        idx = order[((step - 1) * batch + torch.arange(batch)) % order.numel()]
        started = time.perf_counter()
        run.step(train[idx])
        for average in averaged.values():
            average.update(step)
        step_s.append(time.perf_counter() - started)
        trained_s += step_s[-1]
        if step % eval_every == 0 or step == steps:
            tokens = step * tokens_per_step
            curve.append((tokens, val_loss(model, val, batch)))
            seconds.append(trained_s)
            for kind, average in averaged.items():
                with average.applied():
                    loss = curve[-1][1] if average.average is None else val_loss(model, val, batch)
                curves[kind].append((tokens, loss))
            if not math.isfinite(curve[-1][1]):
                break
    return {"seed": seed, "lr": lr, "curve": curve, "train_s": seconds, "averages": curves,
            "step_s_median": statistics.median(step_s), "final_val": curve[-1][1]}


def interleaved_step_ms(contenders: dict[str, tuple[Recipe, float]], cfg, spec, train: torch.Tensor,
                        steps: int) -> dict[str, float]:
    """Each contender's median step time in ms, measured in turns (one step each, the order rotating every
    round) in this process, so that a change in the machine's load falls on every contender alike."""
    built = {name: Contender(recipe, lr, 0, cfg, spec) for name, (recipe, lr) in contenders.items()}
    names, times = list(built), {name: [] for name in built}
    batch = cfg.per_device_train_batch_size
    for i in range(steps):
        rows = train[(i * batch + torch.arange(batch)) % train.shape[0]]
        for name in names[i % len(names):] + names[:i % len(names)]:
            times[name].append(built[name].step(rows))
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def tokens_to_reach(curve: list[tuple[int, float]], target: float) -> float | None:
    """The first token count where the validation loss reaches `target`, linear between evaluations."""
    for (t0, l0), (t1, l1) in zip(curve, curve[1:]):
        if l1 <= target:
            return t1 if l0 == l1 else t0 + (t1 - t0) * (l0 - target) / (l0 - l1)
    return None


def seconds_to_reach(run: dict, target: float) -> float | None:
    """The training seconds (evaluations excluded) at which `run` reaches `target`, linear between points."""
    reached = tokens_to_reach(run["curve"], target)
    if reached is None:
        return None
    tokens = [t for t, _ in run["curve"]]
    return float(np.interp(reached, tokens, run["train_s"]))


class RunCache:
    """One JSON file per finished run under `root` (None: nothing kept), and a claim file per run in progress
    (its process id), so that several processes given the same folder share the runs."""

    def __init__(self, root: Path | None, settings: dict):
        self.root, self.settings = root, settings
        if root is not None:
            root.mkdir(parents=True, exist_ok=True)

    def _path(self, recipe: Recipe, lr: float, seed: int, suffix: str) -> Path:
        key = json.dumps([self.settings, recipe.name, lr, seed], sort_keys=True)
        return self.root / f"{recipe.name}-lr{lr:g}-seed{seed}-{hashlib.sha256(key.encode()).hexdigest()[:12]}{suffix}"

    def get(self, recipe: Recipe, lr: float, seed: int) -> dict | None:
        if self.root is None or not self._path(recipe, lr, seed, ".json").is_file():
            return None
        return json.loads(self._path(recipe, lr, seed, ".json").read_text())

    def claim(self, recipe: Recipe, lr: float, seed: int) -> bool:
        """True when this process may run it: nobody else is (a dead claimer's claim is taken over)."""
        if self.root is None:
            return True
        path = self._path(recipe, lr, seed, ".claim")
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                os.kill(int(path.read_text() or 0), 0)
                return False
            except (ProcessLookupError, ValueError, FileNotFoundError):
                path.unlink(missing_ok=True)
                return self.claim(recipe, lr, seed)
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        return True

    def put(self, recipe: Recipe, lr: float, seed: int, result: dict) -> None:
        if self.root is not None:
            tmp = self._path(recipe, lr, seed, ".tmp")
            tmp.write_text(json.dumps(result))
            tmp.replace(self._path(recipe, lr, seed, ".json"))
            self._path(recipe, lr, seed, ".claim").unlink(missing_ok=True)


def with_references(recipes: list[Recipe]) -> list[Recipe]:
    """`recipes` with, before each, the references it needs (by name) that are not listed."""
    names = {r.name for r in recipes}
    out: list[Recipe] = []
    for recipe in recipes:
        chain, current = [], recipe
        while not current.sweep and current.reference.name not in names:
            current = current.reference
            chain.insert(0, current)
            names.add(current.name)
        out += chain + [recipe]
    return out


class Study:
    """Every recipe's runs at its rates (its own sweep, or its reference's best rate), with every seed."""

    def __init__(self, args, cfg, spec, data, cache: RunCache, recipes: list[Recipe]):
        self.args, self.cfg, self.spec, self.data, self.cache = args, cfg, spec, data, cache
        self.runs: dict[tuple[str, float], list[dict]] = {}
        self.recipes = with_references(recipes)
        self.by_name = {r.name: r for r in self.recipes}

    def rates(self, recipe: Recipe) -> list[float] | None:
        """The rates `recipe` runs at; None while its reference's sweep is unfinished."""
        if recipe.sweep:
            return list(self.args.adamw_lrs if recipe.optimizer == "adamw" else self.args.muon_lrs)
        best = self.best_rate(self.reference_of(recipe))
        return None if best is None else [best]

    def reference_of(self, recipe: Recipe) -> Recipe:
        """The recipe whose best rate `recipe` runs at: a shortened one's own at the full budget; a levered one's,
        the listed swept recipe with the most of its levers (so levers together run at the best rate of the
        swept lever), else the optimizer and init alone."""
        if recipe.fraction != 1:
            return self.by_name[recipe.reference.name]
        swept = [r for r in self.recipes if r.sweep and r.fraction == 1 and (r.optimizer, r.init) ==
                 (recipe.optimizer, recipe.init) and set(r.levers) < set(recipe.levers)]
        return max(swept, key=lambda r: len(r.levers), default=self.by_name[recipe.reference.name])

    def best_rate(self, recipe: Recipe) -> float | None:
        """The rate of `recipe`'s lowest mean final validation loss; None until every run of it is done."""
        rates = self.rates(recipe)
        if rates is None or any(len(self.runs.get((recipe.name, lr), [])) < len(self.args.seeds) for lr in rates):
            return None
        return min(rates, key=lambda lr: statistics.mean(r["final_val"] for r in self.runs[(recipe.name, lr)]))

    def run_all(self) -> None:
        """Runs whatever is runnable until every recipe is done; waits for runs another process claimed."""
        recipes = self.recipes
        while True:
            waiting, progressed = False, False
            for recipe in recipes:
                for lr in self.rates(recipe) or []:
                    for seed in self.args.seeds:
                        done = self.runs.setdefault((recipe.name, lr), [])
                        if any(r["seed"] == seed for r in done):
                            continue
                        result = self.cache.get(recipe, lr, seed)
                        if result is None and self.cache.claim(recipe, lr, seed):
                            result = self._run(recipe, lr, seed)
                        if result is None:
                            waiting = True
                            continue
                        done.append(result)
                        done.sort(key=lambda r: r["seed"])
                        progressed = True
            if all(self.best_rate(r) is not None for r in recipes):
                return
            if not progressed and not waiting:
                raise RuntimeError("no runnable run and none in progress elsewhere")  # a reference missing: a bug
            if not progressed:
                time.sleep(15)

    def _run(self, recipe: Recipe, lr: float, seed: int) -> dict:
        averages = self.args.averages if recipe.name != BASELINE else ()
        result = train_one(recipe, lr, seed, self.cfg, self.spec, self.data, self.args.eval_every, averages)
        self.cache.put(recipe, lr, seed, result)
        print(f"  {recipe.name:<28} lr {lr:<7g} seed {seed}: final val {result['final_val']:.4f}"
              + "".join(f", [{k}] {c[-1][1]:.4f}" for k, c in result["averages"].items())
              + f", step {1e3 * result['step_s_median']:.1f} ms", flush=True)
        return result


def contender_runs(study: Study, recipes: list[Recipe]) -> tuple[dict[str, list[dict]], dict[str, Recipe]]:
    """Every contender's runs by its row name (`RECIPE, lr LR` and `RECIPE [AVERAGE], lr LR`), the tuned
    baseline first, an average's runs carrying its curve as theirs; and each row's recipe."""
    base = Recipe.parse(BASELINE)
    best = study.best_rate(base)
    tuned = f"{BASELINE}, lr {best:g} (tuned baseline)"
    rows, sources = {tuned: study.runs[(BASELINE, best)]}, {tuned: base}
    for recipe in recipes:
        for lr in study.rates(recipe):
            if (recipe.name, lr) == (BASELINE, best):
                continue
            runs = study.runs[(recipe.name, lr)]
            rows[f"{recipe.name}, lr {lr:g}"], sources[f"{recipe.name}, lr {lr:g}"] = runs, recipe
            for kind in study.args.averages if recipe.name != BASELINE else ():
                name = f"{recipe.name} [{kind}], lr {lr:g}"
                rows[name] = [r | {"curve": r["averages"][kind], "final_val": r["averages"][kind][-1][1]} for r in runs]
                sources[name] = recipe
    return rows, sources


def summarise(rows: dict[str, list[dict]], budget: int, step_ms: dict[str, float] | None = None) -> dict:
    """Every contender against the first (the tuned baseline), seed by seed. `step_ms`: step times measured in
    turns (interleaved_step_ms) by row name, which the step-time and wall-clock ratios then use; otherwise the
    runs' own medians (each measured at whatever load its run met)."""
    reference = next(iter(rows))
    base = {r["seed"]: r for r in rows[reference]}
    out = {}
    for name, runs in rows.items():
        ratios, walls = [], []
        for r in runs:
            target, own = base[r["seed"]]["final_val"], base[r["seed"]]
            reached = tokens_to_reach(r["curve"], target)
            ratios.append(None if reached is None else reached / budget)
            seconds = seconds_to_reach(r, target)
            walls.append(None if seconds is None else seconds / own["train_s"][-1])
        finals = [r["final_val"] for r in runs]
        got, walls_got = [x for x in ratios if x is not None], [x for x in walls if x is not None]
        out[name] = {"final_val_mean": statistics.mean(finals), "final_val_min": min(finals),
                     "final_val_max": max(finals), "ratio_per_seed": ratios,
                     "ratio_mean": statistics.mean(got) if len(got) == len(ratios) else None,
                     "ratio_min": min(got) if got else None, "ratio_max": max(got) if got else None,
                     "runs_step_ms": 1e3 * statistics.mean(r["step_s_median"] for r in runs),
                     "runs_wall_ratio_per_seed": walls,
                     "runs_wall_ratio_mean": statistics.mean(walls_got) if len(walls_got) == len(walls) else None}
    for name, s in out.items():
        timed = step_ms is not None and name in step_ms and reference in step_ms
        s["step_ms"] = step_ms[name] if timed else s["runs_step_ms"]
        s["step_ms_measured"] = "interleaved" if timed else "runs"
        s["step_time_ratio"] = s["step_ms"] / (step_ms[reference] if timed else out[reference]["runs_step_ms"])
        s["wall_ratio_mean"] = (s["ratio_mean"] * s["step_time_ratio"] if timed and s["ratio_mean"] is not None
                                else None if timed else s["runs_wall_ratio_mean"])
    return out


def table(rows: dict, summary: dict, marks: list[int]) -> str:
    def at(curve, tokens):
        return next(loss for t, loss in curve if t >= tokens)
    head = "| contender | " + " | ".join(f"val @ {m / 1e3:.0f}k tok" for m in marks) + \
           " | final val (min-max) | tokens to the tuned baseline's final (ratio, min-max) | step ms (x) | wall (x) |"
    lines = [head, "|---|" + "---:|" * (len(marks) + 4)]
    for name, runs in rows.items():
        s = summary[name]
        cells = []
        for m in marks:
            vals = [at(r["curve"], m) for r in runs if r["curve"][-1][0] >= m]
            cells.append(f"{statistics.mean(vals):.3f} ± {(max(vals) - min(vals)) / 2:.3f}" if vals else "-")
        if s["ratio_mean"] is not None:
            ratio = f"{s['ratio_mean']:.2f} ({s['ratio_min']:.2f}-{s['ratio_max']:.2f})"
        else:
            ratio = "per seed: " + ", ".join("not reached" if x is None else f"{x:.2f}" for x in s["ratio_per_seed"])
        wall = "-" if s["wall_ratio_mean"] is None else f"{s['wall_ratio_mean']:.2f}"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {s['final_val_mean']:.3f} ({s['final_val_min']:.3f}-"
                     f"{s['final_val_max']:.3f}) | {ratio} | {s['step_ms']:.1f} ({s['step_time_ratio']:.2f}) | "
                     f"{wall} |")
    return "\n".join(lines)


def best_contender(summary: dict) -> str | None:
    """The contender with the lowest mean ratio among those that reach the target on every seed."""
    reached = {name: s["ratio_mean"] for name, s in list(summary.items())[1:] if s["ratio_mean"] is not None}
    return min(reached, key=reached.get) if reached else None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="demo", help="the preset whose model, data, batch and schedule every run uses")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="change a preset setting (all runs)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--adamw-lrs", type=float, nargs="+", default=[2e-3, 4e-3, 8e-3], metavar="LR",
                   help="AdamW's rates: the baseline's sweep and every swept AdamW recipe's")
    p.add_argument("--muon-lrs", type=float, nargs="+", default=[4e-3, 8e-3, 1.6e-2], metavar="LR",
                   help="every swept Muon recipe's rates")
    p.add_argument("--recipes", nargs="*", default=["muon+neox"], metavar="RECIPE",
                   help="contenders beside the baseline (adamw+hf, always swept): OPTIMIZER+INIT[+LEVER...]"
                        "[:sweep][@FRACTION], levers " + ", ".join(LEVERS))
    p.add_argument("--averages", nargs="*", default=[], choices=("tail", "ema"),
                   help="also evaluate these averages of the weights over the decay tail, in every recipe's runs")
    p.add_argument("--eval-every", type=int, default=20, help="optimizer steps between validation losses")
    p.add_argument("--val-batches", type=int, default=8, help="validation batches (of the preset's batch size)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--timing-steps", type=int, default=30,
                   help="steps of each recipe timed in turns for the step-time ratio (0: the runs' own medians)")
    p.add_argument("--cache", type=Path, help="a folder keeping each finished run (reused; shared by processes)")
    p.add_argument("--json", type=Path, help="write every curve and the summary here")
    return p.parse_args(argv)


def load_data(cfg, spec, val_batches: int):
    """The preset's model spec (its vocabulary the data's), seq_len and (train, val) rows."""
    data_dir = Path(cfg.data_dir) if Path(cfg.data_dir).is_absolute() else REPO_ROOT / cfg.data_dir
    if (data_dir / "dataset.json").is_file():  # a prepared dataset: the vocabulary follows its tokenizer
        vocab = json.loads((data_dir / "dataset.json").read_text())["tokenizer"]["vocab_size"]
        spec = dataclasses.replace(spec, vocab_size=vocab)
    seq_len = cfg.seq_len_for(spec)
    if cfg.demo_data:
        from utils.data.demo import build_demo_data

        build_demo_data(data_dir, spec.vocab_size, seq_len)
    train, val = load_rows(data_dir, seq_len, cfg.val_files)
    return spec, seq_len, (train, val[: val_batches * cfg.per_device_train_batch_size])


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    overrides = parse_overrides(args.set)
    cfg = get_training_config(args.config, overrides)
    spec, seq_len, data = load_data(cfg, get_model_spec(cfg.model), args.val_batches)
    recipes = [Recipe.parse(BASELINE)] + [Recipe.parse(text) for text in args.recipes if text != BASELINE]
    budget = cfg.max_steps * cfg.per_device_train_batch_size * seq_len
    print(f"{args.config}: model {spec.name}, {data[0].shape[0]:,} train rows, {data[1].shape[0]} validation rows "
          f"of {seq_len} tokens; {cfg.max_steps} steps x {cfg.per_device_train_batch_size} rows = {budget:,} tokens; "
          f"{cfg.lr_schedule}, warmup {cfg.warmup_steps}; seeds {args.seeds}", flush=True)
    settings = {"preset": args.config, "overrides": overrides, "eval_every": args.eval_every,
                "val_rows": int(data[1].shape[0]), "averages": args.averages, "vocab": spec.vocab_size}
    study = Study(args, cfg, spec, data, RunCache(args.cache, settings), recipes)
    study.run_all()
    recipes = study.recipes
    rows, sources = contender_runs(study, recipes)
    step_ms = None
    if args.timing_steps:  # each recipe's step (an average's row: its recipe's), measured in turns
        per_recipe = interleaved_step_ms({r.name: (r, study.best_rate(r)) for r in recipes}, cfg, spec, data[0],
                                         args.timing_steps)
        step_ms = {row: per_recipe[recipe.name] for row, recipe in sources.items()}
    summary = summarise(rows, budget, step_ms)
    text = table(rows, summary, [budget * k // 4 for k in (1, 2, 3)])
    command = "python benchmarks/bench_convergence.py " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"\n{text}\n\nbest: {best_contender(summary)}\n{datetime.date.today()}, torch {torch.__version__}, "
          f"{platform.processor() or platform.machine()}, {args.threads} thread(s); {command}")
    if args.json:
        args.json.write_text(json.dumps({
            "date": str(datetime.date.today()), "command": command, "torch": torch.__version__, "device": "cpu",
            "threads": args.threads, "preset": args.config, "model": spec.name, "overrides": overrides,
            "budget_tokens": budget, "seeds": args.seeds, "eval_every": args.eval_every,
            "val_rows": int(data[1].shape[0]), "seq_len": seq_len, "adamw_lrs": args.adamw_lrs,
            "muon_lrs": args.muon_lrs, "recipes": [r.name + (":sweep" if r.sweep else "") for r in recipes],
            "averages": args.averages, "timing_steps": args.timing_steps,
            "best_rates": {r.name: study.best_rate(r) for r in recipes},
            "tuned_baseline": next(iter(rows)), "best": best_contender(summary), "summary": summary,
            "runs": rows, "table": text}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
