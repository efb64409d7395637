"""The blocks every model family composes (torchtitan's `models/common/`): norms (LayerNorm, RMSNorm, Gemma's
1 + weight RMSNorm), rotary tables (plain, partial, Llama 3's scaling; one base per attention kind), attention
(grouped-query, an explicit head_dim, optional QK-norm, a scale of its own; the kernel call and the masks for
causal, sliding-window and document attention), MLPs (gated and plain), the scaled embedding, and the
pre-norm decoder that Llama-style families are. A family's folder picks and names them; the math lives here
once.
"""
