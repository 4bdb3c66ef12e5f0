"""Hook points: named identity modules at every activation a user may want to read.

Names (TransformerLens users know these quantities), for layer l:

    embed                         X = E[w] + P[pos], the residual stream entering block 0
    blocks.l.resid_pre            the residual stream entering block l       [B,T,d]
    blocks.l.attn.q | k | v       queries, keys, values per head             [B,H,T,d_head]
    blocks.l.attn.scores          q·k/√d_k, masked (-inf above the diagonal) [B,H,T,S]
    blocks.l.attn.pattern         α = softmax(scores)                        [B,H,T,S]
    blocks.l.attn.z               each head's output, before W^O             [B,T,H,d_head]
    blocks.l.attn.out             the attention's output, after W^O          [B,T,d]
    blocks.l.resid_mid            the stream after the attention's add       [B,T,d]
    blocks.l.mlp.pre | post       the FFN's hidden layer before / after the activation
    blocks.l.mlp.out              the FFN's output, after W_2                [B,T,d]
    blocks.l.resid_post           the stream leaving block l                 [B,T,d]
    final                         after the final LayerNorm                  [B,T,d]
    logits                        u, the unembedded scores                   [B,T,V]

A hook point returns its input unchanged and costs one attribute test when nothing listens.
Forward hooks registered on it (see `tlm.interpret.hooks`) see the activation and may
replace it. Attention forms α only when something listens to `scores` or `pattern`.
"""

from __future__ import annotations

from torch import Tensor, nn


class HookPoint(nn.Module):
    """Identity; forward hooks registered on it see (and may replace) the activation."""

    name = ""  # its public name, set by `name_hook_points`

    @property
    def listening(self) -> bool:
        return bool(self._forward_hooks)

    def forward(self, x: Tensor) -> Tensor:
        return x

    def __call__(self, x: Tensor) -> Tensor:
        return super().__call__(x) if self._forward_hooks else x  # nobody listens: no module call


def name_hook_points(model: nn.Module) -> None:
    """Give every hook point its public name: its module path, the FFN called `mlp`."""
    for path, module in model.named_modules():
        if isinstance(module, HookPoint):
            module.name = path.replace(".ffn.", ".mlp.")


def hook_points(model: nn.Module) -> dict[str, HookPoint]:
    """{public name: hook point}, in the order the forward pass reaches them."""
    return {m.name: m for m in model.modules() if isinstance(m, HookPoint)}


def hook_names(model: nn.Module) -> list[str]:
    return list(hook_points(model))
