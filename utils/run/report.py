"""What a run says about itself: the lines that describe it before step 1 (`describe_run`) and, every
`logging_steps` optimizer steps and at the last, the step line and its metrics row (`StepReporter`)."""
from __future__ import annotations

from configs.profiles import GB
from configs.training_config import precision_name
from utils.observe.metrics import format_step_line


def describe_run(cfg, parallel, log, profile, spec, core, loader, eval_batches: int, state,
                 remote_root: str | None) -> None:
    world = parallel.accelerator.num_processes
    global_batch = loader.global_batch * cfg.gradient_accumulation_steps
    log.info(f"Training {cfg.preset} ({cfg.effective_run_name}): model {spec.name} "
             f"({core.parameter_counts()[0] / 1e6:.1f}M params), {world} process(es) on {parallel.device.type}, "
             f"{precision_name(cfg.mixed_precision)} precision, compile={'on' if cfg.compile_model else 'off'}")
    weights = parallel.state_bytes(core)
    moments, what = optimizer_state_bytes(core, cfg, weights)
    log.info(f"  strategy {parallel.name}, world size {world}: per-rank state {(2 * weights + moments) / GB:.2f} GB "
             f"(parameters {weights} bytes, as many in gradients, {moments / GB:.2f} GB {what})")
    log.info(f"  batch {cfg.per_device_train_batch_size} x accumulation {cfg.gradient_accumulation_steps} x {world} "
             f"= {global_batch} sequences of {loader.dataset.seq_len} tokens per step; {loader.num_samples:,} train "
             f"sequences, {eval_batches} eval batches per rank; steps {state.step} -> {cfg.max_steps}")
    for line in loader.describe(cfg.max_steps - state.step, global_batch):
        log.info(line)
    if profile is not None:
        log.info(f"  memory profile {profile.name}: micro-batch {cfg.per_device_train_batch_size}, activation "
                 f"checkpointing {parallel.activation_checkpointing}, AdamW moments in {cfg.optimizer_state_dtype}")
    if remote_root:
        log.info(f"  checkpoints upload to {remote_root}/ ({'background' if cfg.background_upload else 'synchronous'})")
    else:
        log.info("  no gcs_bucket configured: checkpoints stay local, nothing is uploaded")


def optimizer_state_bytes(core, cfg, weights: int) -> tuple[int, str]:
    """(bytes of optimizer state this rank holds, what they are): AdamW's two moments per parameter, or with
    optimizer=muon one momentum buffer per block matrix (utils/training/optim/muon.py) and AdamW's moments for the rest."""
    half = 2 if cfg.optimizer_state_dtype == "bf16" else 1
    if cfg.optimizer != "muon":
        return 2 * weights // half, "AdamW moments"
    from utils.runtime.distributed import local_tensor
    from utils.training.optim.muon import muon_parameters

    matrices = sum(local_tensor(p).numel() * local_tensor(p).element_size() for p in muon_parameters(core))
    return (2 * (weights - matrices) + matrices) // half, f"optimizer state (Muon momentum for {matrices} bytes of " \
                                                          f"block matrices, AdamW moments for the rest)"


class StepReporter:
    """Every `every` optimizer steps and at the last one: the spike guard's review of the window (warn), the
    window's row (MetricsWindow.row: loss, rates, memory) with the step's LR and each source's tokens to
    metrics.jsonl and the trackers, the step line to the console and training.log; the first row also says
    the time to the first step, every tenth the memory of each GPU."""

    def __init__(self, every: int, log, window, lr_at, loader, guard, bar):
        self.every, self.log, self.window, self.lr_at = every, log, window, lr_at
        self.loader, self.guard, self.bar = loader, guard, bar

    def log_if_due(self, state, grad_norm, last: bool) -> None:
        if state.step % self.every and not last:
            return
        self.guard.review()  # warn: this window's steps
        row = self.window.row(state.step, state.tokens, self.lr_at(state.step), grad_norm) | self.loader.source_tokens()
        state.best_loss = min(state.best_loss, row["loss"])
        self.log.write_row(row)
        self.bar.clear()
        self.log.info(format_step_line(row, state.best_loss))
        if "first_step_s" in row:
            self.log.info(f"  time to first step: {row['first_step_s']:.1f} s from the process start (imports, data "
                          f"index, model build, compile)")
        if self.window.per_device and state.step % (self.every * 10) == 0:
            self.log.info("  per-GPU memory (GiB used/peak, util%): " + "; ".join(
                f"{s['device']} {s['mem_gb']:.1f}/{s['peak_mem_gb']:.1f} {s['gpu_util']}" for s in self.window.per_device))
        self.bar.refresh()
