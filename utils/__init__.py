"""The engine's parts; see README.md "Layout"."""
import logging

# transformers imports torchao (when installed) to look for quantized weights; where torchao's CUDA
# extensions cannot load (a CPU machine), that import logs harmless warnings into every command's output.
logging.getLogger("torchao").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
