"""Downstream task files: local JSON Lines, each record one example, read into what gets scored.

Two kinds of task, scored as lm-evaluation-harness scores its own (utils/evals/scoring.py):
- multiple choice: a context, N choices and the gold index. Choice i is the continuation
  `target_delimiter + choice` of the context (lm-eval's `multiple_choice` output type; its delimiter " "
  by default). Metrics `acc` and `acc_norm`.
- cloze: a context and the target that follows it, as LAMBADA (lm-eval's `loglikelihood` output type).
  Metrics `acc` (the target is the greedy continuation, every token of it) and `ppl`.

Layouts, told apart by the first record's fields (every record of the file must then have them); each
published one becomes exactly what lm-eval's task of that name builds from it (context / choices / gold):
- hellaswag {activity_label, ctx_a, ctx_b, endings, label}: preprocess(activity_label + ": " + ctx_a + " "
  + ctx_b.capitalize()) / preprocess(ending) for each / label (`hellaswag_preprocess`, lm-eval's)
- piqa {goal, sol1, sol2, label or the labels file}: "Question: " + goal + "\\nAnswer:" / [sol1, sol2] / label
- arc {question: {stem, choices: [{text, label}]}, answerKey}: "Question: " + stem + "\\nAnswer:" / the texts
  / the index of answerKey among the labels
- lambada {text}: the words but the last (split on " ") / " " + the last word (a cloze)
- multiple_choice {context, choices, gold, target_delimiter?}: as given (target_delimiter " " unless given)
- cloze {context, target}: as given (the target carries its own leading space)

Published files: HellaSwag's `hellaswag_val.jsonl` (rowanz/hellaswag); PIQA's `valid.jsonl` with its
labels in `valid-labels.lst` beside it (the original release; records carrying their own `label`, as the
HF dataset's JSON export does, need no labels file); ARC's `ARC-Easy-Test.jsonl`, `ARC-Challenge-Dev.jsonl`,
... (AI2's ARC-V1 zip); LAMBADA's `lambada_test.jsonl` (OpenAI's, what
lm-eval's lambada_openai reads). A file is untrusted input: JSON only, nothing executed, and a bad record
is one error naming the file and the line.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from configs.training_config import task_name
from utils.errors import UserError
from utils.io import files

MULTIPLE_CHOICE, CLOZE = "multiple_choice", "cloze"
METRICS = {MULTIPLE_CHOICE: ("acc", "acc_norm"), CLOZE: ("acc", "ppl")}


class TaskFileError(UserError):
    """A task file that cannot be read as a task; the message names the file (and line) and the rule."""


@dataclass(frozen=True)
class Example:
    """One example: `context` continued by each of `choices` (a cloze has one: its target), each joined to it
    by `delimiter`; `gold` indexes the right choice."""

    context: str
    choices: tuple[str, ...]
    gold: int = 0
    delimiter: str = ""

    def requests(self) -> list[tuple[str, str]]:
        """(context, continuation) pairs, lm-eval's loglikelihood requests for this example."""
        return [(self.context, self.delimiter + choice) for choice in self.choices]


@dataclass(frozen=True)
class Task:
    name: str
    kind: str  # MULTIPLE_CHOICE | CLOZE
    layout: str
    path: Path
    examples: tuple[Example, ...]

    @property
    def metrics(self) -> tuple[str, ...]:
        return METRICS[self.kind]


class _Bad(ValueError):
    """A record breaks its layout's rule (the message says which); turned into a TaskFileError with the line."""


def _text(record: dict, key: str) -> str:
    value = record.get(key)
    if not isinstance(value, str):
        raise _Bad(f"field '{key}' must be a string, got {_kind(value)}")
    return value


def _index(value, what: str, size: int) -> int:
    """An index into `size` choices, as an int or a string of digits (HellaSwag's HF export writes "2")."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < size:
        raise _Bad(f"{what} must be an index from 0 to {size - 1}, got {value!r}")
    return value


def _choices(values, what: str) -> tuple[str, ...]:
    if not isinstance(values, list) or len(values) < 2 or not all(isinstance(v, str) and v for v in values):
        raise _Bad(f"{what} must be a list of at least 2 non-empty strings")
    return tuple(values)


def _kind(value) -> str:
    return "nothing" if value is None else type(value).__name__


def hellaswag_preprocess(text: str) -> str:
    """lm-eval's hellaswag `preprocess`: strip, WikiHow's bracketed artifacts out, double spaces halved."""
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def read_hellaswag(record: dict, _labels) -> Example:
    ctx = _text(record, "ctx_a") + " " + _text(record, "ctx_b").capitalize()
    endings = _choices(record.get("endings"), "field 'endings'")
    if record.get("label") in (None, ""):
        raise _Bad("no label (HellaSwag's test split is unlabelled); use hellaswag_val.jsonl")
    return Example(hellaswag_preprocess(_text(record, "activity_label") + ": " + ctx),
                   tuple(hellaswag_preprocess(e) for e in endings), _index(record["label"], "label", len(endings)), " ")


def read_piqa(record: dict, labels: Callable[[], list[str]]) -> Example:
    label = record.get("label")
    if label is None:
        label = labels()
    return Example(f"Question: {_text(record, 'goal')}\nAnswer:", (_text(record, "sol1"), _text(record, "sol2")),
                   _index(label, "label", 2), " ")


def read_arc(record: dict, _labels) -> Example:
    question = record.get("question")
    if not isinstance(question, dict):
        raise _Bad("field 'question' must be an object {stem, choices}")
    options = question.get("choices")
    if not isinstance(options, list) or not all(isinstance(o, dict) for o in options):
        raise _Bad("field 'question.choices' must be a list of {text, label}")
    texts = _choices([o.get("text") for o in options], "question.choices[].text")
    keys = [o.get("label") for o in options]
    answer = record.get("answerKey")
    if answer not in keys:
        raise _Bad(f"answerKey {answer!r} is not one of the choices' labels {keys}")
    return Example(f"Question: {_text(question, 'stem')}\nAnswer:", texts, keys.index(answer), " ")


def read_lambada(record: dict, _labels) -> Example:
    words = _text(record, "text").split(" ")
    if not words[-1]:
        raise _Bad("field 'text' ends with a space: it has no last word to predict")
    return Example(" ".join(words[:-1]), (" " + words[-1],))


def read_multiple_choice(record: dict, _labels) -> Example:
    choices = _choices(record.get("choices"), "field 'choices'")
    delimiter = record.get("target_delimiter", " ")
    if not isinstance(delimiter, str):
        raise _Bad(f"field 'target_delimiter' must be a string, got {_kind(delimiter)}")
    return Example(_text(record, "context"), choices, _index(record.get("gold"), "gold", len(choices)), delimiter)


def read_cloze(record: dict, _labels) -> Example:
    target = _text(record, "target")
    if not target:
        raise _Bad("field 'target' is empty")
    return Example(_text(record, "context"), (target,))


# layout: (does a first record have its fields, reader, kind); tried in this order
LAYOUTS: dict[str, tuple[Callable[[dict], bool], Callable, str]] = {
    "hellaswag": (lambda r: "ctx_a" in r and "endings" in r, read_hellaswag, MULTIPLE_CHOICE),
    "piqa": (lambda r: "goal" in r and "sol1" in r, read_piqa, MULTIPLE_CHOICE),
    "arc": (lambda r: isinstance(r.get("question"), dict) and "answerKey" in r, read_arc, MULTIPLE_CHOICE),
    "multiple_choice": (lambda r: "choices" in r and "gold" in r, read_multiple_choice, MULTIPLE_CHOICE),
    "cloze": (lambda r: "context" in r and "target" in r, read_cloze, CLOZE),
    "lambada": (lambda r: "text" in r, read_lambada, CLOZE),
}
LAYOUT_FIELDS = ("hellaswag (ctx_a, ctx_b, activity_label, endings, label), piqa (goal, sol1, sol2), arc (question "
                 "{stem, choices}, answerKey), multiple_choice (context, choices, gold), cloze (context, target), "
                 "lambada (text)")


def load_task(path, name: str | None = None, limit: int = 0) -> Task:
    """The task in `path` (its first `limit` examples; 0: all), named `name` or after the file."""
    path = Path(path).expanduser()
    name = task_name(path, name)
    try:
        lines = files.read_bytes(path).split(b"\n")  # a FIFO is refused, never waited on
    except OSError as exc:
        raise TaskFileError(f"task file {path}: cannot read it ({exc.strerror or exc})") from None
    layout = None
    examples: list[Example] = []
    labels = _Labels(path)
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        where = f"task file {path}, line {number}"
        try:
            record = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise TaskFileError(f"{where}: not UTF-8 (byte {exc.start}); save the file as UTF-8") from None
        except ValueError as exc:
            raise TaskFileError(f"{where}: not valid JSON ({exc}); a task file holds one JSON object per "
                                f"line") from None
        except RecursionError:
            raise TaskFileError(f"{where}: JSON nested too deeply to read") from None
        try:
            json.dumps(record, ensure_ascii=False).encode("utf-8")
        except (UnicodeEncodeError, RecursionError):
            raise TaskFileError(f"{where}: a string holds a lone surrogate (an escape such as \\ud800 alone), "
                                f"which is not text; fix or drop the line") from None
        if not isinstance(record, dict):
            raise TaskFileError(f"{where}: expected a JSON object, got {_kind(record)}")
        if layout is None:
            layout = next((n for n, (fits, _, _) in LAYOUTS.items() if fits(record)), None)
            if layout is None:
                raise TaskFileError(f"{where}: no known layout has the fields {sorted(record)[:6]}; use one of "
                                    f"{LAYOUT_FIELDS}")
        try:
            examples.append(LAYOUTS[layout][1](record, lambda: labels.at(len(examples))))
        except _Bad as exc:
            raise TaskFileError(f"{where} ({layout} layout): {exc}") from None
        if len(examples) == limit:
            break
    if not examples:
        raise TaskFileError(f"task file {path}: holds no examples (one JSON object per line)")
    return Task(name, LAYOUTS[layout][2], layout, path, tuple(examples))


class _Labels:
    """PIQA's published answers: FILE-labels.lst beside FILE.jsonl, one label a line, read when first needed."""

    def __init__(self, path: Path):
        self.path = path.with_name(path.name.split(".")[0] + "-labels.lst")
        self._labels: list[str] | None = None

    def at(self, i: int) -> str:
        if self._labels is None:
            try:
                self._labels = self.path.read_text(encoding="utf-8", errors="replace").split()
            except OSError:
                raise _Bad(f"no label: the record has none and {self.path} (the published answers, one a line) "
                           f"cannot be read; PIQA's test split is unlabelled") from None
        if i >= len(self._labels):
            raise _Bad(f"no label: {self.path} has only {len(self._labels)} lines")
        return self._labels[i]
