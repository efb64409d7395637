"""Model architectures by name. `gpt-neox-1.2b` is the seed's model; the small ones exist for CPU runs."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from utils.errors import UserError


# Rows of the flattened [tokens, hidden] activations per chunk of the native model's LM-head loss
# (utils/model/gpt_neox.py): bounds the logits alive at once to LOSS_CHUNK_ROWS x vocab (8192 x 50304 fp32 =
# 1.6 GB, instead of 3.3 GB for a 8 x 2048 batch). Here because the memory plan (configs/profiles.py) counts it.
LOSS_CHUNK_ROWS = 8192


class ConfigError(UserError, ValueError):
    """A configuration problem the user can fix; the message says what and how."""


@dataclass(frozen=True)
class ModelSpec:
    """A GPT-NeoX architecture: everything both implementations (native and transformers') build from."""

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

    def to_hf_config(self, attn_implementation: str = "sdpa", special_ids: dict | None = None):
        """transformers' GPTNeoXConfig; `special_ids` ({"bos_token_id", "eos_token_id", "pad_token_id"}) come
        from the tokenizer the model was trained with (utils/model/hf.py), None where it is unknown."""
        from transformers import GPTNeoXConfig

        special_ids = special_ids or {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}

        cfg = GPTNeoXConfig(
            vocab_size=self.padded_vocab_size, hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            intermediate_size=self.intermediate_size, max_position_embeddings=self.max_position_embeddings,
            rotary_pct=self.rotary_pct, rotary_emb_base=self.rotary_emb_base,
            use_parallel_residual=self.use_parallel_residual, layer_norm_eps=self.layer_norm_eps,
            attention_bias=self.attention_bias, hidden_act=self.hidden_act,
            tie_word_embeddings=self.tie_word_embeddings, initializer_range=self.initializer_range,
            hidden_dropout=0.0, attention_dropout=0.0, use_cache=False, **special_ids,
        )
        cfg._attn_implementation = attn_implementation
        return cfg

    @classmethod
    def from_hf_config(cls, config: dict, name: str, source: str = "config.json") -> "ModelSpec":
        """A spec from an HF GPT-NeoX config.json (old `rotary_pct`/`rotary_emb_base` keys or transformers 5's
        `rope_parameters`). The embedding rows are the config's `vocab_size`, kept as they are."""
        if config.get("model_type") != "gpt_neox":
            raise ConfigError(f"{source}: model_type is {config.get('model_type')!r}, not 'gpt_neox'; only GPT-NeoX "
                              f"(e.g. Pythia) model directories are loaded")
        if config.get("auto_map"):
            raise ConfigError(f"{source}: names code of its own (auto_map); only transformers' GPT-NeoX is loaded, "
                              f"and no code from a model directory is run")
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            raise ConfigError(f"{source}: rope scaling {rope.get('rope_type', rope.get('type'))!r} is not supported; "
                              f"only plain rotary embeddings")
        try:
            return cls(
                name=name, vocab_size=int(config["vocab_size"]), hidden_size=int(config["hidden_size"]),
                num_hidden_layers=int(config["num_hidden_layers"]),
                num_attention_heads=int(config["num_attention_heads"]),
                intermediate_size=int(config["intermediate_size"]),
                max_position_embeddings=int(config["max_position_embeddings"]),
                rotary_pct=float(rope.get("partial_rotary_factor", config.get("rotary_pct", 0.25))),
                rotary_emb_base=float(rope.get("rope_theta", config.get("rotary_emb_base", 10000.0))),
                use_parallel_residual=bool(config.get("use_parallel_residual", True)),
                layer_norm_eps=float(config.get("layer_norm_eps", 1e-5)),
                attention_bias=bool(config.get("attention_bias", True)),
                hidden_act=str(config.get("hidden_act", "gelu")),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                initializer_range=float(config.get("initializer_range", 0.02)),
                pad_vocab_multiple=1)
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{source}: not a usable GPT-NeoX config ({type(exc).__name__}: {exc})") from None

    def to_dict(self) -> dict:
        return asdict(self) | {"padded_vocab_size": self.padded_vocab_size}


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
