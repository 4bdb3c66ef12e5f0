"""`keep_freed_memory`: glibc's malloc keeps a training step's freed blocks for the next step
instead of handing their pages back to the kernel (`inference/devices/heap.py`)."""

import os
import subprocess
import sys

import pytest

from tlm.inference.devices import heap

pytestmark = pytest.mark.skipif(heap.LIBC is None, reason="the C library is not glibc")

# In a fresh process: free one 24 MB tensor, then ask malloc how many free bytes its heap
# keeps (mallinfo2's fordblks: freed, not returned to the kernel).
CHILD = """
import ctypes, sys, torch
from tlm.inference.devices.heap import keep_freed_memory
kept = sys.argv[1] == "keep" and keep_freed_memory()
x = torch.ones(6 * 2**20)  # 24 MB, every page touched
del x
FIELDS = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
class Info(ctypes.Structure):  # struct mallinfo2 (malloc.h)
    _fields_ = [(name, ctypes.c_size_t) for name in FIELDS.split()]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
print(kept, libc.mallinfo2().fordblks)
"""


def free_bytes_kept(keep: bool) -> tuple[str, int]:
    """(whether the child set it, the free bytes its heap keeps) in a child with glibc's
    defaults (no MALLOC_* or GLIBC_TUNABLES settings from this environment)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_"))}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, "keep" if keep else "default"],
        capture_output=True, text=True, check=True, env=env,
    )  # fmt: skip
    kept, free = done.stdout.split()
    return kept, int(free)


def test_a_freed_block_stays_in_the_heap_for_the_next_step():
    kept, free = free_bytes_kept(keep=False)
    assert kept == "False" and free < 24 * 2**20  # glibc's own setting: its pages went back
    kept, free = free_bytes_kept(keep=True)
    assert kept == "True" and free >= 24 * 2**20  # the block is there to reuse


def test_open_run_keeps_freed_memory_on_a_cpu(docs_chars, tmp_path, monkeypatch):
    from tlm.train import new_run_configs, open_run, opening

    calls = []
    monkeypatch.setattr(opening, "keep_freed_memory", lambda: calls.append(1))
    shape = {"n_layers": 1, "d_model": 16, "n_heads": 2, "context_length": 16}
    values = {"data": str(docs_chars), "out": str(tmp_path / "run"), "max_steps": 1}
    model_config, train_config, token_data = new_run_configs(shape, values)
    tokenizer_json = (docs_chars / "tokenizer.json").read_text()
    open_run(model_config, train_config, token_data, tokenizer_json, progress_bar=False)
    assert calls == [1]
