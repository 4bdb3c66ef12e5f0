"""The optimizers and the learning-rate schedule.

AdamW with decoupled weight decay (Loshchilov & Hutter 2019) is the textbook's and the
default. `optimizer="muon"` is a departure from the book for small budgets: Muon (Jordan et
al. 2024; `train/muon.py`) for the blocks' weight matrices, which it updates by the
orthogonalised momentum, and AdamW for everything else (embeddings, the head, LayerNorms,
biases). Muon's step is scaled to AdamW's update size
(`adjust_lr_fn="match_rms_adamw"`, Liu et al. 2025), so one learning rate and one schedule
drive both.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tlm.config import TrainConfig
from tlm.device import placement
from tlm.train.muon import Muon

NO_DECAY = ("E", "P", "gamma", "beta")  # embeddings and norms; biases are b_*


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay the weight matrices; never biases, LayerNorm gains/shifts or embeddings."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        leaf = name.rsplit(".", 1)[-1]
        if leaf in NO_DECAY or leaf.startswith("b_"):
            no_decay.append(param)
        else:
            decay.append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


OUTSIDE_MUON = ("E", "P", "W_U")  # 2-D, but embeddings and the head: AdamW (Jordan et al.)


def build_optimizer(
    model: nn.Module, config: TrainConfig, ns_dtype: torch.dtype | None = None
) -> torch.optim.Optimizer | Combined:
    """AdamW, or Muon for the hidden matrices (Newton-Schulz in `ns_dtype`, the training
    precision) beside AdamW for the rest."""
    device = placement(model)[0]
    fused = device.type in ("cpu", "cuda")
    betas = (config.beta1, config.beta2)
    if config.optimizer == "adamw":
        groups = parameter_groups(model, config.weight_decay)
        return torch.optim.AdamW(groups, lr=config.lr, betas=betas, fused=fused)
    matrices = [
        p
        for name, p in model.named_parameters()
        if p.requires_grad and p.ndim == 2 and name.rsplit(".", 1)[-1] not in OUTSIDE_MUON
    ]
    chosen = {id(p) for p in matrices}
    rest = [
        {**g, "params": [p for p in g["params"] if id(p) not in chosen]}
        for g in parameter_groups(model, config.weight_decay)
    ]
    muon = Muon(
        matrices,
        ns_dtype=ns_dtype,
        lr=config.lr,
        weight_decay=config.weight_decay,
        adjust_lr_fn="match_rms_adamw",
    )
    return Combined(muon, torch.optim.AdamW(rest, lr=config.lr, betas=betas, fused=fused))


class Combined:
    """Several optimizers used as one: the trainer sets the learning rate of every group in
    `param_groups`, steps, zeroes, and saves and loads one state dict, whose parameters are
    numbered across the optimizers in order (as one optimizer numbers its groups')."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict]:
        return [group for o in self.optimizers for group in o.param_groups]

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        state, groups, offset = {}, [], 0
        for o in self.optimizers:
            saved = o.state_dict()
            state.update({offset + i: s for i, s in saved["state"].items()})
            groups += [
                {**g, "params": [offset + i for i in g["params"]]} for g in saved["param_groups"]
            ]
            offset += _count(o)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, saved: dict) -> None:
        offset, first = 0, 0
        for o in self.optimizers:
            n, k = _count(o), len(o.param_groups)
            groups = saved["param_groups"][first : first + k]
            o.load_state_dict(
                {
                    "state": {
                        i - offset: s for i, s in saved["state"].items() if offset <= i < offset + n
                    },
                    "param_groups": [
                        {**g, "params": [i - offset for i in g["params"]]} for g in groups
                    ],
                }
            )
            offset, first = offset + n, first + k


def _count(optimizer: torch.optim.Optimizer) -> int:
    return sum(len(group["params"]) for group in optimizer.param_groups)


def learning_rate(step: int, config: TrainConfig, d_model: int | None = None) -> float:
    """Linear warmup to `lr` over `warmup_steps`, then a cosine down to `min_lr` at `max_steps`;
    or with `schedule="inverse-sqrt"` the paper's rate (Vaswani et al. eq. 3), step counted
    from 1: lr · d_model^-0.5 · min(step^-0.5, step · warmup_steps^-1.5)."""
    if config.schedule == "inverse-sqrt":
        if d_model is None:
            raise ValueError("the inverse-sqrt schedule scales with d_model")
        n, warmup = step + 1, max(1, config.warmup_steps)
        return config.lr * d_model**-0.5 * min(n**-0.5, n * warmup**-1.5)
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    span = max(1, config.max_steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.min_lr + cosine * (config.lr - config.min_lr)
