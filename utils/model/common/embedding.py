"""The token embedding scaled by a constant (Gemma: sqrt(hidden_size)), as transformers computes it: the
scale rounded to fp32, then to the weight's dtype, times the looked-up rows. An nn.Embedding otherwise, so
everything that treats embeddings as embeddings (Muon, init, FSDP units, tying) treats it so."""
from __future__ import annotations

import torch
from torch import nn


class ScaledEmbedding(nn.Embedding):
    def __init__(self, num_embeddings: int, embedding_dim: int, scale: float):
        super().__init__(num_embeddings, embedding_dim)
        self.scale = float(scale)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        scale = torch.tensor(self.scale, dtype=torch.float32, device=self.weight.device).to(self.weight.dtype)
        return super().forward(input_ids) * scale
