"""A component's typed settings: a frozen dataclass of the fields of the run's one configuration it reads.

The user-facing configuration stays one flat set of fields (configs/training_config.py: YAML files, `--set`,
`--help`); each component declares the fields it reads, by the same names and types, as a `Settings`
subclass, and is built from `Settings.of(config)`. Only configs/ and the Trainer's construction hold the
whole configuration; every other module sees its own fields (tests/test_architecture.py checks both sides).
"""
from __future__ import annotations

import dataclasses
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
