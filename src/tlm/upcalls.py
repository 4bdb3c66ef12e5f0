"""The calls the math makes to a layer above it, without importing that layer.

`model/` is the math only and imports nothing above it (docs/architecture.md), yet
`TransformerLM.generate`, the Hugging Face-style convenience, runs `tlm.generate`'s
decoding policy, which is built on the model (its decoder, its caches, its packed
formats): a method that imported it would close a circle of imports through every layer
in between. So the model calls `generate_sequences` here, and the package's root
(`tlm/__init__.py`), which stands above every layer and runs before any module of the
package is imported, provides what it forwards to. Whatever a program imports first, the
call is provided; this module imports nothing of tlm.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_provided: dict[str, Callable[..., Any]] = {}  # what the root provides, once, by name


def provide(*, generate_sequences: Callable[..., Any]) -> None:
    """The package root's wiring: `generate_sequences(model, input_ids, attention_mask,
    **settings) -> [B*n, T + new]` (`tlm/generate/sequences.py`)."""
    _provided["generate_sequences"] = generate_sequences


def generate_sequences(model: Any, input_ids: Any, attention_mask: Any = None, **settings) -> Any:
    """`TransformerLM.generate`'s decoding: the function the package root provided."""
    return _provided["generate_sequences"](model, input_ids, attention_mask, **settings)
