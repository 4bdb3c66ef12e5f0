"""Direct logit attribution: which part of the model wrote a token's logit (§9.5, Fig. 9.7).

In a pre-norm model the final residual stream is a sum of what each part added to it (Fig.
9.7): h = X + Σ_l (Σ_h z_lh W^O_h + b^O_l + FFN_l). The final LayerNorm is linear once its
μ and σ are fixed at their values for h, so the logit of token w splits exactly:

    u_w = Σ_parts γ ⊙ (part − mean(part)) / σ · e_w  +  β · e_w        (e_w: column w of W_U)

Each head, each layer's attention bias, each FFN and the embedding get one number; together
with the final norm's β they sum to the logit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tlm.interpret.hooks import HookError, run_with_cache
from tlm.model import TransformerLM


@dataclass
class Attribution:
    labels: list[str]  # "embed", "L0H0", ..., "L0 attn bias", "L0 mlp", ..., "final norm bias"
    values: Tensor  # [parts] their shares of the logit; they sum to it

    def as_dict(self) -> dict[str, float]:
        return dict(zip(self.labels, self.values.tolist(), strict=True))


@torch.no_grad()
def direct_logit_attribution(
    model: TransformerLM, input_ids: Tensor, target: int, position: int = -1
) -> Attribution:
    """The logit of `target` at `position` of input_ids [1, T], split over the model's parts."""
    if model.config.norm != "pre":
        raise HookError("direct logit attribution needs a pre-norm model (a sum of parts)")
    L, H, dh = model.config.n_layers, model.config.n_heads, model.config.d_head
    names = ["embed", *(f"blocks.{layer}.resid_post" for layer in range(L))]
    names += [f"blocks.{layer}.{part}" for layer in range(L) for part in ("attn.z", "mlp.out")]
    _, cache = run_with_cache(model, input_ids, names)
    labels, parts = ["embed"], [cache["embed"][0, position]]
    for layer in range(L):
        attn = model.blocks[layer].attn
        z = cache[f"blocks.{layer}.attn.z"][0, position]  # [H, dh]
        heads = torch.einsum("hk,hkd->hd", z, attn.W_O.view(H, dh, -1))  # z_h W^O_h: [H, d]
        labels += [f"L{layer}H{h}" for h in range(H)]
        parts += list(heads)
        if attn.b_O is not None:
            labels.append(f"L{layer} attn bias")
            parts.append(attn.b_O)
        labels.append(f"L{layer} mlp")
        parts.append(cache[f"blocks.{layer}.mlp.out"][0, position])
    h = cache[f"blocks.{L - 1}.resid_post"][0, position]  # [d]: the sum of the parts
    ln = model.ln_f
    sigma = torch.sqrt(h.var(unbiased=False) + ln.eps)
    e_w = model.unembedding()[:, target]  # [d]
    values = [((part - part.mean()) / sigma * ln.gamma) @ e_w for part in parts]
    if ln.beta is not None:
        labels.append("final norm bias")
        values.append(ln.beta @ e_w)
    return Attribution(labels, torch.stack(values))
