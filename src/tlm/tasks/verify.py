"""`tlm eval --task verify`: how often a run's replies pass a verifier (J&M ch. 12).

For each prompt of a `PromptData` split: one greedy reply, and n replies sampled at
temperature 1, each rewarded by the verifier (`train/rewards.py`) against the prompt's
answer. pass@k is the unbiased estimator of Chen et al. (2021) from the n samples, c of them
correct: 1 − C(n − c, k) / C(n, k), averaged over prompts; `greedy` is the share of greedy
replies that pass.
"""

from __future__ import annotations

import math
import time
from typing import Any

from torch import nn

from tlm.chat import END
from tlm.data.tokens import PromptData
from tlm.generate import GenerationConfig
from tlm.generate.text import complete_tokens
from tlm.tokenizer import Tokenizer
from tlm.train.rewards import PASS, Reward


def pass_at_k(n: int, c: int, k: int) -> float:
    """The chance that at least one of k replies drawn without replacement from n, c of them
    correct, is correct: 1 − C(n − c, k) / C(n, k)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def evaluate_verify(
    model: nn.Module,
    tokenizer: Tokenizer,
    data: PromptData,
    reward: Reward,
    split: str = "val",
    samples: int = 8,
    max_new_tokens: int = 64,
    seed: int = 0,
    batch_size: int = 8,
    limit: int | None = None,
) -> dict[str, Any]:
    """pass@1 and pass@8 (from `samples` replies a prompt), the greedy pass rate, the mean
    sampled reward and reply length of `model` on the prompts of `split` (the first
    `limit`)."""
    started = time.perf_counter()
    answers, every = data.answers(split)[:limit], data.prompts(split)
    ends = (tokenizer.special_id(END), tokenizer.eot_id)
    greedy = GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=ends)
    sampled = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=True, temperature=1.0,
        num_return_sequences=samples, seed=seed, eos_token_id=ends,
    )  # fmt: skip
    passed, rewards, lengths, at1, at8 = 0, [], [], [], []
    for first in range(0, len(answers), batch_size):
        rows = range(first, min(first + batch_size, len(answers)))
        prompts = [every[i] for i in rows]
        best = complete_tokens(model, tokenizer, prompts, greedy)
        drawn = complete_tokens(model, tokenizer, prompts, sampled)
        for j, i in enumerate(rows):
            passed += reward(best[j].text, answers[i]) >= PASS
            mine = [reward(c.text, answers[i]) for c in drawn[j * samples : (j + 1) * samples]]
            correct = sum(r >= PASS for r in mine)
            rewards += mine
            lengths += [len(c.tokens) for c in drawn[j * samples : (j + 1) * samples]]
            at1.append(pass_at_k(samples, correct, 1))
            at8.append(pass_at_k(samples, correct, 8) if samples >= 8 else math.nan)
    n = len(answers)
    return {
        "split": split,
        "prompts": n,
        "n": samples,
        "pass1": sum(at1) / n,
        "pass8": sum(at8) / n if samples >= 8 else None,
        "greedy": passed / n,
        "mean_reward": sum(rewards) / len(rewards),
        "length": sum(lengths) / len(lengths),
        "seconds": round(time.perf_counter() - started, 3),
    }
