"""A component's typed settings: a frozen dataclass of the fields of the run's one configuration it reads.

The user-facing configuration stays one flat set of fields (configs/training_config.py: YAML files, `--set`,
`--help`); each component declares the fields it reads, by the same names and types, as a `Settings`
subclass, and is built from `Settings.of(config)`. Only configs/ and the Trainer's construction hold the
whole configuration; every other module sees its own fields (tests/test_architecture.py checks both sides).

Also the one numeric parsing every setting and every command-line number goes through (`Bounds`,
`parse_number`; utils/cli.py's `number_flag` for flags): an integer lies below 2^63 (int64, as torch and numpy
hold it) and a float is finite, whatever the entry point, so a value past what the machine holds is one line
naming the option, never an OverflowError from deep inside a run.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import TypeVar

S = TypeVar("S", bound="Settings")


@dataclasses.dataclass(frozen=True)
class Settings:
    """The base of every component's settings."""

    @classmethod
    def of(cls: type[S], config) -> S:
        """This component's fields of `config` (any object with them as attributes: the run's config)."""
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})

    def but(self: S, **changes) -> S:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)


MAX_INT = 2**63  # an integer setting lies below it in magnitude (int64, as torch and numpy hold it)


class Bounds:
    """A numeric setting's range, written as an interval ("[0, 1)", "(0, inf)", "[1, inf)"), and values outside
    it that mean something of their own ({-1: "all files"}). A float must also be finite (nan fails every
    comparison, and an open "inf)" refuses inf), an integer below 2^63 in magnitude."""

    def __init__(self, interval: str, special: dict | None = None):
        match = re.fullmatch(r"([\[(])\s*([^,\s]+)\s*,\s*([^\])\s]+)\s*([\])])", interval)
        if match is None:
            raise ValueError(f"bounds {interval!r}: expected an interval such as '[0, 1)'")
        self.interval, self.special = interval, dict(special or {})
        self.low_closed, self.low, self.high, self.high_closed = (
            match[1] == "[", float(match[2]), float(match[3]), match[4] == "]")

    def admits(self, value) -> bool:
        if value in self.special:
            return True
        if isinstance(value, int) and abs(value) >= MAX_INT:
            return False
        above = value >= self.low if self.low_closed else value > self.low
        below = value <= self.high if self.high_closed else value < self.high
        return above and below

    def rule(self, kind: str) -> str:
        """What a value must be, in words: 'at least 1', 'a finite number greater than 0', ..."""
        if self.high == math.inf:
            words = f"{'at least' if self.low_closed else 'greater than'} {self.low:g}"
        else:
            words = f"within {self.interval}"
        if kind == "float":
            words = f"a finite number {words}"
        return words + "".join(f", or {value} ({meaning})" for value, meaning in self.special.items())

    def refusal(self, value, kind: str) -> str | None:
        """None when `value` is admitted, else what it must be ("must be at least 1", "must be below 2^63")."""
        if self.admits(value):
            return None
        if isinstance(value, int) and abs(value) >= MAX_INT:
            return "must be below 2^63"
        return f"must be {self.rule(kind)}"


def shown_number(value) -> str:
    """A number as an error line shows it: an integer past 2^63 by its digit count (the line stays short)."""
    if isinstance(value, int) and abs(value) >= MAX_INT:
        return f"a number of {len(str(abs(value)))} digits"
    return str(value)


def parse_number(raw, kind: str, bounds: Bounds | None = None):
    """`raw` (a flag's or `--set`'s text, or a number from a file) -> an int or a finite float (`kind`: "int" or
    "float") within `bounds`; a ValueError whose message says what is wrong otherwise. A bool is no number."""
    if isinstance(raw, bool) or not isinstance(raw, (str, int, float)):
        raise ValueError(f"expected {'a whole number' if kind == 'int' else 'a number'}, got {type(raw).__name__}")
    if kind == "int":
        if isinstance(raw, float) and not raw.is_integer():
            raise ValueError(f"expected a whole number, got {raw!r}")
        try:
            value = int(raw)
        except (ValueError, OverflowError):  # OverflowError: a float inf
            shown = raw if len(str(raw)) <= 40 else str(raw)[:37] + "..."
            raise ValueError(f"expected a whole number, got {shown!r}") from None
        if abs(value) >= MAX_INT:
            raise ValueError(f"must be below 2^63, got {shown_number(value)}")
    else:
        try:
            value = float(raw)
        except (ValueError, OverflowError):  # OverflowError: an int past a float's range
            shown = raw if len(str(raw)) <= 40 else str(raw)[:37] + "..."
            raise ValueError(f"expected a number, got {shown!r}") from None
        if not math.isfinite(value):
            raise ValueError(f"must be a finite number, got {value}")
    refused = bounds.refusal(value, kind) if bounds is not None else None
    if refused:
        raise ValueError(f"{refused}, got {shown_number(value)}")
    return value
