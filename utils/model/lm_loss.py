"""The LM head's loss without the [tokens, vocab] logits, for any model family: `LMHead` (a Linear whose
forward with targets returns the mean cross-entropy) and, with `z_loss` > 0, the auxiliary z-loss
`z_loss * mean(logsumexp(logits)^2)` (PaLM, OLMo: 1e-4), which keeps the softmax normaliser near 1 and the
logits from drifting in long runs. Both are computed chunk by chunk inside `ChunkedLMHeadLoss`; the
gradient of the z term is folded into the chunk's logit gradient (softmax * (1 + 2 z lse) - one-hot), so
the z-loss costs no extra matmul and no extra memory. The head returns cross-entropy + z term (what
backward follows) and keeps the z term's value, detached, in `last_z_loss` for the metrics row (`z_loss`);
the logged `loss` stays the cross-entropy, comparable with runs without it and with the validation loss.

Final logit softcapping (`softcap` > 0, Gemma's `final_logit_softcapping`): the logits are
softcap * tanh(logits / softcap) before the softmax, in the loss and in `logits()`; the chunk's gradient is
taken through it (times 1 - tanh^2).
"""
from __future__ import annotations

import torch
from torch import nn

from configs.model_config import LOSS_CHUNK_ROWS


class ChunkedLMHeadLoss(torch.autograd.Function):
    """(mean cross-entropy + z_loss * mean lse^2, the z term) of `hidden @ weight.T` against `targets`,
    without the full logits.

    Forward walks LOSS_CHUNK_ROWS rows at a time: logits of the chunk in the matmul dtype, log-softmax in
    fp32, and at once the chunk's gradients (softmax * (1 + 2 z lse) - one-hot) @ weight and its share of
    weight's gradient, so nothing of the size [rows, vocab] outlives its chunk and backward only scales the
    two gradients. The same FLOPs as the plain head + cross-entropy (forward matmul, two gradient matmuls)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype,
                z_loss: float = 0.0, softcap: float = 0.0):
        n = hidden.shape[0]
        w = weight.to(dtype)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros_like(weight, dtype=torch.float32)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        z_total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, n, LOSS_CHUNK_ROWS):
            h = hidden[start:start + LOSS_CHUNK_ROWS].to(dtype)
            t = targets[start:start + LOSS_CHUNK_ROWS]
            logits = (h @ w.t()).float()
            if softcap:
                capped = torch.tanh(logits / softcap)
                logits = capped * softcap
            lse = torch.logsumexp(logits, dim=-1)
            total += (lse - logits.gather(1, t[:, None]).squeeze(1)).sum()
            grad = torch.softmax(logits, dim=-1)  # d(sum of losses)/d(logits) = softmax - one-hot
            if z_loss:
                z_total += lse.square().sum()
                grad.mul_((1 + 2 * z_loss * lse)[:, None])  # + d(z lse^2)/d(logits) = 2 z lse softmax
            grad.scatter_add_(1, t[:, None], -torch.ones_like(grad[:, :1]))
            if softcap:
                grad.mul_(1 - capped * capped)  # d(softcap * tanh(l / softcap))/dl
            grad = grad.to(dtype)
            grad_hidden[start:start + LOSS_CHUNK_ROWS] = (grad @ w).to(hidden.dtype)
            grad_weight += (grad.t() @ h).float()
        ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype))
        ctx.n = n
        z_term = z_total * z_loss / n
        ctx.mark_non_differentiable(z_term)
        return total / n + z_term, z_term

    @staticmethod
    def backward(ctx, grad_output, _grad_z):
        grad_hidden, grad_weight = ctx.saved_tensors
        scale = grad_output / ctx.n
        return (grad_hidden * scale.to(grad_hidden.dtype), grad_weight * scale.to(grad_weight.dtype), None, None, None,
                None)


class LMHead(nn.Linear):
    """The output projection (HF's `lm_head`, no bias). Called with `targets` it returns the mean
    cross-entropy (+ the z term when `z_loss` > 0) through ChunkedLMHeadLoss instead of logits: the loss is
    the head's own forward, so a wrapper that acts on module calls (FSDP2 gathers a unit's weights when its
    forward starts) sees it. Without gradients (eval) it is the cross-entropy alone."""

    z_loss: float = 0.0
    softcap: float = 0.0  # final logit softcapping (0: none)
    last_z_loss: torch.Tensor | None = None  # the last training forward's z term (detached)
    _z_sum: torch.Tensor | None = None  # the z terms since the last pop_z_loss(), and how many
    _z_count: int = 0

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if targets is None:
            logits = super().forward(hidden)
            return torch.tanh(logits / self.softcap) * self.softcap if self.softcap else logits
        device = hidden.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else self.weight.dtype
        with torch.autocast(device, enabled=False):
            if torch.is_grad_enabled() and (hidden.requires_grad or self.weight.requires_grad):
                loss, self.last_z_loss = ChunkedLMHeadLoss.apply(hidden, self.weight, targets, dtype, self.z_loss,
                                                                 self.softcap)
                if self.z_loss:
                    self._z_sum = self.last_z_loss if self._z_sum is None else self._z_sum + self.last_z_loss
                    self._z_count += 1
                return loss
            return chunked_loss_only(hidden, self.weight, targets, dtype, self.softcap)


    def pop_z_loss(self) -> torch.Tensor | None:
        """The mean z term of the training forwards since the last call (a device tensor; None: none ran)."""
        if self._z_sum is None:
            return None
        mean = self._z_sum / self._z_count
        self._z_sum, self._z_count = None, 0
        return mean


def chunked_loss_only(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                      dtype: torch.dtype, softcap: float = 0.0) -> torch.Tensor:
    """ChunkedLMHeadLoss's cross-entropy without its gradients (eval, no_grad): one vocab-sized matmul per
    chunk instead of three."""
    w, total = weight.to(dtype), torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], LOSS_CHUNK_ROWS):
        logits = (hidden[start:start + LOSS_CHUNK_ROWS].to(dtype) @ w.t()).float()
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        t = targets[start:start + LOSS_CHUNK_ROWS]
        total += (torch.logsumexp(logits, dim=-1) - logits.gather(1, t[:, None]).squeeze(1)).sum()
    return total / hidden.shape[0]


def set_z_loss(model: nn.Module, coefficient: float) -> list[nn.Module]:
    """Sets the z-loss coefficient on every LMHead of `model`; returns those heads (where the loop reads
    `last_z_loss`)."""
    heads = [m for m in model.modules() if isinstance(m, LMHead)]
    for head in heads:
        head.z_loss = float(coefficient)
    return heads
