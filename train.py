#!/usr/bin/env python
"""Pretrain GPT-NeoX (or a Llama-style model) with a hand-written loop over HuggingFace Accelerate.

`main()` settles the config and catches the errors a user fixes; `train()` hands the settled config and the
command line to the Trainer (utils/run/trainer.py), which assembles the run, each part from its own typed
settings, and runs the loop: forward, backward, the optimizer step and the stop vote, with every observer
(the metrics window, the progress bar, the step report, evaluation, the spike guard, the hang watchdog, the
checkpoint policy) a callback on one seam (utils/run/callbacks.py). The engine's imports wait for train() on
purpose: `--help`, `--print-config` and a config error answer without loading torch, and a stop signal during
those imports is already caught (main's catch_early).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

PROCESS_STARTED = time.perf_counter()  # time to first step counts from here
REPO_ROOT = Path(__file__).resolve().parent

from configs.settle import explicit_fields, settle_config
from configs.training_config import MIXED_PRECISION_MODES, PRESETS, RESUME_FORMS, describe_fields, to_yaml
from utils.cli import CommandLine
from utils.errors import BackgroundFailure, UserError
from utils.io.console import survive_lost_console
from utils.runtime.run_status import RunStatus, rank_zero
from utils.runtime.signals import StoppedInSetup, catch_early, watch_supervisor
from utils.runtime.threads import settle_wait


def parse_args(argv=None) -> argparse.Namespace:
    p = CommandLine(
        description="Pretrain GPT-NeoX (see README.md).", formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="training-config fields (--set KEY=VALUE, or KEY: VALUE in a --config file), with defaults:\n"
               + describe_fields())
    p.add_argument("--config", required=True, metavar="NAME|FILE",
                   help=f"a preset ({' | '.join(PRESETS)}: configs/presets/) or a .yaml/.json file of fields "
                        "(`base: PRESET` starts it from a preset)")
    p.add_argument("--max-steps", type=int, help="optimizer steps to train to (overrides the preset)")
    p.add_argument("--output-dir", help="where checkpoints/, logs/ and final_model/ go (default: runs/RUN_NAME/ in "
                                        "the repo, RUN_NAME being run_name or the preset's name)")
    p.add_argument("--data-dir", help="local shard directory (overrides the preset's data_dir)")
    p.add_argument("--resume", help=" | ".join(RESUME_FORMS) + " (auto: the newest checkpoint if there is one, "
                                    "else a fresh start)")
    p.add_argument("--mixed-precision", choices=MIXED_PRECISION_MODES)
    p.add_argument("--no-background-upload", action="store_true", help="upload checkpoints synchronously")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any training-config field (repeatable); the list is below")
    p.add_argument("--print-config", action="store_true", help="print the resolved config (after the memory "
                                                                "profile) as YAML and exit")
    return p.parse_args(argv)


def cli_aliases(args) -> dict:
    """The command-line flags that are shorthands for config fields."""
    return {"max_steps": args.max_steps, "data_dir": args.data_dir, "mixed_precision": args.mixed_precision,
            "background_upload": False if args.no_background_upload else None}


def main(argv=None) -> int:
    settle_wait()  # how CPU threads wait: before torch (and its OpenMP runtime) is imported
    survive_lost_console()  # a console gone (`| tee` and Ctrl-C, a killed launcher) never stops the run
    catch_early()  # from the start: a stop signal during setup (imports, data index, build) ends it cleanly
    watch_supervisor()  # under the launcher: stop as on SIGTERM once it is gone
    try:
        args = parse_args(argv)
    except SystemExit as exc:  # --help: nothing to run, and the launcher's record says it ended as it should
        if exc.code == 0:
            RunStatus(0).write()
        raise
    try:
        cfg, profile = settle_config(args.config, args.set, cli_aliases(args))
        if args.print_config:
            print(to_yaml(cfg), end="")
            for line in cfg.warnings():
                print(line, file=sys.stderr)
            RunStatus(0).write()
            return 0
        return train(cfg, profile, args)
    except StoppedInSetup as exc:
        if rank_zero():
            print(f"Stopped: {exc}", flush=True)
        RunStatus(0, stopped_by=exc.reason).write()
        return 0
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        RunStatus(2, error=str(exc)).write()
        return 2
    except BackgroundFailure as exc:  # a background thread failed or died: its one line, exit 1
        print(f"error: {exc}", file=sys.stderr)
        RunStatus(1, error=str(exc)).write()
        return 1
    finally:  # on every exit path: a gloo/NCCL group left alive can crash or hang the interpreter's exit
        dist = sys.modules.get("torch.distributed")  # none to close unless train() got as far as importing torch
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def train(cfg, profile, args) -> int:
    """The run: the Trainer (utils/run/trainer.py) built from the settled config and the command line."""
    from utils.run.output_dir import default_output_dir
    from utils.run.trainer import RunOptions, Trainer

    output_dir = Path(args.output_dir or default_output_dir(cfg.effective_run_name, REPO_ROOT))
    options = RunOptions(output_dir, args.resume, output_dir_given=args.output_dir is not None,
                         started=PROCESS_STARTED, explicit=explicit_fields(args.config, args.set, cli_aliases(args)))
    return Trainer(cfg, profile, options).run()


if __name__ == "__main__":
    from utils.runtime.distributed import exit_process

    exit_process(main)  # no interpreter finalization: gloo's threads may outlive it (exit_process says why)
