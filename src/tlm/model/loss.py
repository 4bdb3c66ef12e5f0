"""The language-modeling loss (J&M §10.9, eq. 10.50-10.51) and scoring of token windows.

L_CE = -log ŷ_t[w_{t+1}]: the negative log probability the model gives the true next token,
averaged over the positions of a window (teacher forcing: the input at every position is
the true prefix, never the model's own guess). Instruction tuning (J&M ch. 12) takes the same
loss over the learned targets only, the assistant's turns (`supervised_loss`); `packed_nll`
scores packed conversations for chat training's validation and `tlm eval --task chat` alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def cross_entropy(logits: Tensor, targets: Tensor, reduction: str = "mean") -> Tensor:
    """logits [B,T,V], targets [B,T] -> mean of eq. 10.51 over all B·T positions (fused kernel)."""
    V = logits.shape[-1]
    loss = F.cross_entropy(logits.reshape(-1, V).float(), targets.reshape(-1), reduction=reduction)
    return loss if reduction == "mean" else loss.view(targets.shape)


def cross_entropy_reference(logits: Tensor, targets: Tensor) -> Tensor:
    """Eq. 10.50-10.51 written out: y = softmax(u) (eq. 9.46), L = -log y[w_{t+1}], averaged."""
    y_hat = torch.softmax(logits.double(), dim=-1)  # [B,T,V]
    p_true = y_hat.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # ŷ_t[w_{t+1}]  [B,T]
    return (-torch.log(p_true)).mean()


IGNORE = -100  # a label that counts nowhere (padding)


def label_smoothed_cross_entropy(logits: Tensor, labels: Tensor, epsilon: float) -> Tensor:
    """Mean over the labelled positions (labels != IGNORE) of the cross-entropy against the
    target smoothed with ε (Vaswani et al. §5.4, after Szegedy et al. 2016): the true token
    gets 1 - ε + ε/V, every token ε/V. Fused kernel; the reference is written out below."""
    V = logits.shape[-1]
    flat = logits.reshape(-1, V).float()
    return F.cross_entropy(flat, labels.reshape(-1), ignore_index=IGNORE, label_smoothing=epsilon)


def label_smoothed_reference(logits: Tensor, labels: Tensor, epsilon: float) -> Tensor:
    """L = (1 - ε)·(-log p[y]) + ε·mean_k(-log p[k]), averaged over the labelled positions."""
    log_p = torch.log_softmax(logits.double(), dim=-1)  # [B,T,V]
    keep = labels != IGNORE
    nll = -log_p.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # -log p[y]
    uniform = -log_p.mean(-1)  # the cross-entropy against 1/V everywhere
    return ((1 - epsilon) * nll + epsilon * uniform)[keep].mean()


@torch.no_grad()
def window_nll(model: nn.Module, windows: Tensor, batch_size: int = 32) -> Tensor:
    """Per-token negative log-likelihood (nats) of windows [N, T+1]: returns [N, T].

    Position t of window n scores token t+1 given tokens 0..t.
    """
    device = next(model.parameters()).device
    out = []
    for i in range(0, len(windows), batch_size):
        batch = windows[i : i + batch_size].to(device)
        logits = model(batch[:, :-1])
        out.append(cross_entropy(logits, batch[:, 1:], reduction="none").cpu())
    return torch.cat(out)


def supervised_loss(logits: Tensor, targets: Tensor, learned: Tensor) -> Tensor:
    """logits [B,T,V], targets [B,T], learned [B,T] bool -> the SUM of eq. 10.51 over the
    learned targets only (the chat mask's 1s): the caller divides by the count it means."""
    V = logits.shape[-1]
    flat = logits.reshape(-1, V).float()  # [B*T, V]
    labels = torch.where(learned, targets, IGNORE).reshape(-1)  # [B*T]
    return F.cross_entropy(flat, labels, ignore_index=IGNORE, reduction="sum")


@torch.no_grad()
def packed_nll(
    forward: Callable[..., Tensor],
    windows: Any,
    device: torch.device,
    rank: int = 0,
    world_size: int = 1,
    batch_size: int = 32,
) -> tuple[float, int]:
    """(summed -log p, count) over the learned targets of packed windows: `windows` has a
    length and `batch(rows)` -> inputs, targets, learned, documents [B,T]
    (`data/packing.py: Packed`), scored `batch_size` windows a forward pass. Under torchrun
    rank r scores batches r, r + K, ...; a rank whose batches ran out scores the first
    again and drops it, so every rank runs as many forward passes (FSDP gathers each
    block's shards in step across the ranks)."""
    W = len(windows)
    batches = [range(i, min(i + batch_size, W)) for i in range(0, W, batch_size)]
    rounds = -(-len(batches) // world_size)  # forward passes on every rank
    total, count = 0.0, 0
    for i in range(rank, rounds * world_size, world_size):
        mine = i < len(batches)
        x, y, learned, d = (t.to(device) for t in windows.batch(batches[i if mine else 0]))
        loss = supervised_loss(forward(x, documents=d), y, learned)
        if mine:
            total, count = total + loss.item(), count + int(learned.sum())
    return total, count


def token_logprobs(logits: Tensor, targets: Tensor) -> Tensor:
    """log ŷ_t[w_{t+1}] at every position: logits [B,T,V], targets [B,T] -> [B,T] (fp32,
    fused kernel), 0 where the target is IGNORE."""
    V = logits.shape[-1]
    flat, labels = logits.reshape(-1, V).float(), targets.reshape(-1)
    return -F.cross_entropy(flat, labels, ignore_index=IGNORE, reduction="none").view(targets.shape)


def sequence_logprobs(logits: Tensor, targets: Tensor, learned: Tensor) -> Tensor:
    """log π(y | x) = Σ_t log ŷ_t[w_{t+1}] over the learned targets (an answer's tokens):
    logits [B,T,V], targets [B,T], learned [B,T] bool -> [B] (fused kernel, fp32)."""
    return (token_logprobs(logits, targets) * learned).sum(dim=-1)


def dpo_loss(
    chosen: Tensor,
    rejected: Tensor,
    reference_chosen: Tensor,
    reference_rejected: Tensor,
    beta: float,
    kind: str = "sigmoid",
    epsilon: float = 0.0,
    lengths: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Direct preference optimization (Rafailov et al. 2023) per pair -> (loss [B], the
    implicit rewards of the chosen and the rejected answers [B]).

    From the log-probabilities [B] of the chosen answer y_w and the rejected y_l under the
    policy π and the frozen reference π_ref, each answer's implicit reward is
    r = β (log π(y|x) - log π_ref(y|x)) and h = (r_w - r_l) / β. The losses:

    - sigmoid (DPO, their eq. 7): -log σ(β h), the Bradley-Terry likelihood of the
      preference under the implicit rewards;
    - cdpo (conservative DPO, Mitchell 2023): -(1 - ε) log σ(β h) - ε log σ(-β h), for
      labels flipped with probability ε;
    - ipo (Azar et al. 2023, their eq. 17): (h' - 1/(2β))², with each answer's log-ratio
      averaged over its tokens (`lengths`: the answers' token counts), as TRL computes it.
    """
    chosen_ratio, rejected_ratio = chosen - reference_chosen, rejected - reference_rejected
    h = chosen_ratio - rejected_ratio
    if kind == "sigmoid":
        loss = -F.logsigmoid(beta * h)
    elif kind == "cdpo":
        loss = -(1 - epsilon) * F.logsigmoid(beta * h) - epsilon * F.logsigmoid(-beta * h)
    elif kind == "ipo":
        if lengths is None:
            raise ValueError("ipo averages each log-ratio over its answer: give the lengths")
        per_token = chosen_ratio / lengths[0].clamp(min=1) - rejected_ratio / lengths[1].clamp(
            min=1
        )
        loss = (per_token - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"dpo loss must be sigmoid, ipo or cdpo; got {kind!r}")
    return loss, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def chosen_nll(chosen: Tensor, tokens: Tensor | int) -> Tensor:
    """The chosen answers' negative log-likelihood per token, −Σ log π(y_w|x) / tokens,
    from their log-probabilities [B] (each summed over its tokens) and the count of tokens
    it is the mean over (the batch's, or the whole step's): the term RPO (Pang et al. 2024)
    adds to DPO's loss with a weight, TRL's `loss_type` "sft"."""
    return -chosen.sum() / tokens


def grpo_loss(
    logp: Tensor,
    old: Tensor,
    advantage: Tensor,
    learned: Tensor,
    clip: float,
    beta: float = 0.0,
    reference: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """GRPO's objective (Shao et al. 2024) summed over the replies' tokens, for the caller to
    divide by the tokens of the whole step (DAPO's normalisation): logp, old and reference
    [B,L] are log π, log π_old and log π_ref of each token, advantage [B,1] each reply's,
    learned [B,L] its tokens. Per token: −min(ρ A, clip(ρ, 1 − ε, 1 + ε) A) + β KL with
    ρ = exp(logp − old) and KL = exp(q − p) − (q − p) − 1 (the k3 estimator, q the
    reference's). Returns (the sum, the per-token KL [B,L])."""
    ratio = torch.exp(logp - old)
    surrogate = torch.minimum(ratio * advantage, torch.clamp(ratio, 1 - clip, 1 + clip) * advantage)
    kl = torch.zeros_like(logp)
    if reference is not None:
        kl = torch.exp(reference - logp) - (reference - logp) - 1
    return (-(surrogate - beta * kl) * learned).sum(), kl.detach()
