"""The model the loop trains: `build_model(spec, seed, impl)` -> a module whose forward(input_ids) is the loss.

A model comes from its family (`spec.family`; utils/model/families.py: one folder per family under
utils/model/). Each family has two implementations of the same model: `native` (its model.py, the
default: faster) and `hf` (transformers' class, the reference). Both have HF's parameter names (no wrapper
prefix) in HF's order, so their state dicts and optimizer states are interchangeable, and both offer the
engine's interface (utils/model/layers.py CausalLM: `blocks()`, `input_embedding()`, `output_units()`,
`flops_per_token(seq_len)`, `parameter_counts()`, `compile_blocks()`).

The loss is computed inside the module, not by the loop: under DDP, gradient-sync hooks fire only for the
wrapped module's own forward.

- `families`: the family registry; `layers`: the CausalLM interface, the chunked loss, document masking;
- `spec`: a run's architecture (a preset or init_from's config.json); `hf`: HF in and out; `init`: fresh weights;
- `lm_loss`: the LM head's chunked loss and the z-loss; `preflight`: the first passes checked before step 1;
- `activation_checkpointing`: the policies; `fsdp`: FSDP2's unit layout; `fp8`: float8 training (torchao);
- `fit`: whether a batch fits the memory the process has.

May import: utils, utils.io, utils.runtime, configs, utils.data, utils.checkpoint.
"""
from __future__ import annotations

import torch
from torch import nn

from configs.model_config import ConfigError, ModelSpec
from configs.training_config import MODEL_IMPLS


def build_model(spec: ModelSpec, seed: int, impl: str = "native", init: str = "hf") -> nn.Module:
    """A freshly initialised model; the same seed gives the same weights on every rank. `init`: the scheme
    of its fresh weights (utils/model/init.py: hf as built, or neox)."""
    from utils.model.families import family_of
    from utils.model.init import init_weights

    if impl not in MODEL_IMPLS:
        raise ConfigError(f"model_impl='{impl}' is not valid; use one of {', '.join(MODEL_IMPLS)}")
    fam = family_of(spec)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if impl == "native":
            model = fam.native_model(spec)
        else:
            model = fam.hf_model_class()(fam.hf_config(spec, attn_implementation="sdpa"))
            model.spec = spec
        return init_weights(model, init, spec.hidden_size, spec.num_hidden_layers)


def hf_model_class(spec: ModelSpec | None = None):
    """transformers' class of `spec`'s family (default GPT-NeoX) with the engine's interface."""
    from utils.model.families import family, family_of

    return (family_of(spec) if spec is not None else family("gpt_neox")).hf_model_class()
