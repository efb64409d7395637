"""The GPT-NeoX family (Pythia, the seed's gpt-neox-1.2b): LayerNorm, a plain GELU MLP, fused per-head QKV,
partial rotary, parallel residual. Its native model is model.py, its transformers side hf.py; this bundle is
what the engine knows of it (utils/model/family.py).

Layer: configs (a torch-free description the config layer reads: presets, counts, the registry).
"""
from utils.model.architecture import ModelSpec
from utils.model.family import Family


def block_parameters(spec: ModelSpec) -> int:
    """Fused QKV and dense (biases with attention_bias), the 2-matrix MLP with biases, 2 LayerNorms, and with
    qk_norm a LayerNorm on each head of q and of k."""
    h, f = spec.hidden_size, spec.intermediate_size
    return 4 * h * h + 2 * h * f + 4 * h * spec.attention_bias + (f + h) + 4 * h + 4 * spec.head_dim * spec.qk_norm


def muon_matrices(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    h, f = spec.hidden_size, spec.intermediate_size
    return {"attention.query_key_value": (3 * h, h), "attention.dense": (h, h), "mlp.dense_h_to_4h": (f, h),
            "mlp.dense_4h_to_h": (h, f)}


def block_activations(spec: ModelSpec) -> float:
    """17 values (34 bytes in bf16) per token and hidden unit: Korthikanti et al. 2022's count for this block
    with fused attention (no attention matrix); `saved_activation_bytes` measures 18 on the native model."""
    return 17 * spec.hidden_size


def _pythia(size: str, h: int, layers: int, heads: int, rows: int) -> ModelSpec:
    return ModelSpec(f"pythia-{size}", vocab_size=rows, hidden_size=h, num_hidden_layers=layers,
                     num_attention_heads=heads, intermediate_size=4 * h, max_position_embeddings=2048)


PRESETS = (
    # The seed's architecture: 50257 GPT-2 BPE ids, padded to 50304 embedding rows.
    ModelSpec("gpt-neox-1.2b", vocab_size=50257, hidden_size=2048, num_hidden_layers=24,
              num_attention_heads=16, intermediate_size=8192, max_position_embeddings=2048),
    # The Pythia suite (EleutherAI): its exact shapes, 2048 positions, rotary on 25% of each head, parallel
    # residual, untied head, 50304 embedding rows (50432 for 6.9b: its tokenizer's 50277 ids, padded).
    # Parameter counts, as published (tests/e2e/test_fsdp.py checks them): 162.3M, 405.3M, 1.012B, 1.415B,
    # 2.775B, 6.857B.
    _pythia("160m", 768, 12, 12, 50304), _pythia("410m", 1024, 24, 16, 50304), _pythia("1b", 2048, 16, 8, 50304),
    _pythia("1.4b", 2048, 24, 16, 50304), _pythia("2.8b", 2560, 32, 32, 50304), _pythia("6.9b", 4096, 32, 32, 50432),
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

FAMILY = Family(
    name="gpt_neox", presets=PRESETS, fields=("qk_norm",),
    model="utils.model.gpt_neox.model:GPTNeoX", adapter="utils.model.gpt_neox.hf:ADAPTER", hf_model_types=("gpt_neox",),
    block_parameters=block_parameters, final_norm_parameters=lambda spec: 2 * spec.hidden_size,
    muon_matrices=muon_matrices, block_activations=block_activations,
    residual_outputs=("attention.dense", "mlp.dense_4h_to_h"),
)
