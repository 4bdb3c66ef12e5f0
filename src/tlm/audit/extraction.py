"""Discoverable memorization (J&M §10.10; Carlini et al. 2023): what a model gives back
verbatim of the text it was trained on.

A window of K + M tokens is drawn from a token stream; the model is given its first K
tokens (the prefix) and decodes M tokens greedily (eq. 10.46). The window is *extracted*
when those M tokens are exactly the true suffix. Windows from the training split measure
memorization; windows from the validation split, text the model never saw, measure what a
good predictor of the language gets right anyway: the baseline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from tlm.device import placement
from tlm.errors import UserError
from tlm.generate import GenerationConfig, generate

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile


class AuditError(UserError):
    """An audit that cannot be run on these inputs."""


@dataclass
class Extraction:
    """How many of `windows` sampled windows a model extracted, per window too."""

    starts: np.ndarray  # [N] each window's first token in the stream
    exact: np.ndarray  # [N] bool: the M decoded tokens are the true suffix
    matched: np.ndarray  # [N] share of the M decoded tokens equal to the true ones, place by place

    def summary(self) -> dict[str, float | int]:
        """windows, exact, rate, its 95% interval (low, high) and token_match."""
        n, k = len(self.exact), int(self.exact.sum())
        low, high = wilson(k, n)
        rate = k / n if n else 0.0
        match = float(self.matched.mean()) if n else 0.0
        return {
            "windows": n, "exact": k, "rate": rate, "low": low, "high": high, "token_match": match
        }  # fmt: skip


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a rate of k successes in n trials: unlike p ± z·se it
    stays inside [0, 1] and is not empty at k = 0 or k = n, where extraction rates live."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    low = 0.0 if k == 0 else max(0.0, centre - half)  # exactly 0 and 1 at the ends
    return low, 1.0 if k == n else min(1.0, centre + half)


def window_starts(tokens: int, length: int, samples: int, seed: int) -> np.ndarray:
    """Up to `samples` distinct starts of windows of `length` tokens in a stream of
    `tokens`, drawn uniformly, sorted."""
    places = tokens - length + 1
    if places < 1:
        raise AuditError(f"a split of {tokens:,} tokens holds no window of {length} tokens")
    rng = np.random.default_rng(seed)
    if places <= samples:
        return np.arange(places)
    return np.sort(rng.choice(places, size=samples, replace=False))


def extraction(
    model: nn.Module,
    tokens: np.ndarray,
    samples: int = 500,
    prefix: int = 32,
    suffix: int = 32,
    batch_size: int = 64,
    seed: int = 0,
    progress: bool = False,
) -> Extraction:
    """Discoverable memorization of `model` on windows of a token stream `tokens` [n]:
    `samples` windows of prefix + suffix tokens, each prefix decoded greedily for `suffix`
    tokens in batches through the KV cache (an end-of-text token does not stop it: the true
    suffix may run across documents)."""
    if prefix < 1 or suffix < 1:
        raise AuditError(f"--prefix and --suffix must be at least 1, got {prefix} and {suffix}")
    context = model.config.context_length
    if prefix + suffix > context:
        raise AuditError(
            f"--prefix {prefix} + --suffix {suffix} is longer than the model's context ({context})"
        )
    starts = window_starts(len(tokens), prefix + suffix, samples, seed)
    config = GenerationConfig(max_new_tokens=suffix, eos_token_id=())
    device = placement(model)[0]
    exact, matched = [], []
    bar = tqdm(total=len(starts), desc="extraction", unit="window", disable=not progress)
    for lo in range(0, len(starts), batch_size):
        chunk = starts[lo : lo + batch_size]
        windows = np.stack([np.asarray(tokens[s : s + prefix + suffix]) for s in chunk])
        windows = torch.from_numpy(windows.astype(np.int64)).to(device)
        steps = list(generate(model, windows[:, :prefix], config))
        decoded = torch.stack([step.tokens for step in steps], dim=1)  # [B,M]
        same = decoded == windows[:, prefix:]
        exact.append(same.all(dim=1).cpu().numpy())
        matched.append(same.float().mean(dim=1).cpu().numpy())
        bar.update(len(chunk))
    bar.close()
    return Extraction(starts, np.concatenate(exact), np.concatenate(matched))
