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

Across ranks (Moonlight's distributed Muon, Dion's and torchtitan's DistMuon do the same): Newton-Schulz
needs a whole matrix, so each matrix is orthogonalised by one rank, its owner, and the ranks split the
matrices between them, balanced by Newton-Schulz's FLOPs (`assign_by_cost`: the costliest first, each to
the least-loaded rank) and done in buckets of rounds (`buckets_of`; utils/training/optim/muon_ranks.py, which
the memory plan reads too): a bucket's momentum, its exchange and orthogonalisation, its update, then the next.
- FSDP2 (each matrix a DTensor sharded by rows over the mesh): one all-to-all brings every owner the other
  ranks' rows of its matrices' momentum-blended updates, the owner orthogonalises them, a second all-to-all
  gives each rank its rows of the results. Per step a rank receives (world - 1) / world of the matrices it owns and
  1 / world of each other one: 2 (world - 1) / world^2 of the blocks' matrices, where every rank gathering
  every matrix received (world - 1) / world (the same at 2 ranks, half at 4, a quarter at 8).
- DDP (whole parameters and gradients on every rank; the strategy calls `spread_over_replicas`): every rank
  updates every momentum (its state, which checkpoints save), the owner orthogonalises, and each owner
  broadcasts its results (one buffer a bucket): every rank needs the whole update.
- One process (and any optimizer not told of replicas): every matrix here, one after another, as before.
Both carry the update in Newton-Schulz's dtype (`muon_ns_dtype`): its first operation is that cast and its
result is in that dtype, so bf16 runs send half the bytes and nothing changes in the numbers. A matrix's
result is the very tensor a single process computes, so 1 process, DDP and FSDP differ only by their
gradients' summation order, and checkpoints hold the same state (`state_dict()` unchanged; an owner is no
part of it: a resume on any world size assigns again).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

from utils.training.optim import MUON_SCALES, OptimizerSettings, adamw
from utils.training.optim.adamw import state_dtype as adamw_state_dtype
from utils.training.optim.muon_ranks import assign_by_cost, buckets_of, newton_schulz_flops, work_per_rank

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
        self.replicas = None  # DDP: the process group whose ranks hold the same parameters (spread_over_replicas)
        self._works: dict = {}  # a Muon group's parameters -> how they are spread (_Work): worked out once
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

    def spread_over_replicas(self, group=None) -> None:
        """DDP: every rank of `group` (None: all of them) holds the same parameters and gradients, so each
        orthogonalises only the matrices it owns and the others receive them (module docstring)."""
        self.replicas = group if group is not None else torch.distributed.group.WORLD
        self._works.clear()

    def _work(self, params: list[torch.Tensor]) -> _Work:
        key = tuple(map(id, params))  # the optimizer holds them: no id is reused while it lives
        if key not in self._works:
            self._works[key] = _Work(params, self.replicas)
        return self._works[key]

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

    def newton_schulz_flops(self) -> list[int]:
        """Newton-Schulz FLOPs per optimizer step of each rank that shares the work (one entry per rank; a
        single one where this process does all of it)."""
        loads = [work_per_rank(self._work(g["params"]).shapes, self._work(g["params"]).world)
                 for g in self.param_groups if g.get("muon")]
        return [sum(ranks) for ranks in zip(*loads)]

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
        """torch.optim.Muon's single-tensor step (the same operations in the same order) on this rank's part
        of each matrix, bucket by bucket, each matrix orthogonalised whole by its owner."""
        params = group["params"]
        work = self._work(params)
        args = (group["ns_coefficients"], group["ns_steps"], group["eps"], self.ns_dtype)
        for owned in work.buckets:
            owned = [[i for i in matrices if params[i].grad is not None] for matrices in owned]
            todo = [i for matrices in owned for i in matrices]
            if not todo:  # no gradients in this bucket, on any rank
                continue
            updates = {i: self._momentum_update(params[i], group, work.needs_update(i)) for i in todo}
            results = work.orthogonalise({i: u for i, u in updates.items() if u is not None}, owned,
                                         lambda u: newton_schulz(u, *args), self.ns_dtype, params[todo[0]].device)
            for i in todo:
                self._apply(params[i], results[i].to(params[i].dtype), group)

    def _momentum_update(self, p: torch.Tensor, group: dict, wanted: bool = True) -> torch.Tensor | None:
        """The momentum buffer blended with this step's gradient (kept), and, `wanted`, the Nesterov update
        made of them: this rank's rows of a sharded matrix."""
        from utils.runtime.distributed import local_tensor

        momentum, grad = group["momentum"], local_tensor(p.grad)
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad, dtype=self.state_dtype)  # a DTensor like p's
        buf = local_tensor(state["momentum_buffer"])
        if buf.dtype == grad.dtype:
            buf.lerp_(grad, 1 - momentum)
            blended = buf
        else:  # bf16 momentum: blended in fp32, stored rounded
            blended = buf.to(grad.dtype).lerp_(grad, 1 - momentum)
            buf.copy_(blended)
        if not wanted:
            return None
        return grad.lerp(blended, momentum) if group["nesterov"] else blended

    def _apply(self, p: torch.Tensor, update: torch.Tensor, group: dict) -> None:
        """Decoupled weight decay and the scaled orthogonalised update, on this rank's rows of `p`."""
        from utils.runtime.distributed import local_tensor

        lr, wd = group["lr"], group["weight_decay"]
        adjusted_lr = _adjust_lr(lr, group["adjust_lr_fn"], p.shape)  # the whole matrix's shape
        p = local_tensor(p)
        if group.get("cautious"):  # decay only where the step moves the weight towards zero as well
            p.mul_(1 - (lr * wd) * (update * p >= 0).to(p.dtype))
        else:
            p.mul_(1 - lr * wd)
        p.add_(update, alpha=-adjusted_lr)


class _Work:
    """How a Muon group's matrices are spread over the ranks that share them: each one's owner, the buckets,
    and the collectives that carry a bucket's updates (module docstring). Sharded: the matrices are DTensors
    split by rows over a 1-D mesh (FSDP2); otherwise whole on every rank of `replicas` (DDP), or here alone."""

    def __init__(self, params: list[torch.Tensor], replicas):
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor, Shard

        self.sharded = isinstance(params[0], DTensor) and params[0].device_mesh.size() > 1
        if self.sharded:
            mesh = params[0].device_mesh
            if mesh.ndim != 1 or any(p.placements != (Shard(0),) or p.device_mesh != mesh for p in params):
                raise ValueError("Muon's matrices must all be sharded by rows over one 1-D mesh (FSDP2's layout)")
            self.group = mesh.get_group()
        else:
            self.group = replicas
        self.world = dist.get_world_size(self.group) if self.group is not None else 1
        self.rank = dist.get_rank(self.group) if self.group is not None else 0
        self.shapes = [tuple(p.shape) for p in params]
        self.costs = [newton_schulz_flops(shape) for shape in self.shapes]
        self.owners = assign_by_cost(self.costs, self.world)
        if self.world == 1:  # one matrix at a time, in order, as torch's Muon
            self.buckets = [[[i]] for i in range(len(params))]
        else:
            self.buckets = buckets_of(self.owners, self.costs, [p.numel() for p in params], self.world)

    def needs_update(self, matrix: int) -> bool:
        """Whether this rank needs its part of `matrix`'s momentum-blended update: to orthogonalise it, or to
        send its rows to the owner; under DDP a rank receives the others' matrices orthogonalised."""
        return self.world == 1 or self.sharded or self.owners[matrix] == self.rank

    def orthogonalise(self, updates: dict[int, torch.Tensor], owned: list[list[int]], ns, ns_dtype,
                      device: torch.device) -> dict:
        """This rank's part of each of the bucket's matrices orthogonalised (`ns`; `owned`: each rank's, with
        gradients), from the updates it needs (`needs_update`): the whole matrix here (one process, DDP), or its
        rows (FSDP)."""
        if self.world == 1:
            return {i: ns(u) for i, u in updates.items()}
        if self.sharded:
            return self._by_all_to_all(updates, owned, ns, ns_dtype, device)
        return self._by_broadcast(updates, owned, ns, ns_dtype, device)

    def _rows(self, matrix: int, rank: int) -> tuple[int, int]:
        """(first row, rows) of `matrix` that `rank` holds: FSDP2's Shard(0), torch.chunk's split."""
        from torch.distributed.tensor import Shard

        count, first = Shard.local_shard_size_and_offset(self.shapes[matrix][0], self.world, rank)
        return first, count

    def _held(self, rank: int, matrices: list[int]) -> list[int]:
        """How many values of each of `matrices` `rank` holds."""
        return [self._rows(i, rank)[1] * self.shapes[i][1] for i in matrices]

    def _by_all_to_all(self, updates: dict, owned: list[list[int]], ns, ns_dtype, device) -> dict:
        """FSDP: each rank's rows go to their matrices' owners (one all-to-all), which orthogonalise the whole
        matrices and send each rank its rows back (another)."""
        import torch.distributed as dist

        mine, ranks = owned[self.rank], range(self.world)
        sent = [sum(self._held(self.rank, owned[r])) for r in ranks]
        got = [sum(self._held(r, mine)) for r in ranks]
        send = torch.cat([updates[i].reshape(-1).to(ns_dtype) for r in ranks for i in owned[r]])
        recv = torch.empty(sum(got), dtype=ns_dtype, device=device)
        dist.all_to_all_single(recv, send, got, sent, group=self.group)
        pieces = [chunk.split(self._held(r, mine)) for r, chunk in zip(ranks, recv.split(got))]
        results = [ns(torch.cat([pieces[r][k] for r in ranks]).view(self.shapes[i])).contiguous()
                   for k, i in enumerate(mine)]
        send = torch.cat([result.narrow(0, *self._rows(i, r)).reshape(-1) for r in ranks
                          for i, result in zip(mine, results)] or [torch.empty(0, dtype=ns_dtype, device=device)])
        back = torch.empty(sum(sent), dtype=send.dtype, device=device)
        dist.all_to_all_single(back, send, sent, got, group=self.group)
        return {i: rows.view(updates[i].shape) for r, chunk in zip(ranks, back.split(sent))
                for i, rows in zip(owned[r], chunk.split(self._held(self.rank, owned[r])))}

    def _by_broadcast(self, updates: dict, owned: list[list[int]], ns, ns_dtype, device) -> dict:
        """DDP: each owner orthogonalises its matrices and broadcasts them in one buffer; every rank needs all."""
        import torch.distributed as dist

        size = lambda i: self.shapes[i][0] * self.shapes[i][1]  # noqa: E731
        buffers, pending = [], []
        for rank, matrices in enumerate(owned):
            if rank == self.rank:
                flat = torch.cat([ns(updates[i]).reshape(-1) for i in matrices]
                                 or [torch.empty(0, dtype=ns_dtype, device=device)])
            else:
                flat = torch.empty(sum(map(size, matrices)), dtype=ns_dtype, device=device)
            buffers.append(flat)
            if flat.numel():
                pending.append(dist.broadcast(flat, group_src=rank, group=self.group, async_op=True))
        for request in pending:
            request.wait()
        return {i: update.view(self.shapes[i]) for matrices, flat in zip(owned, buffers)
                for i, update in zip(matrices, flat.split([size(i) for i in matrices]))}
