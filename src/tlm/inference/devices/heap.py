"""The process's heap (glibc's malloc): freed memory kept for the next training step, or
handed back once a model for decoding has released its fp32 weights.

glibc's malloc serves a request above its mmap threshold (128 KB at first, raised to the
largest block freed since, up to 32 MB) with fresh pages from the kernel, and hands them
back when the block is freed; free memory at the top of its heap beyond the trim threshold
(128 KB at first, then twice the mmap threshold) goes back too. A training step allocates
and frees the same large activations every step, so every step takes their pages anew: a
page fault and a zeroed 4 KB page each. On nanoGPT's 6-layer Shakespeare-char shape (batch
16 × 256) that was 20,000-86,000 faults a step and about a tenth of its time
(docs/benchmarks-history.md).

`keep_freed_memory` sets the mmap threshold to glibc's ceiling and the trim threshold out
of reach, so freed blocks stay in the heap and the next step reuses them. The process then
holds its peak memory between steps rather than returning it: what a training process
needs again a step later anyway. It changes malloc for the whole process; `open_run` calls
it for a run on a CPU. `free_to_system` goes the other way, once: `prepare.py` calls it after
releasing fp32 matrices whose packed copies do their work. Where the C library is not glibc
(macOS, musl) both do nothing.
"""

from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
MMAP_CEILING = 32 * 2**20  # glibc's largest mmap threshold on a 64-bit host
NEVER_TRIM = 2**30  # free bytes at the heap's top before any go back to the kernel


try:
    LIBC = ctypes.CDLL("libc.so.6")  # glibc's soname
    LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
except (OSError, AttributeError):  # not glibc
    LIBC = None


def keep_freed_memory() -> bool:
    """Set glibc's malloc to keep freed blocks of up to 32 MB for reuse. Returns whether it
    did (False where the C library is not glibc)."""
    if LIBC is None:
        return False
    # mallopt returns 1 on success, 0 for a value it refuses
    return bool(
        LIBC.mallopt(M_MMAP_THRESHOLD, MMAP_CEILING) and LIBC.mallopt(M_TRIM_THRESHOLD, NEVER_TRIM)
    )


def free_to_system() -> None:
    """Hand the memory freed so far back to the system (glibc's malloc_trim). Released
    weights leave holes in the heap that glibc would keep for later use, and that a
    resident-memory figure keeps counting."""
    if LIBC is not None:
        LIBC.malloc_trim(0)
