"""The model the loop trains: `build_model(spec, seed, impl)` -> a module whose forward(input_ids) is the loss.

Two implementations of the same GPT-NeoX: `native` (utils/model/gpt_neox.py, the default: faster) and `hf`
(transformers' GPTNeoXForCausalLM, the reference). Both have HF's parameter names (no wrapper prefix) in
HF's order, so their state dicts and optimizer states are interchangeable, and both offer
`flops_per_token(seq_len)`, `parameter_counts()` and `compile_blocks()`.

The loss is computed inside the module, not by the loop: under DDP, gradient-sync hooks fire only for the
wrapped module's own forward.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from configs.model_config import ConfigError, ModelSpec
from configs.training_config import MODEL_IMPLS


def build_model(spec: ModelSpec, seed: int, impl: str = "native", init: str = "hf") -> nn.Module:
    """A freshly initialised model; the same seed gives the same weights on every rank. `init`: the scheme
    of its fresh weights (utils/model/init.py: hf as built, or neox)."""
    from utils.model.init import init_weights

    if impl not in MODEL_IMPLS:
        raise ConfigError(f"model_impl='{impl}' is not valid; use one of {', '.join(MODEL_IMPLS)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if impl == "native":
            from utils.model.gpt_neox import GPTNeoX

            model = GPTNeoX(spec)
        else:
            model = hf_model_class()(spec.to_hf_config(attn_implementation="sdpa"))
            model.spec = spec
        return init_weights(model, init, spec.hidden_size, spec.num_hidden_layers)


def hf_model_class():
    """transformers' GPTNeoXForCausalLM with the engine's interface (imported only when asked for)."""
    global _HFGPTNeoX
    if _HFGPTNeoX is not None:
        return _HFGPTNeoX
    from transformers import GPTNeoXForCausalLM

    from utils.model.gpt_neox import FlopsMixin

    class HFGPTNeoX(FlopsMixin, GPTNeoXForCausalLM):
        """`forward(input_ids) -> loss`: the LM head on every position but the last, cross-entropy in fp32
        (for a stable log-softmax under bf16/fp16 autocast)."""

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            hidden = self.gpt_neox(input_ids=input_ids).last_hidden_state
            logits = self.lm_head(hidden[:, :-1])
            return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), input_ids[:, 1:].reshape(-1))

        def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.lm_head(self.gpt_neox(input_ids=input_ids).last_hidden_state)

        def compile_blocks(self) -> None:
            for layer in self.gpt_neox.layers:
                layer.compile()


    _HFGPTNeoX = HFGPTNeoX
    return HFGPTNeoX


_HFGPTNeoX = None
