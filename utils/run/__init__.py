"""A run end to end, on top of every other layer.

- `trainer`: the Trainer (assembly from the run's config, the loop) and the callbacks on its seam;
- `output_dir`: the run's folder by default, its lock, the refusal to write over another run's files;
- `report`: the lines that describe a run before its first step;
- `export`: final_model/ (HF format) of a finished run.

May import: utils, utils.io, utils.runtime, utils.observe, utils.training, configs, utils.data,
utils.checkpoint, utils.model, utils.parallel, utils.evals.
"""
