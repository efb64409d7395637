"""The demo's own downstream task: given a few lines of a Python standard-library file, pick the true next
line among 4, the other 3 being that line with its words shuffled (indentation kept). A plain
multiple_choice task file (utils/evals/tasks.py).

Built from the standard-library files the demo corpus leaves out (utils/data/demo.py takes its fixed
shuffled order until CORPUS_BYTES; these are the files after that), so the demo model never trained on
them; deterministic for a given Python installation and seed. The context ends with a newline and the
choices follow it directly (`target_delimiter` ""). The choices hold the same words, so they are about as
long in characters and tokens: a model that knows nothing of Python (the untrained one) scores about 0.25
on `acc` and `acc_norm`, one that has learnt its syntax picks the line as written. Distractors drawn from
other lines were tried: the demo model's 400 steps leave it near chance between real lines of the same
file, and lines of other files differ in length enough that the untrained model beats chance on them.
"""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from utils.io import files
from utils.data.demo import CORPUS_BYTES, read_stdlib_corpus

CHOICES = 4
CONTEXT_LINES = 6
PER_FILE = 4  # examples from one file at most: the task samples many files
LINE_CHARS = (10, 100)  # a line's length without its indentation, and with it: no trivial or huge lines
MIN_WORDS = 3


def held_out_stdlib_files() -> list[tuple[str, str]]:
    """(name, text) of the standard-library files outside the demo corpus, in the demo's order."""
    in_corpus, _ = read_stdlib_corpus(CORPUS_BYTES)
    names, texts = read_stdlib_corpus(sys.maxsize)  # the same order, to the end
    return list(zip(names, texts))[len(in_corpus):]


def shuffled_versions(line: str, rng: random.Random, count: int) -> list[str]:
    """`count` different arrangements of the line's words other than its own (fewer if there are none)."""
    indent, words = line[:len(line) - len(line.lstrip())], line.split()
    seen = {line}
    for _ in range(20 * count):
        rng.shuffle(words)
        seen.add(indent + " ".join(words))
        if len(seen) > count:
            break
    seen.discard(line)
    return sorted(seen)[:count]


def next_line_examples(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    examples = []
    for _, text in held_out_stdlib_files():
        lines = text.split("\n")
        targets = [i for i in range(CONTEXT_LINES, len(lines)) if len(lines[i]) <= LINE_CHARS[1]
                   and len(lines[i].strip()) >= LINE_CHARS[0] and len(lines[i].split()) >= MIN_WORDS]
        rng.shuffle(targets)
        for i in targets[:PER_FILE]:
            choices = shuffled_versions(lines[i], rng, CHOICES - 1)
            if len(choices) < CHOICES - 1:
                continue
            gold = rng.randrange(CHOICES)
            choices.insert(gold, lines[i])
            examples.append({"context": "\n".join(lines[i - CONTEXT_LINES:i]) + "\n", "choices": choices,
                             "gold": gold, "target_delimiter": ""})
            if len(examples) == count:
                return examples
    return examples


def build_next_line_task(path, count: int = 500, seed: int = 0) -> int:
    """Writes `count` examples (fewer if the held-out files run out) as a multiple_choice task file (JSON
    Lines) at `path`, atomically; returns how many."""
    examples = next_line_examples(count, seed)
    files.write_text(Path(path), "".join(json.dumps(e) + "\n" for e in examples))
    return len(examples)
