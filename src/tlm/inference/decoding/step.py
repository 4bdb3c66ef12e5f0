"""A decoding step in few calls: the weight products, and one C call between each two.

At batch 1 a decoding step is 49 weight products (4 per layer and the head) with a dozen
small operations between each two (LayerNorm, residual adds, writing the new key and
value, one query's attention). One torch operation costs a few µs to dispatch, and a
module call or hook point more; together they took a third to a half of a step
(docs/benchmarks-history.md, "Decoding without per-token overhead"). Here, for a pass in which
every row feeds one token, the stretch between two products is one call into `step.c`
(`native.py`):

    h = LN1(x)                                  add_norm (no add)
    q, k, v = h W^QKV + b                       product
    z = attention of q over the cache + k, v    attend_one (stores k and v)
    x += z W^O + b;  h = LN2(x)                 product, add_norm
    x += act(h W_1 + b_1) W_2 + b_2;  h = LN1'(x)  products, activate, add_norm
    logits = h E^T (after LN_f)                 product

The products are the model's own kernels (`kernels.py`), so every weight format runs the
same way. Where every product's kernel is one of tlm's own (`products.c`), the same loop,
products included, is one call into `step.c` (`decode_step`, on the model described by
`program.py`): no Python between the products at all. The step is taken only when it
means the same as the model's forward pass: a pre-norm model in eval mode on the CPU in
fp32 activations, no attention mask, one token per row of a `KVCache` or a `SlotCache`
pass, and no hook listening anywhere (a hooked model runs `TransformerLM.forward`, so
every hook point sees its activation). The `Decoder` (`decoder.py`) asks that question
and holds what these functions read (the layers, the programs, the scratch); tests hold
both ways of taking the step equal to the forward pass in every format and cache. Over a
`SlotCache` it runs without the forward pass and its per-pass checks around it (0.15-0.2
ms a token of int8 GPT-2: docs/benchmarks-history.md).
"""

from __future__ import annotations

import ctypes
from contextlib import nullcontext

import torch
from torch import Tensor

from tlm.inference import native
from tlm.inference.decoding import program
from tlm.inference.devices.threads import on_threads
from tlm.inference.formats.blas import needs_one_thread
from tlm.inference.slot_cache import SlotCache, SlotPass
from tlm.model.kv_cache import KVCache
from tlm.model.layers import LayerNorm, PreNormBlock
from tlm.model.positions import rotary_frequencies
from tlm.tensor_files import TensorFileError

RMS_EPS = torch.finfo(torch.float32).eps  # F.rms_norm's default, the qk_norm of attention
ACTIVATIONS = {"relu": 0, "gelu": 1, "gelu_tanh": 2, "relu2": 3}  # step.c's `activate`
LOOKUP_RANGE, LOOKUP_READ = -3, -4  # look_up's errors: an id out of range, a short read


def rows_of(cache: object, input_ids: Tensor) -> tuple[list[int], list[int]] | None:
    """(slot, position) of each row of a pass that feeds one token per row, or None."""
    if isinstance(cache, KVCache) and input_ids.shape[1] == 1:
        B = input_ids.shape[0]
        return list(range(B)), [cache.length] * B
    if isinstance(cache, SlotPass) and set(cache.counts) == {1}:
        return cache.slots, [cache.cache.lengths[slot] for slot in cache.slots]
    return None


def steppable(model, store: Tensor | None) -> bool:
    """Whether `Decoder.step` means the same as the model's forward pass (see the module)
    for a pass into the key store `store`, hooks aside (they come and go: the `Decoder`
    asks about them each step)."""
    if model.training or native.library() is None:
        return False  # dropout: the forward pass has it
    if store is None or store.device.type != "cpu" or store.dtype != torch.float32:
        return False
    if not (isinstance(model.ln_f, LayerNorm) and type(model.blocks[0]) is PreNormBlock):
        return False
    if model.config.activation not in ACTIVATIONS or model.config.rope_scaling == "dynamic":
        return False  # dynamic: the angles change with the length, the C step reads tables
    P = model.embedding.P  # added row by row in C: fp32 rows of d
    return P is None or (P.dtype == torch.float32 and P.is_contiguous())


def keys_of(cache: object) -> Tensor | None:
    """The key store of a `KVCache` or of a `SlotPass`'s cache; None for any other cache."""
    if isinstance(cache, KVCache):
        return getattr(cache, "k", None)
    return cache.cache.k if isinstance(cache, SlotPass) else None


def hook_dicts(model) -> list[dict]:
    """Every dict a forward hook of `model` can be registered in: each module's and
    torch's global ones (registering adds to them, never replaces them, so a list made
    once answers "is anyone listening?" in one pass)."""
    modules = list(model.modules())
    hooks = [m._forward_hooks for m in modules] + [m._forward_pre_hooks for m in modules]
    hooks += [torch.nn.modules.module._global_forward_hooks]
    return hooks + [torch.nn.modules.module._global_forward_pre_hooks]


class Scratch:
    """What a whole step of a `SlotCache` reads and writes, made once by the `Decoder` and
    reused, so that such a step runs no torch operation: its rows' token ids, positions and
    slots, the residual stream, the logits and greedy's choices, for up to every slot at
    once, with numpy views of what Python writes and reads, and their addresses. Python's
    work between two steps runs after the step's weights have streamed through the caches,
    and a torch operation then costs 30-45 µs (docs/benchmarks-history.md)."""

    def __init__(self, slots: int, d: int, vocab: int) -> None:
        self.slots, self.vocab = slots, vocab
        with torch.device("cpu"):  # the C step's: read and written by C
            self.places = torch.empty(3 * slots, dtype=torch.int64)  # ids, positions, slots
            self.x, self.logits = torch.empty(slots, d), torch.empty(slots, vocab)
            self.words, self.logprobs = torch.empty(slots, dtype=torch.int64), torch.empty(slots)
        self.places_, self.words_, self.logprobs_ = (
            t.numpy() for t in (self.places, self.words, self.logprobs)
        )
        self.views = [self.logits[:R] for R in range(slots + 1)]  # logits of R rows
        self.at, self.size = self.places.data_ptr(), self.places.element_size()
        self.addresses = [t.data_ptr() for t in (self.x, self.logits, self.words, self.logprobs)]


def scratch_step(
    model,
    whole,
    s: Scratch,
    cache: SlotCache,
    slots: list[int],
    positions: list[int],
    tokens: list[int],
    greedy: bool,
) -> tuple[Tensor, list[tuple[int, float]] | None]:
    """A whole step as one C call on the scratch `s`, token r at positions[r] of `cache`'s
    slot slots[r]: logits [R,V] (a view of `s`, valid until its next step) and, with
    `greedy`, each row's (ŵ, log P(ŵ))."""
    R = len(slots)
    s.places_[: 3 * R] = tokens + positions + slots
    (x, logits, words, logprobs), at, size = s.addresses, s.at, s.size
    if not greedy:
        words = logprobs = None
    _decode_step(
        model, whole, R, x, at, cache.k, cache.v, at + R * size, at + 2 * R * size, logits,
        words, logprobs,
    )  # fmt: skip
    if not greedy:
        return s.views[R], None
    return s.views[R], list(zip(s.words_[:R].tolist(), s.logprobs_[:R].tolist(), strict=True))


def run(
    model,
    layers: tuple,
    whole: program.Program | None,
    ids: Tensor,
    K: Tensor,
    V: Tensor,
    slots: list[int],
    positions: list[int],
    picks: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, bool]:
    """Logits [R,V] of ids [R], token r at positions[r] of row slots[r] of the key and value
    stores K, V [L,slots,H,S,d_head], where its key and value are written; `layers` is
    `layers(model)`. With a Program (`whole`: every product has a C kernel) the whole step
    is one C call, which also writes each row's greedy choice and its log-probability into
    picks (int64 [R], fp32 [R]) if given; otherwise the products run from here, and C
    between them. Also whether picks were written."""
    # [2R]: each row's position, then its slot
    places = torch.tensor(positions + slots, device="cpu")
    with torch.no_grad():
        if whole is not None:
            return _in_one_call(model, whole, ids, K, V, places, picks), picks is not None
        one_thread = len(slots) == 1 and model.inference_format == "float32"
        with on_threads(1) if one_thread and needs_one_thread() else nullcontext():
            return _product_by_product(model, layers, looked_up(model, ids), K, V, places), False


def looked_up(model, ids: Tensor) -> Tensor:
    """E[w] [R,d] of ids [R], times the embedding's scale, in fp32 (step.c's look_up)."""
    embedding = model.embedding
    x = embedding.tokens(ids)
    return _dense(x if embedding.scale == 1.0 else x * embedding.scale)


def _in_one_call(
    model, whole: program.Program, ids: Tensor, K, V, places: Tensor, picks: tuple | None
) -> Tensor:
    config, R = model.config, len(ids)
    if whole.rows is None:  # looked up here
        x = looked_up(model, ids)
    else:  # looked up by decode_step
        ids = ids if ids.dtype == torch.int64 and ids.is_contiguous() else ids.long().contiguous()
        x = torch.empty(R, config.d_model, device="cpu")
    logits, at = x.new_empty(R, whole.head.out), places.data_ptr()
    words, logprobs = (None, None) if picks is None else picks
    _decode_step(
        model, whole, R, x.data_ptr(), ids.data_ptr(), K, V, at, at + R * places.element_size(),
        logits.data_ptr(), native.address(words), native.address(logprobs),
    )  # fmt: skip
    return logits


def _decode_step(
    model, whole: program.Program, R: int, x: int, ids: int, K: Tensor, V: Tensor,
    positions: int, slots: int, logits: int, words: int | None, logprobs: int | None,
) -> None:  # fmt: skip
    """step.c's decode_step on the addresses of its arrays (x is E[w] already where the
    Program has no `rows`: ids are then not read); its errors raised."""
    config = model.config
    rows = None if whole.rows is None else ctypes.addressof(whole.rows)
    failed = native.library().decode_step(
        ctypes.addressof(whole.blocks), len(whole.blocks), ctypes.addressof(whole.head),
        ctypes.addressof(whole.first), native.address(model.embedding.P), x, R,
        config.d_model, config.d_ff, K.data_ptr(), V.data_ptr(), K.stride(0), slots,
        positions, config.n_heads, config.d_head, K.shape[3], config.attention_window or 0,
        ACTIVATIONS[config.activation], logits, words, logprobs, rows, ids,
    )  # fmt: skip
    if failed == LOOKUP_RANGE:
        raise IndexError(f"token ids must be in [0, {whole.rows.n})")
    if failed == LOOKUP_READ:
        raise TensorFileError(f"{whole.lookup.name} is shorter than its header says")
    if failed:
        raise MemoryError(f"no memory for a decoding step of {R} rows")


def _product_by_product(model, layers, x: Tensor, K, V, places: Tensor) -> Tensor:
    """The step with the model's kernels for the products and one C call between each
    two (see the module)."""
    lib, config, (R, d) = native.library(), model.config, x.shape
    H, d_head = config.n_heads, config.d_head
    at, where = places.data_ptr(), places.data_ptr() + R * places.element_size()
    h, z = torch.empty_like(x), x.new_empty(R, H * d_head)
    x_, h_, z_ = x.data_ptr(), h.data_ptr(), z.data_ptr()
    k_, v_, layer_bytes = K.data_ptr(), V.data_ptr(), K.stride(0) * K.element_size()
    kind, address = ACTIVATIONS[config.activation], native.address

    def add_norm(
        a: Tensor | None, norm: tuple[Tensor, Tensor | None, float], index: int | None = None
    ) -> None:
        """x += a (if given: [R,d], or with `index` the address of R row numbers, a table
        whose rows index[r] are added); h = LayerNorm(x), both in place."""
        gamma, beta, eps = norm
        lib.add_norm(x_, address(a), index, h_, gamma.data_ptr(), address(beta), R, d, eps)

    first, blocks = layers
    add_norm(model.embedding.P, first, at)  # x = E[w] + P[pos] (Fig. 9.13); h = LN1(x)
    window = config.attention_window or 0
    for layer, (attn, ln2, ffn, after, (rope, qk_eps)) in enumerate(blocks):
        rope = None if rope is None else ctypes.addressof(rope)
        q, k, v = attn.qkv_kernel.step(h)
        if not (q.stride() == k.stride() == v.stride() and q.stride(-1) == 1):
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        offset = layer * layer_bytes
        lib.attend_one(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), q.stride(0), k_ + offset, v_ + offset,
            where, at, R, H, d_head, K.shape[3], window, qk_eps, rope, z_,
        )  # fmt: skip
        add_norm(_dense(attn.out_kernel.step(z)), ln2)
        u = _dense(ffn.up_kernel.step(h))  # a new tensor: activated in place
        lib.activate(u.data_ptr(), u.numel(), kind)
        add_norm(_dense(ffn.down_kernel.step(u)), after)
    return model.head.step(h)


def layers(model) -> tuple[tuple, list[tuple]]:
    """The first block's ln1, and per block (attention, ln2, FFN, the norm after it: the
    next block's ln1 or ln_f, (its `program.Rope` or None, qk eps)), each norm as (gamma,
    beta, eps). A
    `Decoder` makes it once: the modules and parameters of a model built for inference do
    not change (training updates a plain model's parameters in place)."""
    blocks = list(model.blocks)
    norms = [(b.ln1.gamma, b.ln1.beta, b.ln1.eps) for b in blocks[1:]]
    norms.append((model.ln_f.gamma, model.ln_f.beta, model.ln_f.eps))
    described = []
    for block, after in zip(blocks, norms, strict=True):
        attn, ln2, rotary = block.attn, block.ln2, block.attn.rotary
        rope = (None if rotary is None else rope_of(rotary), RMS_EPS if attn.qk_norm else 0.0)
        described.append((attn, (ln2.gamma, ln2.beta, ln2.eps), block.ffn, after, rope))
    first = blocks[0].ln1
    return (first.gamma, first.beta, first.eps), described


def rope_of(rotary) -> program.Rope:
    """step.c's Rope of a `Rotary`: its tables, and θ and the factor that `rotary_tables`
    computed them from, for positions past them (the arrays kept on the struct)."""
    theta, factor = rotary_frequencies(rotary.config)
    rope = program.Rope(rotary.cos.data_ptr(), rotary.sin.data_ptr(), len(rotary.cos))
    rope.theta, rope.factor = theta.data_ptr(), factor
    rope.kept = (rotary.cos, rotary.sin, theta)
    return rope


def _dense(t: Tensor) -> Tensor:
    return t if t.is_contiguous() and t.dtype == torch.float32 else t.contiguous().float()
