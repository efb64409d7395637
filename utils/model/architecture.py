"""`ModelSpec`: an architecture, one flat record of every field a model family may read (each family's folder
lists its own presets and the fields it reads: utils/model/family.py). The model layer owns it; the config layer
reads it through the family registry (utils/model/families.py).

Layer: configs (a torch-free description the config layer reads: presets, counts, the registry).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from utils.errors import ConfigError

LAYER_KINDS = ("full", "sliding")  # what `layer_types` may hold: full causal attention, or a sliding window
MAX_SIZE = 2**31  # beyond any model's vocabulary, width, depth or context


@dataclass(frozen=True)
class ModelSpec:
    """An architecture: everything a family's implementations (native and transformers') build from.

    The fields up to `pad_vocab_multiple` are every family's (GPT-NeoX's originally: sizes, rotary base and
    share, `layer_norm_eps` as any norm's eps, `attention_bias` on q/k/v/o, `hidden_act`, tying) and are always
    recorded; each later field belongs to the families that name it (utils/model/family.py `Family.fields`),
    keeps its default elsewhere, and is left out of a record while at its default (`to_dict`)."""

    name: str
    vocab_size: int  # the tokenizer's vocabulary: every token id in the data must be below this
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    rotary_pct: float = 0.25  # share of each head's dims that get rotary embeddings
    rotary_emb_base: float = 10000.0
    use_parallel_residual: bool = True
    layer_norm_eps: float = 1e-5
    attention_bias: bool = True  # biases of the QKV and attention output projections
    hidden_act: str = "gelu"
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    pad_vocab_multiple: int = 128  # embedding rows padded so the LM-head matmul is tensor-core friendly
    family: str = "gpt_neox"  # a registered family (utils/model/families.py): which folder builds it
    num_key_value_heads: int = 0  # grouped-query attention's k/v heads (0: as many as query heads)
    rope_scaling: tuple = ()  # Llama 3's: (factor, low_freq_factor, high_freq_factor, original_max_positions)
    qkv_bias: bool = False  # biases on q/k/v only (Qwen2)
    attention_head_dim: int = 0  # dims per attention head (0: hidden_size / num_attention_heads)
    qk_norm: bool = False  # a norm on each head of q and k after their projection, before rotary (OLMo 2, Qwen3)
    sliding_window: int = 0  # keys a query of a sliding layer sees, itself included (0: no sliding layers)
    layer_types: tuple = ()  # per layer, "full" or "sliding" (empty: every layer full)
    rope_local_base: float = 0.0  # the rotary base of sliding layers (0: rotary_emb_base)
    query_pre_attn_scalar: int = 0  # attention scores scaled by 1/sqrt(this) (0: 1/sqrt(head_dim))
    final_logit_softcapping: float = 0.0  # logits = c * tanh(logits / c) (0: none)

    def __post_init__(self):
        object.__setattr__(self, "rope_scaling", tuple(self.rope_scaling or ()))
        object.__setattr__(self, "layer_types", tuple(self.layer_types or ()))
        if self.num_attention_heads % self.kv_heads:
            raise ConfigError(f"model '{self.name}': num_attention_heads {self.num_attention_heads} is not a "
                              f"multiple of num_key_value_heads {self.kv_heads}")
        if self.layer_types and len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(f"model '{self.name}': layer_types names {len(self.layer_types)} layers, not "
                              f"num_hidden_layers {self.num_hidden_layers}")
        unknown = sorted(set(self.layer_types) - set(LAYER_KINDS))
        if unknown:
            raise ConfigError(f"model '{self.name}': layer_types holds {unknown[0]!r}; each layer is one of "
                              f"{', '.join(LAYER_KINDS)}")
        if "sliding" in self.layer_types and self.sliding_window < 1:
            raise ConfigError(f"model '{self.name}': sliding layers need sliding_window (the keys a query sees)")

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def padded_vocab_size(self) -> int:
        m = self.pad_vocab_multiple
        return ((self.vocab_size + m - 1) // m) * m

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or self.hidden_size // self.num_attention_heads

    @property
    def rotary_dims(self) -> int:
        return int(self.head_dim * self.rotary_pct)

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """Each layer's attention: "full" or "sliding"."""
        return self.layer_types or ("full",) * self.num_hidden_layers

    def to_dict(self) -> dict:
        """The record checkpoints and run records keep: every family's fields, and each later one that differs
        from its default (so a GPT-NeoX record is as it always was; a record reads back with `ModelSpec(**r)`
        less `padded_vocab_size`)."""
        record = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ALWAYS_RECORDED or value != f.default:
                record[f.name] = list(value) if isinstance(value, tuple) else value
        return record | {"padded_vocab_size": self.padded_vocab_size}


_NAMES = [f.name for f in fields(ModelSpec)]
ALWAYS_RECORDED = tuple(_NAMES[:_NAMES.index("family")])  # every family's fields: always in a record


def spec_fields() -> dict:
    """Every ModelSpec field -> its default (what a family's `fields` may name)."""
    return {f.name: f.default for f in fields(ModelSpec)}
