"""The Gemma 3 text family (Gemma3ForCausalLM: gemma-3-270m, gemma-3-1b): sliding-window and global layers in
a pattern (five local to one global), each kind with its rotary base (10,000 local, 1,000,000 global), the
attention scaled by query_pre_attn_scalar, QK-norm, head_dim 256, a GeGLU MLP (gelu_pytorch_tanh), four
norms a block (before and after attention and MLP), Gemma's 1 + weight RMSNorm, the embedding scaled by
sqrt(hidden_size), tied embeddings, final logit softcapping where a config has it. Its native model is
model.py, its transformers side hf.py.

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
    qk_norm_and_full_rotary(spec, "Gemma 3")


def pattern(layers: int, every: int = 6) -> tuple[str, ...]:
    """Gemma 3's layer kinds: every `every`-th layer global ("full"), the others sliding."""
    return tuple("full" if (i + 1) % every == 0 else "sliding" for i in range(layers))


def _gemma3(name: str, sizes: Sizes, head_dim: int, window: int, **kw) -> ModelSpec:
    return ModelSpec(name, **sizes._asdict(), family="gemma3", attention_head_dim=head_dim, qk_norm=True,
                     rotary_pct=1.0, rotary_emb_base=1000000.0, rope_local_base=10000.0, layer_norm_eps=1e-6,
                     use_parallel_residual=False, attention_bias=False, hidden_act="gelu_pytorch_tanh",
                     tie_word_embeddings=True, initializer_range=0.02, pad_vocab_multiple=1, sliding_window=window,
                     layer_types=kw.pop("layer_types", pattern(sizes.num_hidden_layers)),
                     query_pre_attn_scalar=kw.pop("scalar", 256), **kw)

PRESETS = (
    # Published shapes (google/gemma-3-270m, gemma-3-1b-pt config.json), no weights: start from a downloaded
    # model with init_from. 268,098,176 and 999,885,952 parameters.
    # Sizes: vocabulary, hidden, layers, heads, k/v heads, MLP, positions; then head_dim and the window.
    _gemma3("gemma-3-270m", Sizes(262144, 640, 18, 4, 1, 2048, 32768), 256, 512),
    _gemma3("gemma-3-1b", Sizes(262144, 1152, 26, 4, 1, 6912, 32768), 256, 512),
    # The unit-test size: head_dim 32 (not hidden / heads = 16), GQA, a 16-token window on the first layer and
    # a global second one, query_pre_attn_scalar 24 (not head_dim).
    _gemma3("gemma3-tiny", Sizes(512, 64, 2, 4, 2, 128, 64), 32, 16, layer_types=("sliding", "full"), scalar=24),
)

FAMILY = Family(
    name="gemma3", presets=PRESETS,
    fields=("num_key_value_heads", "attention_head_dim", "qk_norm", "sliding_window", "layer_types",
            "rope_local_base", "query_pre_attn_scalar", "final_logit_softcapping"),
    model="utils.model.gemma3.model:Gemma3", adapter="utils.model.gemma3.hf:ADAPTER", hf_model_types=("gemma3_text",),
    block_parameters=lambda spec: decoder_block_parameters(spec, norms=4), muon_matrices=decoder_muon_matrices,
    block_activations=lambda spec: decoder_activations(spec, sandwich=True),
    residual_outputs=DECODER_RESIDUAL_OUTPUTS, check=check,
)
