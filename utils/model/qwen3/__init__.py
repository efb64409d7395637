"""The Qwen3 family (dense Qwen3: 0.6B to 32B): the pre-norm decoder of the shared blocks with QK-norm (an
RMSNorm on each head of q and k before rotary), an explicit head_dim (128 at hidden 1024 with 16 heads),
grouped-query attention, SwiGLU, tied embeddings for the small ones, sliding-window layers where a config
turns them on. Its native model is utils/model/common/decoder.py's; its transformers side
(Qwen3ForCausalLM) hf.py.

Layer: configs (a torch-free description the config layer reads: presets, counts, the registry).
"""
from utils.model.architecture import ModelSpec
from utils.model.family import (
    DECODER_RESIDUAL_OUTPUTS,
    Family,
    Sizes,
    decoder_activations,
    decoder_block_parameters,
    decoder_muon_matrices,
    qk_norm_and_full_rotary,
)


def check(spec: ModelSpec) -> None:
    qk_norm_and_full_rotary(spec, "Qwen3")


def _qwen3(name: str, sizes: Sizes, head_dim: int, **kw) -> ModelSpec:
    return ModelSpec(name, **sizes._asdict(), family="qwen3", attention_head_dim=head_dim, qk_norm=True,
                     rotary_pct=1.0, rotary_emb_base=kw.pop("theta", 1000000.0), layer_norm_eps=1e-6,
                     use_parallel_residual=False, attention_bias=False, hidden_act="silu",
                     tie_word_embeddings=kw.pop("tied", True), initializer_range=0.02, pad_vocab_multiple=1, **kw)

PRESETS = (
    # Published shapes (Qwen/Qwen3-0.6B, Qwen3-1.7B config.json), no weights: start from a downloaded model with
    # init_from. 596,049,920 and 1,720,574,976 parameters with the tied head counted once (their files store
    # the head again: 752M and 2.03B on the hub).
    # Sizes: vocabulary, hidden, layers, heads, k/v heads, MLP, positions; then head_dim.
    _qwen3("qwen3-0.6b", Sizes(151936, 1024, 28, 16, 8, 3072, 40960), 128),
    _qwen3("qwen3-1.7b", Sizes(151936, 2048, 28, 16, 8, 6144, 40960), 128),
    # The unit-test size: head_dim 32 (not hidden / heads = 16), GQA, its second layer a 16-token sliding window.
    _qwen3("qwen3-tiny", Sizes(512, 64, 2, 4, 2, 128, 64), 32, theta=10000.0, sliding_window=16,
           layer_types=("full", "sliding")),
)

FAMILY = Family(
    name="qwen3", presets=PRESETS,
    fields=("num_key_value_heads", "attention_head_dim", "qk_norm", "rope_scaling", "sliding_window", "layer_types"),
    model="utils.model.common.decoder:Decoder", adapter="utils.model.qwen3.hf:ADAPTER", hf_model_types=("qwen3",),
    block_parameters=decoder_block_parameters, muon_matrices=decoder_muon_matrices,
    block_activations=decoder_activations,
    residual_outputs=DECODER_RESIDUAL_OUTPUTS, check=check,
)
