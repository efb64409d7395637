"""How the model is spread over the processes, decided once per run.

- `strategies`: the parallelism seam: DDP and FSDP2 strategy objects (the build order, clipping, the whole
  model's weights for export, whether the ranks agree);
- `accelerator`: the run's Accelerate object (processes, precision, trackers).

May import: utils, utils.io, utils.runtime, utils.observe, utils.training, configs, utils.data,
utils.checkpoint, utils.model.
"""
