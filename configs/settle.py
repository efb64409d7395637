"""The one place a run's config is settled, before anything trains: a preset or a config file, then
`--set` overrides, then the command line's shorthand flags, then the memory profile for this device."""
from __future__ import annotations

import os

from configs.profiles import MemoryProfile, resolve_profile
from configs.training_config import (
    TrainingConfig,
    coerce_flag,
    get_training_config,
    is_config_file,
    parse_overrides,
    read_config_file,
)


def local_device() -> tuple[str, float | None]:
    """("cuda", GiB of this process's GPU) or ("cpu", None), without creating a CUDA context elsewhere."""
    import torch

    if os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes") or not torch.cuda.is_available():
        return "cpu", None
    index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    return "cuda", torch.cuda.get_device_properties(index).total_memory / 2**30


def settle_config(config: str, sets: list[str], aliases: dict,
                  device: tuple[str, float | None] | None = None) -> tuple[TrainingConfig, MemoryProfile | None]:
    """`config`: a preset name or a .yaml/.json file; `sets`: ["KEY=VALUE", ...]; `aliases`: field -> value
    from shorthand flags (None: not given), parsed as `--set` values are. Returns the config to train with and
    the profile applied."""
    flags = {k: coerce_flag(k, v, "--" + k.replace("_", "-")) for k, v in aliases.items() if v is not None}
    overrides = parse_overrides(sets) | flags
    cfg = get_training_config(config, overrides)
    device_type, device_gib = device or local_device()
    return resolve_profile(cfg, device_type, device_gib, world_size=int(os.environ.get("WORLD_SIZE", "1")))


def explicit_fields(config: str, sets: list[str], aliases: dict) -> frozenset[str]:
    """The fields this command sets itself: `--set`, the shorthand flags and a config file's own fields (not
    its base preset's). A resume keeps the checkpoint's recipe for the others (training_config.keep_recipe)."""
    own = read_config_file(config)[2] if is_config_file(config) else {}
    return frozenset(parse_overrides(sets)) | {k for k, v in aliases.items() if v is not None} | frozenset(own)
