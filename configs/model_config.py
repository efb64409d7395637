"""Model architectures by name. `gpt-neox-1.2b` is the seed's model; the small ones exist for CPU runs."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from utils.errors import UserError


# Rows of the flattened [tokens, hidden] activations per chunk of the native model's LM-head loss
# (utils/model/gpt_neox.py): bounds the logits alive at once to LOSS_CHUNK_ROWS x vocab (8192 x 50304 fp32 =
# 1.6 GB, instead of 3.3 GB for a 8 x 2048 batch). Here because the memory plan (configs/profiles.py) counts it.
LOSS_CHUNK_ROWS = 8192


# The model families (utils/model/families.py maps each to its folder under utils/model/).
FAMILY_NAMES = ("gpt_neox", "llama")


class ConfigError(UserError, ValueError):
    """A configuration problem the user can fix; the message says what and how."""


@dataclass(frozen=True)
class ModelSpec:
    """An architecture: everything a family's implementations (native and transformers') build from.

    The fields up to `pad_vocab_multiple` are GPT-NeoX's (and those Llama shares: sizes, rotary base,
    `layer_norm_eps` as the RMSNorm eps, `attention_bias` on q/k/v/o, `hidden_act`, tying); the ones after it
    are other families' (defaults: GPT-NeoX's), and records of GPT-NeoX runs leave them out (`to_dict`)."""

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
    family: str = "gpt_neox"  # FAMILY_NAMES: which folder under utils/model/ builds it
    num_key_value_heads: int = 0  # grouped-query attention's k/v heads (0: as many as query heads)
    rope_scaling: tuple = ()  # Llama 3's: (factor, low_freq_factor, high_freq_factor, original_max_positions)
    qkv_bias: bool = False  # biases on q/k/v only (Qwen2)

    def __post_init__(self):
        if self.family not in FAMILY_NAMES:
            raise ConfigError(f"model family '{self.family}' is unknown; use one of {', '.join(FAMILY_NAMES)}")
        object.__setattr__(self, "rope_scaling", tuple(self.rope_scaling or ()))
        if self.num_attention_heads % self.kv_heads:
            raise ConfigError(f"model '{self.name}': num_attention_heads {self.num_attention_heads} is not a "
                              f"multiple of num_key_value_heads {self.kv_heads}")

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def block_parameters(self) -> int:
        """Parameters of one transformer block (the memory plan's input, configs/profiles.py)."""
        h, f, kv = self.hidden_size, self.intermediate_size, self.kv_heads * self.head_dim
        if self.family == "gpt_neox":  # fused QKV + dense (biases), 2-matrix MLP (biases), 2 LayerNorms
            return 4 * h * h + 2 * h * f + 9 * h + f
        # Llama: q, k, v, o; SwiGLU's gate, up, down (no biases); 2 RMSNorms
        bias = (2 * h + 2 * kv) * self.attention_bias + (h + 2 * kv) * (self.qkv_bias and not self.attention_bias)
        return 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h + bias

    @property
    def padded_vocab_size(self) -> int:
        m = self.pad_vocab_multiple
        return ((self.vocab_size + m - 1) // m) * m

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def rotary_dims(self) -> int:
        return int(self.head_dim * self.rotary_pct)

    def to_dict(self) -> dict:
        """The record checkpoints and run records keep; a GPT-NeoX one is as it always was (no later fields)."""
        record = asdict(self)
        if self.family == "gpt_neox":
            for key in ("family", "num_key_value_heads", "rope_scaling", "qkv_bias"):
                if record[key] == ModelSpec.__dataclass_fields__[key].default:
                    record.pop(key)
        else:
            record["rope_scaling"] = list(self.rope_scaling)
        return record | {"padded_vocab_size": self.padded_vocab_size}


MAX_SIZE = 2**31  # beyond any model's vocabulary, width, depth or context
_POSITIVE_NUMBERS = ("rotary_emb_base", "layer_norm_eps", "initializer_range")


def check_model_record(record) -> None:
    """A ModelSpec's record (`to_dict()`, as a checkpoint's trainer_state.json keeps it, which may come from a
    bucket or be crafted) before a spec is made of it: each field it holds of its type and in its range (sizes
    positive integers below 2**31, at least 2 positions, the rotary share in (0, 1], eps, rotary base and
    initializer_range positive finite numbers, flags true or false, a known family), hidden_size a multiple of
    the heads and they of the k/v heads. ValueError naming the field (`model.FIELD`)."""
    import math

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
    fields = ModelSpec.__dataclass_fields__
    for field, value in record.items():
        kind = fields[field].type if field in fields else "int" if field == "padded_vocab_size" else None
        least = 0 if field == "num_key_value_heads" else 2 if field == "max_position_embeddings" else 1
        if kind is None:
            bad(field, value, "a field of a model record")
        elif kind == "int" and (type(value) is not int or not least <= value < MAX_SIZE):
            bad(field, value, f"an integer of at least {least}, below {MAX_SIZE:,}")
        elif field == "rotary_pct" and not (number(value) and 0 < value <= 1):
            bad(field, value, "a number in (0, 1]")
        elif field in _POSITIVE_NUMBERS and not (number(value) and value > 0):
            bad(field, value, "a positive finite number")
        elif kind == "bool" and not isinstance(value, bool):
            bad(field, value, "true or false")
        elif kind == "str" and not (isinstance(value, str) and (value or field == "name")):
            bad(field, value, "a non-empty string")
        elif field == "family" and value not in FAMILY_NAMES:
            bad(field, value, f"one of {', '.join(FAMILY_NAMES)}")
        elif field == "rope_scaling" and not rope_scaling(value):
            bad(field, value, "[] or [factor, low_freq_factor, high_freq_factor, original positions], each above 0")
    heads, kv_heads = record.get("num_attention_heads"), record.get("num_key_value_heads") or None
    if heads and record.get("hidden_size", 0) % heads:
        bad("hidden_size", record["hidden_size"], f"a multiple of num_attention_heads ({heads})")
    if heads and kv_heads and heads % kv_heads:
        bad("num_attention_heads", heads, f"a multiple of num_key_value_heads ({kv_heads})")


def _llama(name, vocab, hidden, layers, heads, kv_heads, ffn, positions, theta, eps, **kw) -> ModelSpec:
    """A Llama-family preset with a published model's shapes (tied embeddings, as all of these have)."""
    return ModelSpec(name, vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                     intermediate_size=ffn, max_position_embeddings=positions, family="llama",
                     num_key_value_heads=kv_heads, rotary_pct=1.0, rotary_emb_base=theta, layer_norm_eps=eps,
                     use_parallel_residual=False, attention_bias=False, hidden_act="silu", tie_word_embeddings=True,
                     initializer_range=kw.pop("init"), pad_vocab_multiple=1, **kw)


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        # The seed's architecture: 50257 GPT-2 BPE ids, padded to 50304 embedding rows.
        ModelSpec("gpt-neox-1.2b", vocab_size=50257, hidden_size=2048, num_hidden_layers=24,
                  num_attention_heads=16, intermediate_size=8192, max_position_embeddings=2048),
        # The Pythia suite (EleutherAI): its exact shapes, 2048 positions, rotary on 25% of each head, parallel
        # residual, untied head, 50304 embedding rows (50432 for 6.9b: its tokenizer's 50277 ids, padded).
        # Parameter counts, as published (tests/test_fsdp.py checks them): 162.3M, 405.3M, 1.012B, 1.415B,
        # 2.775B, 6.857B.
        *(ModelSpec(f"pythia-{size}", vocab_size=rows, hidden_size=h, num_hidden_layers=layers,
                    num_attention_heads=heads, intermediate_size=4 * h, max_position_embeddings=2048)
          for size, h, layers, heads, rows in (
              ("160m", 768, 12, 12, 50304), ("410m", 1024, 24, 16, 50304), ("1b", 2048, 16, 8, 50304),
              ("1.4b", 2048, 24, 16, 50304), ("2.8b", 2560, 32, 32, 50304), ("6.9b", 4096, 32, 32, 50432))),
        # The CPU demo: trained on its own byte-level BPE corpus in minutes on two cores.
        ModelSpec("demo", vocab_size=2048, hidden_size=192, num_hidden_layers=4,
                  num_attention_heads=6, intermediate_size=768, max_position_embeddings=128),
        # Unit and integration tests: seconds per run.
        ModelSpec("tiny", vocab_size=512, hidden_size=64, num_hidden_layers=2,
                  num_attention_heads=4, intermediate_size=256, max_position_embeddings=64),
        # The Llama family (utils/model/llama/): RMSNorm, SwiGLU, grouped-query attention, rotary on every
        # dim (Llama 3's frequency scaling where published). Published shapes, no weights: start from a model
        # you downloaded with init_from (docs/models.md). Embedding rows as published (no padding).
        *(_llama(name, vocab, h, layers, heads, kv, f, positions, theta, eps, init=init, rope_scaling=scaling,
                 qkv_bias=qkv_bias)
          for name, vocab, h, layers, heads, kv, f, positions, theta, eps, init, scaling, qkv_bias in (
              ("llama-3.2-1b", 128256, 2048, 16, 32, 8, 8192, 131072, 500000.0, 1e-5, 0.02, (32.0, 1.0, 4.0, 8192),
               False),
              ("smollm2-135m", 49152, 576, 30, 9, 3, 1536, 8192, 100000.0, 1e-5, 0.041666666666666664, (), False),
              ("smollm2-360m", 49152, 960, 32, 15, 5, 2560, 8192, 100000.0, 1e-5, 0.02, (), False),
              ("smollm2-1.7b", 49152, 2048, 24, 32, 32, 8192, 8192, 130000.0, 1e-5, 0.02, (), False),
              ("qwen2.5-0.5b", 151936, 896, 24, 14, 2, 4864, 32768, 1000000.0, 1e-6, 0.02, (), True),
              ("qwen2.5-1.5b", 151936, 1536, 28, 12, 2, 8960, 131072, 1000000.0, 1e-6, 0.02, (), True))),
        # The Llama-family CPU demo (--set model=llama-demo: the demo model's size, GQA, its head untied as the
        # demo's is) and the unit-test size (GQA, tied embeddings).
        ModelSpec("llama-demo", vocab_size=2048, hidden_size=192, num_hidden_layers=4, num_attention_heads=6,
                  intermediate_size=768, max_position_embeddings=128, family="llama", num_key_value_heads=2,
                  rotary_pct=1.0, use_parallel_residual=False, attention_bias=False, hidden_act="silu",
                  tie_word_embeddings=False),
        ModelSpec("llama-tiny", vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=128, max_position_embeddings=64, family="llama", num_key_value_heads=2,
                  rotary_pct=1.0, use_parallel_residual=False, attention_bias=False, hidden_act="silu",
                  tie_word_embeddings=True),
        # Framework-overhead benchmark: so small that anything but the math shows.
        ModelSpec("micro", vocab_size=256, hidden_size=32, num_hidden_layers=1,
                  num_attention_heads=2, intermediate_size=64, max_position_embeddings=32),
    )
}


def get_model_spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ConfigError(
            f"unknown model '{name}'; valid models: {', '.join(sorted(MODELS))}"
        ) from None
