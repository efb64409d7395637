"""The Llama family (Llama 3.x, SmolLM2, Qwen2/2.5): the pre-norm decoder of the shared blocks (RMSNorm,
SwiGLU, grouped-query attention, rotary on every head dim with Llama 3's frequency scaling where published,
tied or untied head, biases on q/k/v/o or on q/k/v only for Qwen2). Its native model is
utils/model/common/decoder.py's; its transformers side (LlamaForCausalLM / Qwen2ForCausalLM) hf.py. With
`qk_norm` it is Qwen3's architecture and exports as Qwen3ForCausalLM.

Layer: configs (a torch-free description the config layer reads: presets, counts, the registry).
"""
from utils.errors import ConfigError
from utils.model.architecture import ModelSpec
from utils.model.family import (
    DECODER_RESIDUAL_OUTPUTS,
    Family,
    Sizes,
    decoder_activations,
    decoder_block_parameters,
    decoder_muon_matrices,
)


def check(spec: ModelSpec) -> None:
    if spec.hidden_act != "silu":
        raise ConfigError(f"model '{spec.name}': the llama family's MLP is SwiGLU (hidden_act 'silu'), not "
                          f"'{spec.hidden_act}'")
    if spec.rotary_pct != 1.0:
        raise ConfigError(f"model '{spec.name}': the llama family rotates every head dim (rotary_pct 1.0)")
    if spec.qk_norm and spec.qkv_bias:
        raise ConfigError(f"model '{spec.name}': qk_norm with qkv_bias has no transformers class (Qwen3 has "
                          f"QK-norm and biases on q/k/v/o or none); use attention_bias or no biases")


def _llama(name: str, sizes: Sizes, theta: float, eps: float, **kw) -> ModelSpec:
    """A Llama-family preset with a published model's shapes (tied embeddings, as all of these have)."""
    return ModelSpec(name, **sizes._asdict(), family="llama", rotary_pct=1.0, rotary_emb_base=theta,
                     layer_norm_eps=eps, use_parallel_residual=False, attention_bias=False, hidden_act="silu",
                     tie_word_embeddings=True, initializer_range=kw.pop("init"), pad_vocab_multiple=1, **kw)


PRESETS = (
    # Published shapes, no weights: start from a model you downloaded with init_from (docs/models.md).
    # Embedding rows as published (no padding). Sizes: vocabulary, hidden, layers, heads, k/v heads, MLP, positions.
    _llama("llama-3.2-1b", Sizes(128256, 2048, 16, 32, 8, 8192, 131072), 500000.0, 1e-5, init=0.02,
           rope_scaling=(32.0, 1.0, 4.0, 8192)),
    _llama("smollm2-135m", Sizes(49152, 576, 30, 9, 3, 1536, 8192), 100000.0, 1e-5, init=0.041666666666666664),
    _llama("smollm2-360m", Sizes(49152, 960, 32, 15, 5, 2560, 8192), 100000.0, 1e-5, init=0.02),
    _llama("smollm2-1.7b", Sizes(49152, 2048, 24, 32, 32, 8192, 8192), 130000.0, 1e-5, init=0.02),
    _llama("qwen2.5-0.5b", Sizes(151936, 896, 24, 14, 2, 4864, 32768), 1000000.0, 1e-6, init=0.02, qkv_bias=True),
    _llama("qwen2.5-1.5b", Sizes(151936, 1536, 28, 12, 2, 8960, 131072), 1000000.0, 1e-6, init=0.02, qkv_bias=True),
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
)

FAMILY = Family(
    name="llama", presets=PRESETS, fields=("num_key_value_heads", "rope_scaling", "qkv_bias", "qk_norm"),
    model="utils.model.common.decoder:Decoder", adapter="utils.model.llama.hf:ADAPTER",
    hf_model_types=("llama", "qwen2"), block_parameters=decoder_block_parameters,
    muon_matrices=decoder_muon_matrices, block_activations=decoder_activations,
    residual_outputs=DECODER_RESIDUAL_OUTPUTS, check=check,
)
