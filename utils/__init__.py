"""The engine's parts; see README.md "Layout"."""
from utils import quiet_imports  # noqa: F401  (torchao's import noise on CPU machines: see that module)
