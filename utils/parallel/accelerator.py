"""The run's `Accelerator`: its processes, precision and trackers, with the device settings the engine wants
(TF32 and cuDNN autotune on CUDA; freed host memory kept in the process on the CPU: utils/runtime/host_memory.py)."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from utils.errors import UserError
from utils.settings import Settings


@dataclass(frozen=True)
class AcceleratorSettings(Settings):
    mixed_precision: str
    gradient_accumulation_steps: int
    report_to: str
    effective_run_name: str  # the trackers' run name
    process_group_timeout_s: int


def make_accelerator(settings: AcceleratorSettings, log_dir: Path):
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs

    from utils.runtime.host_memory import keep_freed_host_memory
    from utils.observe.trackers import make_trackers

    if settings.mixed_precision == "fp16" and not torch.cuda.is_available():
        raise UserError("mixed_precision=fp16 needs a CUDA GPU; use --mixed-precision bf16 or no on the CPU")
    accelerator = Accelerator(
        gradient_accumulation_steps=settings.gradient_accumulation_steps,
        # fp8: torchao's float8 Linear layers (utils/model/fp8.py) inside bf16 autocast; accelerate's own
        # fp8 backends are not used
        mixed_precision="bf16" if settings.mixed_precision == "fp8" else settings.mixed_precision,
        log_with=make_trackers(settings.report_to, settings.effective_run_name, log_dir),
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=settings.process_group_timeout_s)),
                         DistributedDataParallelKwargs(gradient_as_bucket_view=True)],
    )
    if accelerator.distributed_type.name == "FSDP":
        raise UserError("accelerate was launched with its own FSDP flags; launch plainly (start_training.sh "
                        "--strategy fsdp, or --set strategy=fsdp): the engine shards the model itself")
    if accelerator.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True
    elif accelerator.device.type == "cpu":
        keep_freed_host_memory()
    return accelerator
