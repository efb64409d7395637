"""What a run says about itself: the lines that describe it before step 1 (`describe_run`) and, every
`logging_steps` optimizer steps and at the last, the step line and its metrics row (`StepReporter`)."""
from __future__ import annotations

from dataclasses import dataclass

from configs.profiles import GB
from configs.training_config import precision_name
from utils.observe.metrics import format_step_line, startup_line
from utils.runtime.threads import describe as describe_threads
from utils.settings import Settings


@dataclass(frozen=True)
class ReportSettings(Settings):
    """What the lines describing a run before its first step say of its config."""

    preset: str
    effective_run_name: str
    mixed_precision: str
    compile_model: bool
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    max_steps: int
    optimizer: str
    optimizer_state_dtype: str
    background_upload: bool


def describe_run(settings: ReportSettings, run) -> None:
    """The lines before step 1: the model and precision, the per-rank state, Muon's Newton-Schulz work per rank,
    the batch and data, the memory profile, where checkpoints go. `run`: the Trainer (its parallelism, model,
    optimizer, loader, state and log)."""
    parallel, log, core, loader, state = run.parallel, run.log, run.core, run.loader, run.state
    world = parallel.accelerator.num_processes
    global_batch = loader.global_batch * settings.gradient_accumulation_steps
    log.info(f"Training {settings.preset} ({settings.effective_run_name}): model {run.spec.name} "
             f"({core.parameter_counts()[0] / 1e6:.1f}M params), {world} process(es) on {parallel.device.type}, "
             f"{precision_name(settings.mixed_precision)} precision, "
             f"compile={'on' if settings.compile_model else 'off'}")
    if parallel.device.type == "cpu":
        import torch

        log.info(f"  {describe_threads(torch.get_num_threads(), sharing=getattr(run, 'sharing', None))}")
    weights = parallel.state_bytes(core)
    moments, what = optimizer_state_bytes(core, settings, weights)
    log.info(f"  strategy {parallel.name}, world size {world}: per-rank state {(2 * weights + moments) / GB:.2f} GB "
             f"(parameters {weights} bytes, as many in gradients, {moments / GB:.2f} GB {what})")
    if settings.optimizer == "muon":
        flops = getattr(run.optimizer, "optimizer", run.optimizer).newton_schulz_flops()  # fp16: accelerate's wrapper
        log.info(f"  Muon: Newton-Schulz {sum(flops) / 1e9:.4g} GFLOP a step, "
                 + (f"each rank its share: {', '.join(f'{f / 1e9:.4g}' for f in flops)} GFLOP" if len(flops) > 1
                    else "all on this process"))
    log.info(f"  batch {settings.per_device_train_batch_size} x accumulation {settings.gradient_accumulation_steps} "
             f"x {world} = {global_batch} sequences of {loader.dataset.seq_len} tokens per step; "
             f"{loader.num_samples:,} train sequences, {len(run.val_batches)} eval batches per rank; steps "
             f"{state.step} -> {settings.max_steps}")
    for line in loader.describe(settings.max_steps - state.step, global_batch):
        log.info(line)
    if run.profile is not None:
        log.info(f"  memory profile {run.profile.name}: micro-batch {settings.per_device_train_batch_size}, "
                 f"activation checkpointing {parallel.activation_checkpointing}, AdamW moments in "
                 f"{settings.optimizer_state_dtype}")
    if run.remote_root:
        log.info(f"  checkpoints upload to {run.remote_root}/ "
                 f"({'background' if settings.background_upload else 'synchronous'})")
    else:
        log.info("  no gcs_bucket configured: checkpoints stay local, nothing is uploaded")


def optimizer_state_bytes(core, settings: ReportSettings, weights: int) -> tuple[int, str]:
    """(bytes of optimizer state this rank holds, what they are): AdamW's two moments per parameter, or with
    optimizer=muon one momentum buffer per block matrix (utils/training/optim/muon.py) and AdamW's moments for
    the rest."""
    half = 2 if settings.optimizer_state_dtype == "bf16" else 1
    if settings.optimizer != "muon":
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
            self.log.info(f"  {startup_line(row)}")
        if self.window.per_device and state.step % (self.every * 10) == 0:
            self.log.info("  per-GPU memory (GiB used/peak, util%): " + "; ".join(
                f"{s['device']} {s['mem_gb']:.1f}/{s['peak_mem_gb']:.1f} {s['gpu_util']}"
                for s in self.window.per_device))
        self.bar.refresh()
