"""The GPT-NeoX family (Pythia, the seed's gpt-neox-1.2b): the native model (model.py), transformers' class
with the engine's interface and the HF adapter (hf.py). Registered in utils/model/families.py."""
from utils.model.gpt_neox.model import *  # noqa: F401,F403
from utils.model.gpt_neox.model import (  # noqa: F401
    ACTIVATIONS, Attention, Block, CausalLM, ChunkedLMHeadLoss, FlopsMixin, GPTNeoX, LMHead, MLP, _flex_attention,
    apply_rotary, chunked_loss_only, document_ids, document_mask, positions_in_documents, rotary_tables)
