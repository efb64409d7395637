"""The Llama family (Llama 3.x, SmolLM2, Qwen2/2.5): the native model (model.py), transformers' classes with
the engine's interface and the HF adapter (hf.py). Registered in utils/model/families.py."""
from utils.model.llama.model import RMSNorm, Llama, llama_inv_freq  # noqa: F401
