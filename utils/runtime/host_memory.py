"""Training on the CPU keeps the large blocks it frees, instead of handing them back to the OS every step.

A step allocates and frees several buffers the size of the vocabulary: the LM-head loss's logits and their
softmax (2,032 x 50,304 fp32 = 409 MB each with GPT-2's vocabulary and the `cpu` preset's batch), the
embedding's and head's gradients, the optimizer's temporaries. Most are made inside torch's own operators.
glibc serves every allocation above its mmap threshold (which never rises above 32 MiB) with a fresh
mmap and unmaps it on free, so each step page-faults all of them in again: with GPT-2's vocabulary a third
of the CPU time went to the kernel (benchmarks/RESULTS.md). With mmap off and the heap's trim threshold
high, freed blocks stay in the heap and the next step reuses them: no fault, the same peak memory.

Only for training on the CPU: CUDA's caching allocator keeps device memory already, and a GPU host's big
transient host allocations (loading a checkpoint) should go back to the OS.
"""
from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD = -1  # glibc's <malloc.h>
M_MMAP_MAX = -4
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: free heap top is returned above 2 GiB only


def keep_freed_host_memory() -> bool:
    """Sets glibc's malloc to keep freed memory (see the module docstring); True when it took the settings,
    False with another C library (musl, macOS), where nothing changes."""
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own C library
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
