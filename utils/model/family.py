"""`Family`: everything the engine asks of a model family, as one typed object its folder exports (`FAMILY`
in utils/model/<family>/__init__.py, registered in utils/model/families.py), after torchtitan's `ModelSpec`.

    name, presets       the family's name (`ModelSpec.family`) and its architectures by name
    fields              the ModelSpec fields it reads beyond every family's (a spec setting another is refused)
    model               its native model, a CausalLM ("module:Class", imported when a model is built)
    adapter             its transformers adapter, an HFAdapter ("module:NAME": keys both ways, the class, what
                        its config.json carries both ways), and `hf_model_types`, the config.json model_types
                        it reads
    block_parameters    one block's parameters; `parameters(spec)` the whole model's, `flops_per_token` PaLM's
                        count with each layer's context (a sliding layer's window)
    muon_matrices       per block, the weight matrices Muon orthogonalises (name in the block -> shape): its
                        projection and MLP matrices
    block_activations   per token, the values one block keeps for its backward pass without checkpointing
                        (`activations(spec, policy)` adds the policies: the memory plan's input)
    residual_outputs    per block, the Linears that write into the residual stream (init=neox's wang_init)
    check               what else the family refuses in a spec (one ConfigError line)

This module and the registry load neither torch nor transformers: the config layer (presets, the memory
plan) reads them; the model and the adapter load only when used. The counting helpers below are the shared
blocks' sizes (utils/model/common/), so a family composed of them counts itself in a line.

Layer: configs (a torch-free description the config layer reads: presets, counts, the registry).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from utils.errors import ConfigError
from utils.model.architecture import ALWAYS_RECORDED, ModelSpec, spec_fields


class Sizes(NamedTuple):
    """A published model's sizes, as a preset table writes them (each family's `_preset(name, Sizes(...), ...)`)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    max_position_embeddings: int


def _accept(spec: ModelSpec) -> None:
    return None


@dataclass(frozen=True)
class Family:
    name: str
    presets: tuple[ModelSpec, ...]
    fields: tuple[str, ...]
    model: str
    adapter: str
    hf_model_types: tuple[str, ...]
    block_parameters: Callable[[ModelSpec], int]
    muon_matrices: Callable[[ModelSpec], dict[str, tuple[int, int]]]
    block_activations: Callable[[ModelSpec], float]
    residual_outputs: tuple[str, ...]
    final_norm_parameters: Callable[[ModelSpec], int] = lambda spec: spec.hidden_size
    check: Callable[[ModelSpec], None] = field(default=_accept)

    def __post_init__(self):
        unknown = sorted(set(self.fields) - set(spec_fields()))
        assert not unknown, f"family {self.name}: {unknown} are not ModelSpec fields"
        for spec in self.presets:
            assert spec.family == self.name, f"family {self.name}: preset {spec.name} is of family {spec.family}"

    # --- a spec of this family
    def validate(self, spec: ModelSpec) -> None:
        """One ConfigError line for a spec this family cannot build: a field it does not read set away from its
        default, or what `check` refuses."""
        defaults = spec_fields()
        foreign = [name for name, default in defaults.items()
                   if name not in ALWAYS_RECORDED and name != "family" and name not in self.fields
                   and getattr(spec, name) != default]
        if foreign:
            own = ", ".join(self.fields) or "none beyond every family's"
            raise ConfigError(f"model '{spec.name}': the {self.name} family has no {foreign[0]} (its own fields: "
                              f"{own})")
        self.check(spec)

    def parameters(self, spec: ModelSpec) -> int:
        """Every parameter of the model, a tied embedding counted once (what the built model holds)."""
        embeddings = spec.padded_vocab_size * spec.hidden_size * (1 if spec.tie_word_embeddings else 2)
        return spec.num_hidden_layers * self.block_parameters(spec) + self.final_norm_parameters(spec) + embeddings

    def muon_values(self, spec: ModelSpec) -> int:
        """Values of the matrices Muon keeps one momentum buffer for, over every block."""
        return spec.num_hidden_layers * sum(r * c for r, c in self.muon_matrices(spec).values())

    def activations(self, spec: ModelSpec, policy: str) -> float:
        """Values per token one block keeps for backward under `policy` ("none" | "selective" | "full"):
        everything (`block_activations`), the outputs of its matmuls and of attention and its input
        (selective: torch's policy in utils/model/activation_checkpointing.py), or its input alone (full)."""
        if policy == "none":
            return self.block_activations(spec)
        if policy == "selective":
            outputs = sum(rows for rows, _ in self.muon_matrices(spec).values())
            return spec.hidden_size + outputs + spec.num_attention_heads * spec.head_dim
        return spec.hidden_size

    def flops_per_token(self, spec: ModelSpec, seq_len: int) -> float:
        """PaLM's training FLOPs per token: 6N + 12·H·Q·ΣT (N the matmul parameters: all but an untied input
        embedding's lookup table; H heads, Q head dim; T each layer's context: the sequence, or a sliding
        layer's window where shorter); the second term is attention's score and value matmuls."""
        matmul = self.parameters(spec) - spec.padded_vocab_size * spec.hidden_size * (not spec.tie_word_embeddings)
        context = sum(min(seq_len, spec.sliding_window) if kind == "sliding" else seq_len
                      for kind in spec.layer_kinds)
        return 6.0 * matmul + 12.0 * spec.num_attention_heads * spec.head_dim * context

    # --- its implementations, imported when asked for
    def native_model(self, spec: ModelSpec):
        """A freshly initialised native model (a CausalLM) of `spec`."""
        self.validate(spec)
        return _resolve(self.model)(spec)

    def hf(self):
        """The family's HFAdapter (utils/model/hf.py)."""
        return _resolve(self.adapter)


def _resolve(path: str):
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


# --- the shared blocks' sizes (utils/model/common/)
def attention_parameters(spec: ModelSpec, qk_norm_size: int) -> int:
    """GroupedQueryAttention: q, k, v, o and their biases; QK-norm's two norms of `qk_norm_size` each."""
    h, q, kv = spec.hidden_size, spec.num_attention_heads * spec.head_dim, spec.kv_heads * spec.head_dim
    biases = (q + 2 * kv + h) * spec.attention_bias + (q + 2 * kv) * (spec.qkv_bias and not spec.attention_bias)
    return 2 * h * q + 2 * h * kv + biases + 2 * qk_norm_size * spec.qk_norm


def gated_mlp_parameters(spec: ModelSpec) -> int:
    return 3 * spec.hidden_size * spec.intermediate_size


def decoder_block_parameters(spec: ModelSpec, norms: int = 2) -> int:
    """A block of GroupedQueryAttention, GatedMLP and `norms` RMSNorm-style norms (a weight each)."""
    return attention_parameters(spec, spec.head_dim) + gated_mlp_parameters(spec) + norms * spec.hidden_size


def decoder_muon_matrices(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """GroupedQueryAttention's four projections and GatedMLP's three, as [out, in]."""
    h, f = spec.hidden_size, spec.intermediate_size
    q, kv = spec.num_attention_heads * spec.head_dim, spec.kv_heads * spec.head_dim
    return {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
            "self_attn.o_proj": (h, q), "mlp.gate_proj": (f, h), "mlp.up_proj": (f, h), "mlp.down_proj": (h, f)}


def decoder_activations(spec: ModelSpec, sandwich: bool = False) -> float:
    """What a decoder block of the shared blocks keeps per token (counted from autograd's saved tensors, as
    `saved_activation_bytes` measures them within 10%): the residual stream and its norms (4 hidden-wide
    tensors; 8 with a norm after attention and after the MLP too), q through its projection, QK-norm, rotary
    (two) and attention's output, k through projection, QK-norm and rotary, v, and the gated MLP's four
    intermediate-wide tensors."""
    h, f = spec.hidden_size, spec.intermediate_size
    q, kv = spec.num_attention_heads * spec.head_dim, spec.kv_heads * spec.head_dim
    return (8 if sandwich else 4) * h + q * (4 + spec.qk_norm) + kv * (4 + spec.qk_norm) + 4 * f


DECODER_RESIDUAL_OUTPUTS = ("self_attn.o_proj", "mlp.down_proj")


def qk_norm_and_full_rotary(spec: ModelSpec, who: str) -> None:
    """For families whose transformers class always normalises q and k and rotates every head dim."""
    if not spec.qk_norm:
        raise ConfigError(f"model '{spec.name}': {who} normalises q and k (qk_norm true)")
    if spec.rotary_pct != 1.0:
        raise ConfigError(f"model '{spec.name}': {who} rotates every head dim (rotary_pct 1.0)")

