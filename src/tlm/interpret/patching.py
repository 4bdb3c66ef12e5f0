"""Activation patching (causal tracing): where does a model keep what it needs?

Run a clean prompt and a corrupted one of the same length (one word changed). Copy one
activation of the clean run into the corrupted run, and see how much of the clean
behaviour comes back. The metric is the logit difference at the last position,
u[target] − u[foil] (or u[target] alone), and the recovery

    (metric(patched) − metric(corrupted)) / (metric(clean) − metric(corrupted))

is 1 where the patched activation carries all of the difference, 0 where it carries none.
A sweep patches the residual stream entering each block at each position (layers ×
positions), or each head's output z over all positions (layers × heads).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tlm.device import placement
from tlm.interpret.hooks import HookError, check_head, hooks, run_with_cache
from tlm.model import TransformerLM


@dataclass(frozen=True)
class Patch:
    """Copy activation `name` of layer `layer` from the clean run, at one `position` (None:
    all) and, for `attn.z`, one `head` (None: all)."""

    layer: int
    name: str = "resid_pre"  # or resid_mid, resid_post, attn.z, attn.out, mlp.out
    position: int | None = None
    head: int | None = None

    @property
    def hook(self) -> str:
        return f"blocks.{self.layer}.{self.name}"


@dataclass
class Sweep:
    rows: list[str]  # "block 0", ... (one per layer)
    columns: list[str]  # positions ("0: The", ...) or heads ("H0", ...)
    recovery: Tensor  # [layers, columns]
    clean: float  # the metric on the clean prompt
    corrupted: float  # and on the corrupted one


def check_pair(clean_ids: Tensor, corrupted_ids: Tensor) -> None:
    if clean_ids.shape != corrupted_ids.shape:
        raise HookError(
            f"the corrupted prompt has {corrupted_ids.shape[-1]} tokens and the clean one "
            f"{clean_ids.shape[-1]}: patching needs prompts of the same token length"
        )


def metric(logits: Tensor, target: int, foil: int | None = None) -> Tensor:
    """u[target] − u[foil] at the last position, per batch row: logits [B,T,V] -> [B]."""
    last = logits[:, -1].float()
    return last[:, target] - (0.0 if foil is None else last[:, foil])


@torch.no_grad()
def run_patched(
    model: TransformerLM,
    corrupted_ids: Tensor,
    clean_cache: dict[str, Tensor],
    patches: list[Patch],
) -> Tensor:
    """Logits [len(patches), T, V] of the corrupted prompt [1, T], row i with patch i applied
    from `clean_cache` (a `run_with_cache` of the clean prompt holding every patch's hook)."""
    corrupted_ids = corrupted_ids.to(placement(model)[0])
    by_hook: dict[str, list[tuple[int, Patch]]] = {}
    for row, patch in enumerate(patches):
        check_head(model, patch.layer, patch.head)
        by_hook.setdefault(patch.hook, []).append((row, patch))

    def patcher(rows: list[tuple[int, Patch]], clean: Tensor):
        def patch_rows(x: Tensor) -> Tensor:  # [N, T, ...] one row per patch
            x = x.clone()
            for row, p in rows:
                where = (row, slice(None) if p.position is None else p.position)
                if p.head is not None:
                    where = (*where, p.head)
                x[where] = clean[(0, *where[1:])]
            return x

        return patch_rows

    fns = {hook: patcher(rows, clean_cache[hook]) for hook, rows in by_hook.items()}
    with hooks(model, fns):
        return model(corrupted_ids.expand(len(patches), -1))


@torch.no_grad()
def patching_sweep(
    model: TransformerLM,
    clean_ids: Tensor,
    corrupted_ids: Tensor,
    target: int,
    foil: int | None = None,
    over: str = "positions",
    labels: list[str] | None = None,
) -> Sweep:
    """Recovery for every layer × position (the stream entering each block, `over=
    "positions"`) or every layer × head (each head's z at all positions, `over="heads"`)."""
    check_pair(clean_ids, corrupted_ids)
    device = placement(model)[0]
    clean_ids, corrupted_ids = clean_ids.to(device), corrupted_ids.to(device)
    L, T, H = model.config.n_layers, clean_ids.shape[1], model.config.n_heads
    if over == "positions":
        patches = [Patch(layer, "resid_pre", position=t) for layer in range(L) for t in range(T)]
        columns = labels or [str(t) for t in range(T)]
    elif over == "heads":
        patches = [Patch(layer, "attn.z", head=h) for layer in range(L) for h in range(H)]
        columns = [f"H{h}" for h in range(H)]
    else:
        raise HookError(f"over must be positions or heads, got {over!r}")
    clean_logits, cache = run_with_cache(model, clean_ids, sorted({p.hook for p in patches}))
    clean = metric(clean_logits, target, foil)[0].item()
    corrupted = metric(model(corrupted_ids), target, foil)[0].item()
    patched = torch.cat(
        [
            metric(run_patched(model, corrupted_ids, cache, patches[i : i + 64]), target, foil)
            for i in range(0, len(patches), 64)  # 64 patched copies of the prompt per forward pass
        ]
    )
    recovery = (patched - corrupted) / (clean - corrupted) if clean != corrupted else patched * 0
    rows = [f"block {layer}" for layer in range(L)]
    return Sweep(rows, columns, recovery.view(L, -1), clean, corrupted)
