"""AdamW with decoupled weight decay (Loshchilov & Hutter 2019) and the learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from tlm.config import TrainConfig

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


def build_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.AdamW:
    groups = parameter_groups(model, config.weight_decay)
    device = next(model.parameters()).device
    fused = device.type in ("cpu", "cuda")
    return torch.optim.AdamW(groups, lr=config.lr, betas=(config.beta1, config.beta2), fused=fused)


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
