"""Tokens to a target loss: today's engine (AdamW, hf init) against init=neox, Muon, Muon + neox, and z-loss
on the best of those, each with several seeds, on the same model, data, batch, schedule and token budget.

    python benchmarks/bench_convergence.py                       # CPU: the demo model on the demo corpus
    python benchmarks/bench_convergence.py --json out.json --seeds 0 1 2
    python benchmarks/make_text_corpus.py SOURCES data/pydocs    # a real-text corpus (Python's docs)
    python benchmarks/bench_convergence.py --config cpu --set data_dir=data/pydocs --set max_steps=250
    python benchmarks/bench_convergence.py --muon-lrs 1e-3 2e-3 4e-3   # Muon's lr, against the preset's

Every contender trains with the engine's own parts (utils.model.build_model with the `init` scheme,
utils.training.optim.build_optimizer / lr_scheduler.build_scheduler, the model's chunked loss with `z_loss`), in this process,
from the preset's settings (default `demo`: model demo, batch 16 x seq 128, lr 2e-3, warmup 30, cosine to
0.1 at max_steps 400, weight decay 0.1, grad clip 1.0, fp32). The data is the preset's corpus (the demo
builds its own: the standard library's source, BPE 2048; a prepared dataset's vocabulary sets the model's)
cut into rows of seq_len tokens: a prepared dataset's val/ split or else the last `val_files` shards are
the validation set (a fixed `--val-batches` x batch rows), the others are drawn in
an order set by the seed. The seed also sets the initial weights; contender k and the baseline share
each seed (paired).

Printed: validation loss at fixed token counts (mean over seeds +- the half range), the final validation
loss, the tokens each contender needs to reach the baseline's final validation loss of the same seed as a
ratio to the baseline's budget (linear between evaluations; mean and the range over seeds; "not reached"
when it is not within the budget), and the training step time (median over the run's steps, mean over
seeds) with its ratio to the baseline's.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

import numpy as np
import torch

from configs import get_model_spec, get_training_config
from configs.training_config import parse_overrides

BASE = {"name": "adamw + hf init (today)", "optimizer": "adamw", "init": "hf", "z_loss": 0.0}
CONTENDERS = [
    BASE,
    {"name": "adamw + neox init", "optimizer": "adamw", "init": "neox", "z_loss": 0.0},
    {"name": "muon + hf init", "optimizer": "muon", "init": "hf", "z_loss": 0.0},
    {"name": "muon + neox init", "optimizer": "muon", "init": "neox", "z_loss": 0.0},
]
Z_LOSS = 1e-4  # OLMo's coefficient, added to the best of the four above


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


def train_one(contender: dict, seed: int, cfg, spec, train: torch.Tensor, val: torch.Tensor, eval_every: int) -> dict:
    from utils.model import build_model
    from utils.model.lm_loss import set_z_loss
    from utils.training.lr_scheduler import build_scheduler
    from utils.training.optim import OptimizerSettings, build_optimizer
    from utils.training.schedules import ScheduleSettings

    cfg = dataclasses.replace(cfg, optimizer=contender["optimizer"], init=contender["init"],
                              z_loss=contender["z_loss"], seed=seed,
                              learning_rate=contender.get("lr", cfg.learning_rate))
    model = build_model(spec, seed=seed, impl="native", init=contender["init"])
    set_z_loss(model, contender["z_loss"])
    optimizer = build_optimizer(model, OptimizerSettings.of(cfg), fused=False)
    scheduler = build_scheduler(optimizer, ScheduleSettings.of(cfg))
    batch, steps = cfg.per_device_train_batch_size, cfg.max_steps
    order = torch.randperm(train.shape[0], generator=torch.Generator().manual_seed(seed))
    tokens_per_step = batch * train.shape[1]
    curve = [(0, val_loss(model, val, batch))]
    step_s, train_losses = [], []
    params = list(model.parameters())
    for step in range(1, steps + 1):
        idx = order[((step - 1) * batch + torch.arange(batch)) % order.numel()]
        started = time.perf_counter()
        loss = model(train[idx])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        train_losses.append(loss.item())
        step_s.append(time.perf_counter() - started)
        if step % eval_every == 0 or step == steps:
            curve.append((step * tokens_per_step, val_loss(model, val, batch)))
            if not math.isfinite(curve[-1][1]):
                break
    return {"seed": seed, "curve": curve, "step_s_median": statistics.median(step_s),
            "final_val": curve[-1][1], "final_train": train_losses[-1]}


def tokens_to_reach(curve: list[tuple[int, float]], target: float) -> float | None:
    """The first token count where the validation loss reaches `target`, linear between evaluations."""
    for (t0, l0), (t1, l1) in zip(curve, curve[1:]):
        if l1 <= target:
            return t1 if l0 == l1 else t0 + (t1 - t0) * (l0 - target) / (l0 - l1)
    return None


def summarise(results: dict, budget: int) -> dict:
    """Every contender against the first (the reference: today's engine, or the preset's lr in a sweep)."""
    reference = next(iter(results))
    base = {r["seed"]: r for r in results[reference]}
    out = {}
    for name, runs in results.items():
        ratios = []
        for r in runs:
            reached = tokens_to_reach(r["curve"], base[r["seed"]]["final_val"])
            ratios.append(None if reached is None else reached / budget)
        finals = [r["final_val"] for r in runs]
        got = [x for x in ratios if x is not None]
        out[name] = {"final_val_mean": statistics.mean(finals), "final_val_min": min(finals),
                     "final_val_max": max(finals), "ratio_per_seed": ratios,
                     "ratio_mean": statistics.mean(got) if len(got) == len(ratios) else None,
                     "ratio_min": min(got) if got else None, "ratio_max": max(got) if got else None,
                     "step_ms": 1e3 * statistics.mean(r["step_s_median"] for r in runs)}
    for name in out:
        out[name]["step_time_ratio"] = out[name]["step_ms"] / out[reference]["step_ms"]
    return out


def table(results: dict, summary: dict, marks: list[int], ref_label: str = "today") -> str:
    def at(curve, tokens):
        return next(l for t, l in curve if t >= tokens)
    head = "| contender | " + " | ".join(f"val @ {m / 1e3:.0f}k tok" for m in marks) + \
           f" | final val (min-max) | tokens to {ref_label}'s final (ratio, min-max) | step ms (x {ref_label}) |"
    lines = [head, "|---|" + "---:|" * (len(marks) + 3)]
    for name, runs in results.items():
        s = summary[name]
        cells = []
        for m in marks:
            vals = [at(r["curve"], m) for r in runs]
            cells.append(f"{statistics.mean(vals):.3f} ± {(max(vals) - min(vals)) / 2:.3f}")
        if s["ratio_mean"] is not None:
            ratio = f"{s['ratio_mean']:.2f} ({s['ratio_min']:.2f}-{s['ratio_max']:.2f})"
        else:
            shown = ", ".join("not reached" if x is None else f"{x:.2f}" for x in s["ratio_per_seed"])
            ratio = f"per seed: {shown}"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {s['final_val_mean']:.3f} ({s['final_val_min']:.3f}-"
                     f"{s['final_val_max']:.3f}) | {ratio} | {s['step_ms']:.1f} ({s['step_time_ratio']:.2f}) |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="demo", help="the preset whose model, data, batch and schedule every contender uses")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="change a preset setting (all contenders)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--eval-every", type=int, default=20, help="optimizer steps between validation losses")
    p.add_argument("--val-batches", type=int, default=8, help="validation batches (of the preset's batch size)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path, help="write every curve and the summary here")
    p.add_argument("--no-z-loss", action="store_true", help="skip the z-loss contender")
    p.add_argument("--muon-lrs", type=float, nargs="+", metavar="LR",
                   help="instead of the contenders: a learning-rate sweep of Muon (with the preset's init), "
                        "each lr against Muon at the preset's learning_rate (run first, the reference)")
    p.add_argument("--adamw-lrs", type=float, nargs="+", metavar="LR", help="the same sweep for AdamW")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    overrides = parse_overrides(args.set)
    cfg = get_training_config(args.config, overrides)
    spec = get_model_spec(cfg.model)
    info = (Path(cfg.data_dir) if Path(cfg.data_dir).is_absolute() else REPO_ROOT / cfg.data_dir) / "dataset.json"
    if info.is_file():  # a prepared dataset: the model's vocabulary follows its tokenizer, as train.py's
        vocab = json.loads(info.read_text())["tokenizer"]["vocab_size"]
        spec = dataclasses.replace(spec, vocab_size=vocab)
    seq_len = cfg.seq_len_for(spec)
    data_dir = Path(cfg.data_dir) if Path(cfg.data_dir).is_absolute() else REPO_ROOT / cfg.data_dir
    if cfg.demo_data:
        from utils.data.demo import build_demo_data

        build_demo_data(data_dir, spec.vocab_size, seq_len)
    train, val = load_rows(data_dir, seq_len, cfg.val_files)
    val = val[: args.val_batches * cfg.per_device_train_batch_size]
    budget = cfg.max_steps * cfg.per_device_train_batch_size * seq_len
    print(f"{args.config}: model {spec.name}, {train.shape[0]:,} train rows, {val.shape[0]} validation rows of "
          f"{seq_len} tokens; {cfg.max_steps} steps x {cfg.per_device_train_batch_size} rows = {budget:,} tokens; "
          f"lr {cfg.learning_rate:g} ({cfg.lr_schedule}, warmup {cfg.warmup_steps}); seeds {args.seeds}", flush=True)
    results: dict[str, list] = {}

    def run(contender):
        results[contender["name"]] = []
        for seed in args.seeds:
            r = train_one(contender, seed, cfg, spec, train, val, args.eval_every)
            results[contender["name"]].append(r)
            print(f"  {contender['name']:<28} seed {seed}: final val {r['final_val']:.4f}, "
                  f"step {1e3 * r['step_s_median']:.1f} ms", flush=True)

    sweep = "muon" if args.muon_lrs else "adamw" if args.adamw_lrs else None
    if sweep:
        lrs = [cfg.learning_rate] + [lr for lr in (args.muon_lrs or args.adamw_lrs) if lr != cfg.learning_rate]
        contenders = [{"name": f"{sweep} + {cfg.init} init, lr {lr:g}" + (" (preset)" if lr == cfg.learning_rate else ""),
                       "optimizer": sweep, "init": cfg.init, "z_loss": 0.0, "lr": lr} for lr in lrs]
    else:
        contenders = CONTENDERS
    for contender in contenders:
        run(contender)
    best = min(contenders, key=lambda c: statistics.mean(r["final_val"] for r in results[c["name"]]))
    if not args.no_z_loss and not sweep:
        run({**best, "name": f"{best['name']} + z-loss {Z_LOSS:g}", "z_loss": Z_LOSS})
    summary = summarise(results, budget)
    marks = [budget * k // 4 for k in (1, 2, 3)]
    text = table(results, summary, marks, "the preset lr" if sweep else "today")
    print()
    print(text)
    command = "python benchmarks/bench_convergence.py " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"\n{datetime.date.today()}, torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{args.threads} thread(s); {command}")
    if args.json:
        args.json.write_text(json.dumps({
            "date": str(datetime.date.today()), "command": command, "torch": torch.__version__,
            "device": "cpu", "threads": args.threads, "preset": args.config, "model": spec.name,
            "overrides": overrides, "budget_tokens": budget, "seeds": args.seeds, "eval_every": args.eval_every,
            "val_rows": int(val.shape[0]), "seq_len": seq_len, "best_of_four": best["name"], "summary": summary,
            "runs": results, "table": text}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
