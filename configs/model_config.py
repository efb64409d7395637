"""Model architectures: `ModelSpec` (one flat record of every field a family may read) and the presets by
name, which the families register (utils/model/families.py; each family's folder lists its own presets).
`gpt-neox-1.2b` is the seed's model; the small ones exist for CPU runs."""
from __future__ import annotations

from dataclasses import dataclass, fields

from utils.errors import UserError

# Rows of the flattened [tokens, hidden] activations per chunk of the native model's LM-head loss
# (utils/model/lm_loss.py): bounds the logits alive at once to LOSS_CHUNK_ROWS x vocab (8192 x 50304 fp32 =
# 1.6 GB, instead of 3.3 GB for a 8 x 2048 batch). Here because the memory plan (configs/profiles.py) counts it.
LOSS_CHUNK_ROWS = 8192

LAYER_KINDS = ("full", "sliding")  # what `layer_types` may hold: full causal attention, or a sliding window


class ConfigError(UserError, ValueError):
    """A configuration problem the user can fix; the message says what and how."""


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


MAX_SIZE = 2**31  # beyond any model's vocabulary, width, depth or context
_POSITIVE_NUMBERS = ("rotary_emb_base", "layer_norm_eps", "initializer_range")
_NON_NEGATIVE_NUMBERS = ("rope_local_base", "final_logit_softcapping")
_ZERO_MEANS_UNSET = ("num_key_value_heads", "attention_head_dim", "sliding_window", "query_pre_attn_scalar")


def check_model_record(record) -> None:
    """A ModelSpec's record (`to_dict()`, as a checkpoint's trainer_state.json keeps it, which may come from a
    bucket or be crafted) before a spec is made of it: each field it holds of its type and in its range (sizes
    positive integers below 2**31, at least 2 positions, the rotary share in (0, 1], eps, rotary base and
    initializer_range positive finite numbers, flags true or false, a known family), hidden_size a multiple of
    the heads and they of the k/v heads. ValueError naming the field (`model.FIELD`)."""
    import math

    from utils.model.families import family_names

    def bad(field: str, value, want: str):
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        raise ValueError(f"model.{field} is {shown}, not {want}")

    def number(value) -> bool:
        return type(value) in (int, float) and math.isfinite(value)

    def rope_scaling(value) -> bool:  # none, or Llama 3's four: three factors and the original positions
        return isinstance(value, (list, tuple)) and (not value or len(value) == 4 and type(value[3]) is int
                                                     and all(number(v) and v > 0 for v in value))

    if not isinstance(record, dict):
        bad("", type(record).__name__, "an object")
    declared = ModelSpec.__dataclass_fields__
    for field, value in record.items():
        kind = declared[field].type if field in declared else "int" if field == "padded_vocab_size" else None
        least = 0 if field in _ZERO_MEANS_UNSET else 2 if field == "max_position_embeddings" else 1
        if kind is None:
            bad(field, value, "a field of a model record")
        elif kind == "int" and (type(value) is not int or not least <= value < MAX_SIZE):
            bad(field, value, f"an integer of at least {least}, below {MAX_SIZE:,}")
        elif field == "rotary_pct" and not (number(value) and 0 < value <= 1):
            bad(field, value, "a number in (0, 1]")
        elif field in _POSITIVE_NUMBERS and not (number(value) and value > 0):
            bad(field, value, "a positive finite number")
        elif field in _NON_NEGATIVE_NUMBERS and not (number(value) and value >= 0):
            bad(field, value, "a finite number of at least 0")
        elif kind == "bool" and not isinstance(value, bool):
            bad(field, value, "true or false")
        elif kind == "str" and not (isinstance(value, str) and (value or field == "name")):
            bad(field, value, "a non-empty string")
        elif field == "family" and value not in family_names():
            bad(field, value, f"one of {', '.join(family_names())}")
        elif field == "rope_scaling" and not rope_scaling(value):
            bad(field, value, "[] or [factor, low_freq_factor, high_freq_factor, original positions], each above 0")
        elif field == "layer_types" and not (isinstance(value, (list, tuple)) and all(v in LAYER_KINDS for v in value)):
            bad(field, value, f"a list of {' or '.join(LAYER_KINDS)}")
    heads, kv_heads = record.get("num_attention_heads"), record.get("num_key_value_heads") or None
    if heads and not record.get("attention_head_dim") and record.get("hidden_size", 0) % heads:
        bad("hidden_size", record["hidden_size"], f"a multiple of num_attention_heads ({heads})")
    if heads and kv_heads and heads % kv_heads:
        bad("num_attention_heads", heads, f"a multiple of num_key_value_heads ({kv_heads})")


def __getattr__(name: str):
    """`MODELS`: every registered family's presets by name (read from the registry when first asked for, so
    that importing this module loads no family)."""
    if name == "MODELS":
        from utils.model.families import presets

        return presets()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get_model_spec(name: str) -> ModelSpec:
    from utils.model.families import presets

    models = presets()
    try:
        return models[name]
    except KeyError:
        raise ConfigError(
            f"unknown model '{name}'; valid models: {', '.join(sorted(models))}"
        ) from None


def spec_fields() -> dict:
    """Every ModelSpec field -> its default (what a family's `fields` may name)."""
    return {f.name: f.default for f in fields(ModelSpec)}

