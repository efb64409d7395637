"""Checkpoints: what a run saves, where, and how `--resume` finds it again.

- `checkpointer`: the Checkpointer, everything the training loop does with checkpoints in one object (when
  a save is due, saving, retention, the uploads, closing);
- `format`: the local checkpoint directory (atomic, with a crc32c manifest), verification, reading, retention;
- `run_record`: what a checkpoint says about the run that wrote it (`trainer_state.json`), checked on resume;
- `sharded`: sharded model and optimizer state (`strategy=fsdp`) through `torch.distributed.checkpoint`;
- `writer`: the background thread that writes checkpoints while training goes on;
- `upload`: the background thread that sends finished checkpoints to GCS;
- `resume`: a `--resume` value -> a verified local checkpoint (downloading one from GCS if need be);
- `compile_cache`: the compiled code a checkpoint carries, so a restart on a new machine skips the compile.

May import: utils, utils.io, utils.runtime, utils.training, configs, utils.data.
"""
