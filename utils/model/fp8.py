"""`mixed_precision=fp8`: float8 matmuls through torchao's float8 training, on Hopper/Ada GPUs.

Every nn.Linear becomes a torchao Float8Linear with dynamic tensorwise scaling, except the LM head (its
loss is computed from the weight directly, in bf16: utils/model/layers.py) and any Linear whose
dimensions are not multiples of 16 (float8 matmuls need them). The weights stay plain fp32 parameters
with the same names, so checkpoints, resume, export, and switching between bf16 and fp8 on resume all
work unchanged. Everything else runs under bf16 autocast.
"""
from __future__ import annotations

import torch
from torch import nn

from utils.debug import fp8_emulated


def fp8_supported(device: torch.device) -> tuple[bool, str]:
    """(True, "") on CUDA devices with float8 tensor cores (compute capability >= 8.9), else why not."""
    if fp8_emulated():
        return True, ""
    if device.type != "cuda":
        return False, (f"mixed_precision=fp8 needs an NVIDIA Hopper or Ada GPU (float8 tensor cores); this run is on "
                       f"{device.type}: use --mixed-precision bf16")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return False, (f"mixed_precision=fp8 needs float8 tensor cores (compute capability >= 8.9: H100, H200, "
                       f"L4, RTX 4090); {torch.cuda.get_device_name(device)} is {major}.{minor}: use "
                       f"--mixed-precision bf16")
    return True, ""


def _eligible(module: nn.Module, fqn: str) -> bool:
    return (isinstance(module, nn.Linear) and not fqn.endswith("lm_head")
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)


def enable_fp8(model: nn.Module, fsdp: bool = False) -> int:
    """Converts the eligible Linear layers in place; returns how many. Under FSDP2 the weights are
    all-gathered in float8 (torchao's `enable_fsdp_float8_all_gather`), half the bytes of bf16; the scales
    are then precomputed once per optimizer step (`after_optimizer_step`)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    count = sum(_eligible(m, name) for name, m in model.named_modules())
    config = Float8LinearConfig(emulate=fp8_emulated(), enable_fsdp_float8_all_gather=fsdp)
    convert_to_float8_training(model, config=config, module_filter_fn=_eligible)
    return count


def after_optimizer_step(model: nn.Module) -> None:
    """With float8 all-gather under FSDP2: every float8 weight's scale for the next step, in one
    all-reduce instead of one per layer (torchao's recommendation)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)
