"""The model the loop trains: `build_model(spec, seed, impl)` -> a module whose forward(input_ids) is the loss.

A model comes from its family (`spec.family`; utils/model/families.py: one folder per family under
utils/model/, each exporting a Family bundle). Each family has two implementations of the same model: `native`
(its CausalLM over the shared blocks of utils/model/common/, the default: faster) and `hf` (transformers'
class, the reference). Both have HF's parameter names (no wrapper prefix) in HF's order, so their state dicts
and optimizer states are interchangeable, and both offer the engine's interface (utils/model/layers.py
CausalLM: `blocks()`, `input_embedding()`, `output_units()`, `flops_per_token(seq_len)`, `parameter_counts()`,
`compile_blocks()`).

The loss is computed inside the module, not by the loop: under DDP, gradient-sync hooks fire only for the
wrapped module's own forward. This package's import loads nothing (the config layer reads the family
registry through it); torch loads with `build_model`.

- `architecture`: ModelSpec, an architecture (every field a family may read); `families`: the family registry
  (and the check of a spec's record); `family`: the Family bundle each family folder exports (`gpt_neox`,
  `llama`, `qwen3`, `gemma3`, ...: one folder each); `adapter`: HFAdapter, a family's transformers side;
- `common`: the shared blocks families compose (attention, rotary, masks, MLPs, norms, the decoder);
- `layers`: the CausalLM interface, the chunked loss, document masking; `lm_loss`: the LM head's chunked loss
  and the z-loss; `spec`: a run's architecture (a preset or init_from's config.json); `hf`: HF in and out;
- `init`: fresh weights; `preflight`: the first passes checked before step 1; `activation_checkpointing`: the
  policies; `fsdp`: FSDP2's unit layout; `fp8`: float8 training (torchao); `fit`: whether a batch fits.

The model's description (`architecture`, `families`, `family` and each family folder's package: torch-free, importing
nothing above the base layer) is read by the config layer and says so ("Layer: configs" in their docstrings); a
family's model and transformers side stay here.

May import: utils, utils.io, utils.runtime, configs, utils.data, utils.checkpoint.
"""
from __future__ import annotations


def build_model(spec, seed: int, impl: str = "native", init: str = "hf"):
    """A freshly initialised model; the same seed gives the same weights on every rank. `init`: the scheme
    of its fresh weights (utils/model/init.py: hf as built, or neox)."""
    import torch

    from configs.training_config import MODEL_IMPLS
    from utils.errors import ConfigError
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
            fam.validate(spec)
            adapter = fam.hf()
            model = adapter.engine_class(spec)(adapter.hf_config(spec, attn_implementation="sdpa"))
            model.spec = spec
        return init_weights(model, init, spec.hidden_size, spec.num_hidden_layers)

