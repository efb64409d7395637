"""Leaves out two warnings a CPU machine prints whenever transformers loads a model (transformers imports
torchao, when installed, to look for quantized weights): torchao's `Failed to load .../_C_*.so` (its CUDA
kernels, which cannot load without a GPU and which float8 training does not need) and torch's pytree
deprecation notes about torchao's Enum classes. Nothing else from either logger is hidden.

Standalone on purpose (no imports from the package): setup.sh copies it into the venv's site-packages with
a `.pth` hook, so it applies to every Python in `.venv`, also a user's own `AutoModelForCausalLM` script
that never imports this repository; `utils/__init__.py` applies it too, for venvs set up before."""
import logging

NOISE = {"torchao": ("Failed to load ", ".so"), "torch.utils._pytree": ("<enum ", "is an Enum subclass")}


def _drop(prefix: str, fragment: str):
    def keep(record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith(prefix) and fragment in message)
    keep.neox_quiet = True
    return keep


def install() -> None:
    """Adds the filters (once) to the two loggers."""
    for name, (prefix, fragment) in NOISE.items():
        logger = logging.getLogger(name)
        if not any(getattr(f, "neox_quiet", False) for f in logger.filters):
            logger.addFilter(_drop(prefix, fragment))


install()
