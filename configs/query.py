"""`python -m configs.query FIELD --config NAME|FILE [--set KEY=VALUE ...] [--mixed-precision M]`: prints the
resolved value of one training-config field, or one `error:` line and exit 2. The launcher asks it to
check a preset name or config file before starting anything, and for the run's mixed precision.

`python -m configs.query --choices` prints the lists of choices the launcher's help shows, as shell
assignments, so each list has one home (here, beside the fields)."""
from __future__ import annotations

import argparse
import shlex
import sys

from configs.training_config import (
    MIXED_PRECISION_MODES,
    PRESETS,
    RESUME_FORMS,
    ConfigError,
    get_training_config,
    parse_overrides,
)


def resolve_field(field: str, config: str, sets: list[str], mixed_precision: str | None = None):
    overrides = parse_overrides(sets)
    if mixed_precision:
        overrides["mixed_precision"] = mixed_precision
    cfg = get_training_config(config, overrides)
    if not hasattr(cfg, field):
        raise ConfigError(f"'{field}' is not a training-config field")
    return getattr(cfg, field)


def shell_choices() -> str:
    lists = {"PRESET_CHOICES": PRESETS, "PRECISION_CHOICES": MIXED_PRECISION_MODES, "RESUME_CHOICES": RESUME_FORMS}
    return "".join(f"{name}={shlex.quote(' | '.join(values))}\n" for name, values in lists.items())


def main(argv=None) -> int:
    if argv is None and sys.argv[1:] == ["--choices"] or argv == ["--choices"]:
        print(shell_choices(), end="")
        return 0
    p = argparse.ArgumentParser(prog="python -m configs.query", description=__doc__)
    p.add_argument("field")
    p.add_argument("--config", required=True)
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--mixed-precision")
    args = p.parse_args(argv)
    try:
        print(resolve_field(args.field, args.config, args.set, args.mixed_precision))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
