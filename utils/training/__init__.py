"""The training loop's own parts, each with its typed settings; nothing here reads the run's whole config.

- `optim`: the optimizer registry (`optimizer=`): `adamw` (with bf16 moments), `muon` (torch's Muon for the
  blocks' matrices, AdamW for the rest; across ranks each orthogonalises its share of the matrices);
- `schedules`: the LR schedule registry (`lr_schedule=`, `decay_shape=`), plain functions of the step;
- `lr_scheduler`: the scheduler that applies them once per optimizer step;
- `spike_guard`: the loss-spike guard (warn, skip, rollback);
- `weight_average`: an average of the weights over the end of a run (tail, ema);
- `state`: TrainState (step, tokens) and RngState.

May import: utils, utils.io, utils.runtime.
"""
