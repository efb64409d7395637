"""`optimizer=muon`: torch's Muon (torch.optim.Muon: Nesterov momentum, 5 Newton-Schulz steps, Keller
Jordan's coefficients) for the 2-D weight matrices of the transformer blocks, and AdamW for the rest
(embeddings, the LM head, norms and biases), in one optimizer object.

Newton-Schulz precision (`muon_ns_dtype`): torch runs the iteration in bfloat16, always. Here `bf16` is
torch's own function (bitwise torch.optim.Muon) and the default of every mixed-precision run
(`mixed_precision` bf16 / fp16 / fp8: the GPU runs, where bf16 matmuls are the fast ones); `fp32` runs the
same iteration (same coefficients, same operations) in float32 and is the default of fp32 runs
(`mixed_precision=no`: the CPU presets and the tests). Why: rounding the update to bf16 (2^-8 relative)
turns a difference in the gradients' last fp32 bits (sums in another order: 1 process, DDP's all-reduce,
FSDP's reduce-scatter) into a bf16 rounding flip of whole elements, so fp32 runs on 1 process, 2 DDP
ranks and 2 FSDP ranks agreed only to ~1e-5; in fp32 they agree to 1e-6 (tests/unit/training/test_muon.py). Cost: the
fp32 iteration's matmuls, ~15 per matrix per step, at fp32 speed (on a GPU ~2x bf16's time for them; on
the CPU, where bf16 matmuls are not faster, about the same).

The learning rate is matched to AdamW's update size as torch offers (`adjust_lr_fn="match_rms_adamw"`,
Moonlight: each matrix's update is scaled by 0.2 * sqrt(max(rows, cols)), so an orthogonalised update has
AdamW's RMS of about 0.2): Muon's matrices and AdamW's parameters share the run's `learning_rate`, its
schedule and `weight_decay` (decoupled, as torch's Muon: p *= 1 - lr * wd).

One object, one state dict: the groups are AdamW's (the AdamW the run would use otherwise: torch's, fused
on CUDA, or BF16MomentAdamW) followed by Muon's, and the state is one table keyed by parameter, so
`state_dict()` / `load_state_dict()` are torch's own (the checkpoint formats, DCP's sharded one included,
save and restore it unchanged, and a resumed run is bitwise the uninterrupted one). Muon's state is one
momentum buffer per matrix (half of AdamW's two moments), in `optimizer_state_dtype`.

Under FSDP2 each matrix is a DTensor sharded by rows. The momentum is updated on the local shard; the
Newton-Schulz iteration needs the whole matrix, so each rank gathers it (`DTensor.full_tensor()`, an
all-gather of the momentum-blended update), orthogonalises it and keeps its own rows of the result
(`distribute_tensor(..., src_data_rank=None)`: a local slice, no communication). Communication: one
all-gather of every Muon matrix per optimizer step, in the gradients' dtype: (world - 1) / world of the
blocks' matrix bytes received per rank, the same volume as FSDP's forward all-gather of those weights
(about 1/3 more traffic per step than FSDP with AdamW: forward + backward all-gather and reduce-scatter);
every rank also does the whole Newton-Schulz FLOPs (5 x ~3 matmuls of the matrix's size: small next to a
step's forward and backward at the 1.2B shape and batch). Giving whole matrices to ranks in turn
(Moonlight, Dion) would split that compute; not done here.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

from utils.training.optim import MUON_SCALES, OptimizerSettings, adamw
from utils.training.optim.adamw import state_dtype as adamw_state_dtype

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's defaults
NS_STEPS, NS_EPS = 5, 1e-7
NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def ns_dtype_for(muon_ns_dtype: str, mixed_precision: str) -> torch.dtype:
    """`auto`: float32 for fp32 runs (mixed_precision=no), bfloat16 (torch's) otherwise."""
    if muon_ns_dtype == "auto":
        return torch.float32 if mixed_precision in ("no", False) else torch.bfloat16
    return NS_DTYPES[muon_ns_dtype]


def newton_schulz(grad: torch.Tensor, ns_coefficients, ns_steps: int, eps: float,
                  dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """torch.optim.Muon's Newton-Schulz orthogonalisation in `dtype`: bfloat16 is torch's own function;
    another dtype runs the same operations in that dtype (on a copy: `grad` is left as it is)."""
    if dtype == torch.bfloat16:
        return _zeropower_via_newtonschulz(grad, ns_coefficients, ns_steps, eps)
    a, b, c = ns_coefficients
    x = grad.to(dtype, copy=True)
    if grad.size(0) > grad.size(1):
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram = x @ x.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, gram_update, x, beta=a)
    if grad.size(0) > grad.size(1):
        x = x.T
    return x


def build(model: nn.Module, settings: OptimizerSettings, fused: bool) -> MuonWithAdamW:
    """Muon for the blocks' weight matrices, the AdamW `optimizer=adamw` would be for everything else."""
    muon = muon_parameters(model)
    rest = adamw.build(model, settings, fused, skip=frozenset(id(p) for p in muon))
    return MuonWithAdamW(muon, rest, settings)


def muon_parameters(model: nn.Module) -> list[torch.Tensor]:
    """The matrices Muon takes: what the model names (`muon_parameters()`, the engine's model interface: its
    family's blocks' projection and MLP matrices); everything else stays with AdamW."""
    core = getattr(model, "module", model)  # a DDP wrapper's model
    return core.muon_parameters()


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon for `muon_params`, the given `adamw` optimizer for its own parameters (see the module
    docstring). `param_groups`: AdamW's groups, then one Muon group (`"muon": True`)."""

    def __init__(self, muon_params: list[torch.Tensor], adamw: torch.optim.Optimizer, settings: OptimizerSettings):
        self.adamw = adamw
        self.state_dtype = adamw_state_dtype(settings)
        # Newton-Schulz's (module docstring); not in the state dict: a run's setting
        self.ns_dtype = ns_dtype_for(settings.muon_ns_dtype, settings.mixed_precision)
        lr = settings.learning_rate
        muon_group = dict(params=list(muon_params), lr=lr, weight_decay=settings.weight_decay,
                          momentum=settings.muon_momentum, nesterov=True, ns_coefficients=NS_COEFFICIENTS,
                          eps=NS_EPS, ns_steps=NS_STEPS, adjust_lr_fn=MUON_SCALES[settings.muon_scale],
                          cautious=settings.cautious_weight_decay, muon=True)
        super().__init__([muon_group], dict(lr=lr))
        self.param_groups = list(adamw.param_groups) + self.param_groups
        self._link()

    def _link(self) -> None:
        """The AdamW shares this object's groups (its own first) and state table."""
        n = len(self.adamw.param_groups)
        self.adamw.param_groups = self.param_groups[:n]
        self.adamw.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)  # new group dicts and state table: linked again
        self._link()
        if isinstance(self.adamw, adamw.BF16MomentAdamW):
            for group in self.adamw.param_groups:  # its moments back to bfloat16, as its own load does
                for p in group["params"]:
                    for key in ("exp_avg", "exp_avg_sq"):
                        if key in self.state.get(p, {}):
                            self.state[p][key] = self.state[p][key].to(torch.bfloat16)
        for group in self.param_groups:
            if group.get("muon"):
                for p in group["params"]:
                    if "momentum_buffer" in self.state.get(p, {}):
                        buf = self.state[p]["momentum_buffer"]
                        self.state[p]["momentum_buffer"] = buf.to(self.state_dtype)

    def muon_state_bytes(self) -> int:
        """Bytes of Muon's momentum buffers this rank holds (or will hold: one per matrix shard)."""
        from utils.runtime.distributed import local_tensor

        size = torch.empty((), dtype=self.state_dtype).element_size()
        return sum(local_tensor(p).numel() * size for g in self.param_groups if g.get("muon") for p in g["params"])

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.adamw.step()
        for group in self.param_groups:
            if group.get("muon"):
                self._muon_step(group)
        return loss

    def _muon_step(self, group: dict) -> None:
        """torch.optim.Muon's single-tensor step (the same operations in the same order), with the whole
        matrix gathered for Newton-Schulz when it is a DTensor shard."""
        lr, wd, momentum = group["lr"], group["weight_decay"], group["momentum"]
        for p in group["params"]:
            if p.grad is None:
                continue
            grad = p.grad
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(grad, dtype=self.state_dtype)
            buf = state["momentum_buffer"]
            if buf.dtype == grad.dtype:
                buf.lerp_(grad, 1 - momentum)
                blended = buf
            else:  # bf16 momentum: blended in fp32, stored rounded
                blended = buf.to(grad.dtype).lerp_(grad, 1 - momentum)
                buf.copy_(blended)
            update = grad.lerp(blended, momentum) if group["nesterov"] else blended
            update = _orthogonalise(update, group, self.ns_dtype)
            adjusted_lr = _adjust_lr(lr, group["adjust_lr_fn"], p.shape)
            if group.get("cautious"):  # decay only where the step moves the weight towards zero as well
                p.mul_(1 - (lr * wd) * (update * p >= 0).to(p.dtype))
            else:
                p.mul_(1 - lr * wd)
            p.add_(update, alpha=-adjusted_lr)


def _orthogonalise(update: torch.Tensor, group: dict, dtype: torch.dtype) -> torch.Tensor:
    """Newton-Schulz of the whole matrix in `dtype`; a DTensor shard is gathered and its own rows kept."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    args = (group["ns_coefficients"], group["ns_steps"], group["eps"], dtype)
    if not isinstance(update, DTensor):
        return newton_schulz(update, *args)
    full = newton_schulz(update.full_tensor(), *args).to(update.dtype)
    return distribute_tensor(full, update.device_mesh, update.placements, src_data_rank=None)
