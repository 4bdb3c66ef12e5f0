"""Hook points: named identity modules on the residual stream and inside attention.

Every activation a user may want to read has a stable name (`embed`, `blocks.3.resid_pre`,
`blocks.3.attn.pattern`, `blocks.3.resid_post`, `final`). A hook point returns its input
unchanged and costs one call when nothing listens; `run_with_cache` listens.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn


class HookPoint(nn.Module):
    """Identity; forward hooks registered on it see (and may replace) the activation."""

    def forward(self, x: Tensor) -> Tensor:
        return x


def hook_names(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, HookPoint)]


@torch.no_grad()
def run_with_cache(
    model: nn.Module, input_ids: Tensor, names: Iterable[str] | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """Run `model(input_ids)` and return (logits, {hook name: activation}).

    `names` selects hook points (all of them by default). Attention patterns exist only
    on the reference attention path; ask for them on a model with
    `attention_impl="reference"`.
    """
    wanted = set(hook_names(model) if names is None else names)
    unknown = wanted - set(hook_names(model))
    if unknown:
        raise KeyError(f"no hook point named {sorted(unknown)[0]!r}")
    cache: dict[str, Tensor] = {}
    handles = []
    for name, module in model.named_modules():
        if name in wanted:
            save = _saver(cache, name)
            handles.append(module.register_forward_hook(save))
    try:
        logits = model(input_ids)
    finally:
        for handle in handles:
            handle.remove()
    return logits, cache


def _saver(cache: dict[str, Tensor], name: str):
    def save(_module: nn.Module, _inputs: tuple, output: Tensor) -> None:
        cache[name] = output.detach()

    return save
