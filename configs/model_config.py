"""Model architectures by name. `gpt-neox-1.2b` is the seed's model; the small ones exist for CPU runs."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from utils.errors import UserError


class ConfigError(UserError, ValueError):
    """A configuration problem the user can fix; the message says what and how."""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    vocab_size: int  # the tokenizer's vocabulary: every token id in the data must be below this
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    rotary_pct: float = 0.25
    use_parallel_residual: bool = True
    pad_vocab_multiple: int = 128  # embedding rows padded so the LM-head matmul is tensor-core friendly

    @property
    def padded_vocab_size(self) -> int:
        m = self.pad_vocab_multiple
        return ((self.vocab_size + m - 1) // m) * m

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def to_hf_config(self, attn_implementation: str = "sdpa"):
        from transformers import GPTNeoXConfig

        cfg = GPTNeoXConfig(
            vocab_size=self.padded_vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            intermediate_size=self.intermediate_size,
            max_position_embeddings=self.max_position_embeddings,
            rotary_pct=self.rotary_pct,
            use_parallel_residual=self.use_parallel_residual,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            tie_word_embeddings=False,
            use_cache=False,
            bos_token_id=0,
            eos_token_id=0,
        )
        cfg._attn_implementation = attn_implementation
        return cfg

    def to_dict(self) -> dict:
        return asdict(self) | {"padded_vocab_size": self.padded_vocab_size}


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        # The seed's architecture: 50257 GPT-2 BPE ids, padded to 50304 embedding rows.
        ModelSpec("gpt-neox-1.2b", vocab_size=50257, hidden_size=2048, num_hidden_layers=24,
                  num_attention_heads=16, intermediate_size=8192, max_position_embeddings=2048),
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
