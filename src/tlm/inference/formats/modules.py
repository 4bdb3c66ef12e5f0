"""The model's modules for inference: the same math, each product run through a kernel.

Each class here subclasses a module of `tlm.model` and overrides only the method that
computes one product (`project_qkv`, `project_out`, `up`, `down`, `tokens`, `unembed`), so
a reader of `model/attention.py` sees all the math, and this file lists everything that
changes for inference. `prepare.py` builds a model of these from a trained one (`derived`
keeps the trained module's parameters, buffers and hook points; `swapped` replaces modules
along a tree without touching the original tree) and sets the kernels (`kernels.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import nullcontext

import torch
from torch import Tensor, nn

from tlm.inference.decoding import step
from tlm.inference.devices.threads import on_threads
from tlm.inference.formats.blas import needs_one_thread
from tlm.inference.formats.kernels import Route
from tlm.inference.slot_cache import SlotPass
from tlm.model.attention import MultiHeadAttention
from tlm.model.kv_cache import Cache
from tlm.model.layers import Embedding, FeedForward
from tlm.model.transformer import TransformerLM

Kernel = Callable[[Tensor], Tensor | tuple[Tensor, ...]]  # x [..., in] -> y [..., out] (or parts)


class FastAttention(MultiHeadAttention):
    """Attention whose Q, K, V (one product) and W^O run through kernels."""

    qkv_kernel: Kernel
    out_kernel: Kernel

    def project_qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return self.qkv_kernel(x)

    def project_out(self, z: Tensor) -> Tensor:
        return self.out_kernel(z)


class FastFeedForward(FeedForward):
    """The FFN whose x W_1 + b_1 and h W_2 + b_2 run through kernels."""

    up_kernel: Kernel
    down_kernel: Kernel

    def up(self, x: Tensor) -> Tensor:
        return self.up_kernel(x)

    def down(self, h: Tensor) -> Tensor:
        return self.down_kernel(h)


class FastEmbedding(Embedding):
    """Token embeddings looked up from rows kept in the inference format (or in the file)."""

    lookup: Kernel | None = None  # None: E's own rows

    def tokens(self, input_ids: Tensor) -> Tensor:
        return super().tokens(input_ids) if self.lookup is None else self.lookup(input_ids)


FEW = 64  # tokens: a pass of at most this many runs its fp32 products on the decoding route


def joining(cache: object) -> bool:
    """Whether a pass feeds a prompt (or a chunk of one) beside rows that decode: a batch
    already, whose products have their layout (a lone prompt reads the parameters)."""
    return isinstance(cache, SlotPass) and 1 in cache.counts and max(cache.counts) > 1


class InferenceLM(TransformerLM):
    """A `TransformerLM` whose products run in `inference_format`, for generation and
    scoring: hook points, caches and outputs are the trained model's; training is refused."""

    inference_format = "float32"
    head: Kernel
    route: Route  # shared with its float32 products

    def forward(
        self,
        input_ids: Tensor,
        cache: Cache | None = None,
        attention_mask: Tensor | None = None,
        last_only: bool = False,
    ) -> Tensor:
        """`TransformerLM.forward`. In a pass without autograd that feeds one token to each
        row of a cache (a decoding step), or at most `FEW` tokens in all where a prompt joins
        rows that decode (`joining`: torch's product is slow for so few rows, 131 -> 95 ms
        for a 32-token prompt joining 7 GPT-2 rows on the 2-core host), the float32
        products take their decoding route (`kernels.Route`) for the length of the pass;
        for one row whose products go through numpy's BLAS, torch keeps one thread
        meanwhile, since numpy has the cores (`blas.py`)."""
        rows = step.rows_of(cache, input_ids)
        few = joining(cache) and input_ids.numel() <= FEW  # a prompt joins decoding rows
        if (rows is None and not few) or torch.is_grad_enabled() or self.route.rows:
            return super().forward(input_ids, cache, attention_mask, last_only)
        R = input_ids.numel() if rows is None else len(rows[0])
        one_thread = R == 1 and self.inference_format == "float32" and needs_one_thread()
        self.route.rows = R
        try:
            with on_threads(1) if one_thread else nullcontext():
                return super().forward(input_ids, cache, attention_mask, last_only)
        finally:
            self.route.rows = 0

    def unembed(self, h: Tensor) -> Tensor:
        return self.head(h)

    def unembedding(self) -> Tensor:
        if self.inference_format != "float32":
            raise RuntimeError(f"the model keeps its weights in {self.inference_format} only")
        return super().unembedding()

    def train(self, mode: bool = True) -> InferenceLM:
        if mode:
            raise RuntimeError("this model was built for inference (for_inference); reload it")
        return super().train(False)


def derived(module: nn.Module, cls: type[nn.Module]) -> nn.Module:
    """`module` as an object of its subclass `cls`: the same parameters, buffers, hook
    points and settings, in mappings of its own, so that replacing a child or a parameter
    of the new object leaves `module` as it was."""
    if not isinstance(module, cls.__mro__[1]):
        raise TypeError(f"{cls.__name__} is built from a {cls.__mro__[1].__name__}")
    new = cls.__new__(cls)
    new.__dict__.update(module.__dict__)
    new._modules = dict(module._modules)
    new._parameters = dict(module._parameters)
    return new


def swapped(module: nn.Module, swap: Mapping[type[nn.Module], type[nn.Module]]) -> nn.Module:
    """A tree like `module` in which each module of a type in `swap` is `derived` as
    swap[type]; the modules above a swapped one are shallow copies, the rest are shared."""
    new = derived(module, swap[type(module)]) if type(module) in swap else None
    children = {
        name: None if child is None else swapped(child, swap)
        for name, child in module._modules.items()
    }
    if new is None and all(children[n] is c for n, c in module._modules.items()):
        return module
    if new is None:
        new = module.__class__.__new__(module.__class__)
        new.__dict__.update(module.__dict__)
    new._modules = children
    return new


SWAP = {
    TransformerLM: InferenceLM,
    MultiHeadAttention: FastAttention,
    FeedForward: FastFeedForward,
    Embedding: FastEmbedding,
}
