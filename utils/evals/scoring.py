"""Scoring as lm-evaluation-harness scores (its `hf` model, 0-shot), so the numbers are the ones a user gets
from `lm_eval --model hf` on the exported model (tests/unit/evals/test_evals.py checks it against lm-eval itself).

Tokenization (`RequestEncoder`, lm-eval's `_encode_pair` and `tok_encode`): whitespace at the end of the
context moves to the front of the continuation; the whole string context + continuation is encoded and
split after the context's own tokens (so a merge across the boundary counts in the continuation); the
tokenizer's own special tokens are added as HF's `encode` adds them (none for GPT-NeoX's and the engine's
tokenizers: no BOS), unless the text already starts with the BOS token. An empty context is the prefix
token alone (BOS, else EOS). A request longer than the model's positions keeps its last
`max_position_embeddings + 1` tokens.

Log-likelihood (`loglikelihoods`): the model's logits at the continuation's positions, log-softmax in fp32
over every row of the output (padding rows included, as lm-eval's), summed; the continuation is greedy when
every one of its tokens is the argmax. Requests are sorted longest first, dealt round-robin to the ranks,
batched right-padded (the causal mask keeps padding out of every scored position), and the results summed
over ranks. A sharded (FSDP) model runs its forward only with every rank, so each rank runs the same
number of batches, a one-token batch where it has run out.

Metrics (`task_metrics`), lm-eval's: multiple choice `acc` (the argmax of the choices' log-likelihoods is
gold) and `acc_norm` (the argmax of each log-likelihood divided by its choice's length in characters, the
choice without the delimiter: lm-eval's `len(choice)`; for ASCII text that is the byte length), first
index on ties; cloze `acc` (the share of greedy targets) and `ppl` (exp of minus the mean log-likelihood).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from utils.evals.tasks import CLOZE, Task, TaskFileError


class RequestEncoder:
    """(context, continuation) strings -> (context ids, continuation ids), as lm-eval's HF model encodes them."""

    def __init__(self, tokenizer, prefix_id: int | None, max_length: int):
        """`tokenizer`: a `tokenizers.Tokenizer`; `prefix_id`: BOS, else EOS (None: neither, and then no
        context may be empty); `max_length`: the model's positions."""
        self.tokenizer, self.prefix_id, self.max_length = tokenizer, prefix_id, max_length
        self.prefix_text = "" if prefix_id is None else tokenizer.decode([prefix_id], skip_special_tokens=False)

    def encode(self, text: str, special_tokens: bool = True) -> list[int]:
        add = special_tokens and not (self.prefix_text and text.startswith(self.prefix_text))
        return self.tokenizer.encode(text, add_special_tokens=add).ids

    def pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        if not context:
            if self.prefix_id is None:
                raise ValueError("an empty context needs a BOS or EOS token to stand for it; the tokenizer has neither")
            cont = self.encode(continuation, special_tokens=False)
            return ([self.prefix_id], cont) if cont[:1] != [self.prefix_id] else (cont[:1], cont[1:])
        if not context.strip():
            raise ValueError("a context of only whitespace leaves nothing to condition on (lm-eval refuses it too)")
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = self.encode(context + continuation)
        context_ids = self.encode(context)
        return context_ids, whole[len(context_ids):]

    def task_requests(self, task: Task) -> list[tuple[list[int], list[int]]]:
        """Every request of `task`, example by example, choice by choice."""
        out = []
        for i, example in enumerate(task.examples, 1):
            for context, continuation in example.requests():
                try:
                    ids = self.pair(context, continuation)
                except ValueError as exc:
                    raise TaskFileError(f"task {task.name} ({task.path}), example {i}: {exc}") from None
                if not ids[1] or len(ids[1]) > self.max_length:
                    raise TaskFileError(f"task {task.name} ({task.path}), example {i}: a continuation of "
                                        f"{len(ids[1])} tokens cannot be scored by a model of {self.max_length} "
                                        f"positions")
                out.append(ids)
        return out


def model_input(context: list[int], continuation: list[int], max_length: int) -> list[int]:
    """The tokens the model reads: context + continuation but the last token, the last `max_length` of them."""
    return (context + continuation)[-(max_length + 1):][:-1]


@dataclass(frozen=True)
class Placement:
    """Where the scoring model runs: its device and autocast, this rank of `world`, and whether the model is
    sharded (every rank then runs each forward)."""

    device: Any = "cpu"
    autocast: Callable = contextlib.nullcontext
    rank: int = 0
    world: int = 1
    sharded: bool = False


@torch.no_grad()
def loglikelihoods(model, requests: list[tuple[list[int], list[int]]], batch_size: int, max_length: int,
                   placement: Placement = Placement()) -> list[tuple[float, bool]]:
    """(log-likelihood, greedy) of each request's continuation under `model` (its `logits(ids)`); call on
    every rank, each scores its share and every rank gets all the results."""
    device, autocast, rank, world, sharded = (placement.device, placement.autocast, placement.rank, placement.world,
                                              placement.sharded)
    order = sorted(range(len(requests)), key=lambda i: -len(requests[i][0]) - len(requests[i][1]))
    mine = order[rank::world]
    batches = math.ceil(math.ceil(len(requests) / world) / batch_size) if sharded else math.ceil(len(mine) / batch_size)
    results = torch.zeros(len(requests), 2, dtype=torch.float64)
    was_training = model.training
    model.eval()
    try:
        for b in range(batches):
            chunk = mine[b * batch_size:(b + 1) * batch_size]
            inputs = [model_input(*requests[i], max_length) for i in chunk] or [[0]]  # [[0]]: a sharded rank's turn
            width = max(map(len, inputs))
            ids = torch.tensor([x + [0] * (width - len(x)) for x in inputs], device=device)
            with autocast():
                logits = model.logits(ids)
            scores = []
            for row, i in enumerate(chunk):
                continuation = requests[i][1]
                end = len(inputs[row])
                scored = logits[row, end - len(continuation):end].float().log_softmax(-1)
                target = torch.tensor(continuation, device=scored.device)
                scores.append(torch.stack([scored.gather(1, target[:, None]).sum(),
                                           (scored.argmax(-1) == target).all().float()]))
            if chunk:
                results[chunk] = torch.stack(scores).double().cpu()  # one device sync per batch
    finally:
        model.train(was_training)
    if world > 1:
        import torch.distributed as dist

        on_device = results.to(device)
        dist.all_reduce(on_device)  # each request was scored by one rank; the others hold 0
        results = on_device.cpu()
    return [(float(ll), bool(greedy)) for ll, greedy in results.tolist()]


def task_metrics(task: Task, results: list[tuple[float, bool]]) -> dict[str, float]:
    """The task's metrics from its requests' results (in `RequestEncoder.task_requests` order)."""
    if task.kind == CLOZE:
        lls = [ll for ll, _ in results]
        return {"acc": float(np.mean([greedy for _, greedy in results])), "ppl": math.exp(-float(np.mean(lls)))}
    acc = acc_norm = 0.0
    start = 0
    for example in task.examples:
        lls = np.array([ll for ll, _ in results[start:start + len(example.choices)]])
        start += len(example.choices)
        acc += float(np.argmax(lls) == example.gold)
        acc_norm += float(np.argmax(lls / np.array([float(len(c)) for c in example.choices])) == example.gold)
    return {"acc": acc / len(task.examples), "acc_norm": acc_norm / len(task.examples)}


def per_example_loglikelihoods(task: Task, results: list[tuple[float, bool]]) -> list[list[float]]:
    """Each example's log-likelihoods, one per choice (a cloze: one)."""
    out, start = [], 0
    for example in task.examples:
        out.append([ll for ll, _ in results[start:start + len(example.choices)]])
        start += len(example.choices)
    return out
