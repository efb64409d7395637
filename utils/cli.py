"""The entry points' command lines: `CommandLine`, argparse with one-line errors, and `number_flag`, the type of
every numeric flag (utils/settings.py's one numeric parsing: a whole number below 2^63, a finite number).

A mistake on a command line is one line, `error: argument --temperature: must be a finite number, got nan; generate.py
--help lists the options`, exit 2, as every other bad input of the project; argparse's own printed its whole usage
first, several lines of it.
"""
from __future__ import annotations

import argparse

from utils.settings import Bounds, parse_number


class CommandLine(argparse.ArgumentParser):
    """argparse's parser, its errors in one line (exit 2)."""

    def error(self, message: str):
        self.exit(2, f"error: {message}; {self.prog} --help lists the options\n")


def number_flag(kind: str, interval: str | None = None, special: dict | None = None):
    """An argparse `type=` for a numeric flag: `parse_number` of `kind` ("int" or "float") within `interval` (see
    Bounds), its words in the parser's error line (`argument --workers: must be below 2^63, ...`)."""
    bounds = Bounds(interval, special) if interval else None

    def parse(text: str):
        try:
            return parse_number(text, kind, bounds)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = kind  # argparse names the type in its messages
    return parse
