"""Fresh weights by scheme (`init = hf | neox`), for any model family whose modules are Linear, Embedding and
norm layers; `init_from` runs and resumes load their weights over it, so the scheme only shapes a fresh start.

    hf    transformers' initialisation: normal(0, initializer_range) for every Linear and Embedding, zero
          biases, norms at their identity (what the models do by themselves; nothing to redo)
    neox  the GPT-NeoX library's, as Pythia was trained: `small_init` (normal, std sqrt(2 / (5 d)), Nguyen &
          Salazar 2019) for every weight matrix and embedding, the input embedding and the LM head included,
          and `wang_init` (normal, std 2 / (L sqrt(d))) for the two projections that write into the residual
          stream in each block, attention's output and the MLP's output (each family names them in its
          bundle: `Family.residual_outputs`). Biases 0; the shared norms (utils/model/common/norms.py) at their
          identity (weight 1, or 0 for Gemma's 1 + weight RMSNorm); transformers' own norms stay as built,
          which is their identity.

Followed: EleutherAI/gpt-neox `megatron/model/init_functions.py` (small_init_init_method: std =
sqrt(2 / (5 * dim)); wang_init_method: std = 2 / n_layers / sqrt(dim), dim = hidden_size) and the Pythia
configs (EleutherAI/pythia `models/*/pythia-*.yml`, e.g. pythia-1b: `"init_method": "small_init"`,
`"output_layer_init_method": "wang_init"`), where `init_method` also initialises the word embeddings and
the final output layer and `output_layer_init_method` the attention and MLP output projections.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from utils.model.common.norms import NORMS


def small_init_std(hidden: int) -> float:
    return math.sqrt(2.0 / (5.0 * hidden))


def wang_init_std(hidden: int, layers: int) -> float:
    return 2.0 / (layers * math.sqrt(hidden))


def residual_output_names(model: nn.Module) -> set[str]:
    """Qualified names of the blocks' residual-stream outputs (the family's `residual_outputs` in each block)."""
    from utils.model.families import family_of

    suffixes = family_of(model.spec).residual_outputs
    return {name for name, _ in model.named_modules() if any(name.endswith("." + s) for s in suffixes)}


def planned_stds(model: nn.Module, hidden: int, layers: int) -> dict[str, float]:
    """`init=neox`: each weight matrix's (and embedding's) name -> the std it is drawn with."""
    small, wang = small_init_std(hidden), wang_init_std(hidden, layers)
    residual = residual_output_names(model)
    plan = {}
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            plan[f"{name}.weight"] = wang if name in residual else small
    return plan


@torch.no_grad()
def init_weights(model: nn.Module, scheme: str, hidden: int, layers: int) -> nn.Module:
    """Re-initialises `model` in place by `scheme` (see the module docstring); `hf` leaves it as built. A
    tied head shares the embedding's tensor, drawn once. Meta-device parameters are left alone (FSDP builds on meta and
    materialises rank 0's full weights, built by this same function)."""
    if scheme == "hf":
        return model
    if scheme != "neox":
        raise ValueError(f"init='{scheme}' is not valid; use hf or neox")
    stds, done = planned_stds(model, hidden, layers), set()
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            if module.weight.is_meta or id(module.weight) in done:
                continue
            done.add(id(module.weight))
            module.weight.normal_(0.0, stds[f"{name}.weight"])
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
        elif isinstance(module, NORMS) and not module.weight.is_meta:
            module.reset_parameters()
    return model
