"""Reading and changing activations by name: `hooks`, `run_with_cache`, `ablate_head`.

A hook function receives the activation at a hook point (names in `tlm.model.hooks`) and
returns None to leave it as it is, or a tensor of the same shape to replace it. Hooks live
only inside the `with hooks(...)` block: they are removed on exit, also on error.
"""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import Tensor, nn

from tlm.device import placement
from tlm.errors import UserError
from tlm.model.hooks import hook_points

HookFn = Callable[[Tensor], Tensor | None]
Names = Iterable[str] | Callable[[str], bool] | None


class HookError(UserError):
    """A hook name, layer or head the model does not have; the message says what exists."""


def resolve(model: nn.Module, names: Names) -> list[str]:
    """Hook names from a list, a predicate on names, or None (all of them)."""
    points = hook_points(model)
    if names is None:
        return list(points)
    if callable(names):
        return [name for name in points if names(name)]
    names = list(names)
    for name in names:
        if name not in points:
            close = difflib.get_close_matches(name, points, n=3, cutoff=0.5)
            hint = (
                f"closest: {', '.join(close)}" if close else f"e.g. {', '.join(list(points)[:4])}"
            )
            raise HookError(f"no hook point named {name!r} ({hint})")
    return names


@contextlib.contextmanager
def hooks(model: nn.Module, fns: dict[str, HookFn]) -> Iterator[None]:
    """Run `fns[name]` on the activation at each named hook point while the block lasts."""
    points = hook_points(model)
    handles = []
    try:
        for name in resolve(model, list(fns)):
            fn = fns[name]
            handles.append(points[name].register_forward_hook(lambda _m, _i, out, fn=fn: fn(out)))
        yield
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def run_with_cache(
    model: nn.Module, input_ids: Tensor, names: Names = None, **forward
) -> tuple[Tensor, dict[str, Tensor]]:
    """Run `model(input_ids)`; return (logits, {hook name: activation}) for `names`, on the
    model's device (the ids are moved there)."""
    input_ids = input_ids.to(placement(model)[0])
    cache: dict[str, Tensor] = {}

    def saver(name: str) -> HookFn:
        def save(x: Tensor) -> None:
            cache[name] = x.detach()

        return save

    with hooks(model, {name: saver(name) for name in resolve(model, names)}):
        logits = model(input_ids, **forward)
    return logits, cache


def check_head(model: nn.Module, layer: int, head: int | None = None) -> None:
    c = model.config
    if not 0 <= layer < c.n_layers:
        raise HookError(f"layer {layer} is out of range: the model has layers 0..{c.n_layers - 1}")
    if head is not None and not 0 <= head < c.n_heads:
        raise HookError(f"head {head} is out of range: the model has heads 0..{c.n_heads - 1}")


def ablate_head(
    model: nn.Module, layer: int, head: int, how: str = "zero"
) -> contextlib.AbstractContextManager:
    """While active, head `head` of `layer` contributes nothing ("zero") or its mean output
    over the batch and positions ("mean"), at its `z` (before W^O)."""
    check_head(model, layer, head)
    if how not in ("zero", "mean"):
        raise HookError(f"how must be zero or mean, got {how!r}")

    def ablate(z: Tensor) -> Tensor:  # [B,T,H,d_head]
        z = z.clone()
        mean = z[:, :, head].mean(dim=(0, 1), keepdim=True)  # [1,1,d_head]
        z[:, :, head] = 0.0 if how == "zero" else mean
        return z

    return hooks(model, {f"blocks.{layer}.attn.z": ablate})
