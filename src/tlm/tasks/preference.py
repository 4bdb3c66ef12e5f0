"""`tlm eval --task preference`: how a run ranks the two answers of held-out preference pairs.

The figures DPO trains on (`train/dpo.py`, `model/loss.py: dpo_loss`), measured on any run:
each pair's implicit rewards r = β (log π(y | x) − log π_ref(y | x)) of its chosen and its
rejected answer, the mean DPO loss −log σ(r_w − r_l), the accuracy (the share of pairs whose
chosen answer has the higher reward) and the mean margin r_w − r_l. The reference π_ref is
the run's recorded `--init-from` by default, another run if named, or none (log π_ref = 0:
the rewards are then β log π, the run's own preference).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from tlm.chat import END
from tlm.data.answer_pairs import answer_pairs
from tlm.data.tokens import PreferenceData
from tlm.device import placement
from tlm.model.loss import dpo_loss
from tlm.tokenizer import load_tokenizer
from tlm.train.dpo import pair_logprobs


@torch.no_grad()
def evaluate_preference(
    model: nn.Module,
    data: PreferenceData,
    split: str = "val",
    reference: nn.Module | None = None,
    beta: float = 0.1,
) -> dict[str, Any]:
    """The DPO loss, reward accuracy and margin of `model` on the pairs of `split` that fit
    its context, against `reference` (None: no reference)."""
    started = time.perf_counter()
    tokenizer = load_tokenizer(data.folder)
    if tokenizer.special_id(END) is None:
        raise ValueError(f"{data.folder}'s tokenizer has no chat template; prepare it again")
    pairs = answer_pairs(data, split, model.config.context_length, tokenizer.eot_id)
    if len(pairs) == 0:
        raise ValueError(f"no {split} pair has both answers within the model's context")
    policy = pair_logprobs(model, pairs, placement(model)[0])
    base = torch.zeros_like(policy)
    if reference is not None:
        base = pair_logprobs(reference, pairs, placement(reference)[0])
    loss, chosen, rejected = dpo_loss(policy[:, 0], policy[:, 1], base[:, 0], base[:, 1], beta)
    return {
        "split": split,
        "pairs": len(pairs),
        "dropped": pairs.dropped,
        "beta": beta,
        "loss": float(loss.mean()),
        "accuracy": float((chosen > rejected).float().mean()),
        "margin": float((chosen - rejected).mean()),
        "seconds": round(time.perf_counter() - started, 3),
    }
