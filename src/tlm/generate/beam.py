"""Beam search: keep the K most probable continuations instead of the single greedy one.

One search serves the language model (`beam_search`) and the encoder-decoder
(`translate.beam_translate`); they differ only in the state that gives each beam's next
log-probabilities (`Beams`) and in the length penalty. At every step each of the K beams
of a prompt is extended by every token and the 2K best continuations are ranked: an end
token among the first K finishes a hypothesis, scored log P / penalty(length) (its length
counts the end token), and the best K that do not end are the next beams, whose state
follows them (`Beams.keep`). A prompt is done when it holds K finished hypotheses and the
best running beam, at the current length, cannot beat the worst of them; beams still
running after `limit` steps are hypotheses too. With K = 1 this is greedy decoding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor, nn

from tlm.device import placement
from tlm.generate.config import GenerationConfig


class Beams(Protocol):
    """The decoding state of B*K rows (row b*K + k is beam k of prompt b)."""

    def next_logprobs(self) -> Tensor:
        """log P(next token) of every row: [B*K, V]."""
        ...

    def keep(self, rows: Tensor, tokens: Tensor) -> None:
        """Row i becomes old row rows[i] followed by tokens[i]."""
        ...


@dataclass
class Hypothesis:
    tokens: list[int]  # the generated tokens (an end token last, if it ended)
    logprobs: list[float]  # log P of each, under the model
    score: float  # sum(logprobs) / penalty(len(tokens)): how hypotheses are ranked


@dataclass
class _Finished:
    """The finished hypotheses of one prompt, the best `size` of them, best first."""

    size: int
    items: list[Hypothesis] = field(default_factory=list)

    def add(self, hypothesis: Hypothesis) -> None:
        self.items.append(hypothesis)
        self.items.sort(key=lambda h: h.score, reverse=True)
        del self.items[self.size :]

    def done(self, best_running: float) -> bool:
        return len(self.items) == self.size and self.items[-1].score >= best_running


def search(
    state: Beams,
    B: int,
    K: int,
    limit: int,
    eos: set[int],
    penalty: Callable[[int], float],
) -> list[Hypothesis]:
    """The best hypothesis of each of B prompts, K beams each, at most `limit` tokens."""
    cpu = torch.device("cpu")  # the search's bookkeeping, in Python lists and on the CPU
    totals = torch.full((B, K), float("-inf"), device=cpu)  # each beam's summed log P
    totals[:, 0] = 0.0  # the K beams start equal: only one of them may grow at first
    tokens: list[list[int]] = [[] for _ in range(B * K)]
    logprobs: list[list[float]] = [[] for _ in range(B * K)]
    finished, done = [_Finished(K) for _ in range(B)], [False] * B
    for t in range(1, limit + 1):
        step = state.next_logprobs().float().cpu()  # [B*K, V]
        V = step.shape[-1]
        best, index = (totals.view(-1, 1) + step).view(B, K * V).topk(min(2 * K, K * V), dim=1)
        kept: list[tuple[int, int, float]] = []  # (row, token, total) of every new beam
        for b in range(B):
            live = []
            for rank, (total, i) in enumerate(
                zip(best[b].tolist(), index[b].tolist(), strict=True)
            ):
                row, token = b * K + i // V, i % V
                if done[b] or total == float("-inf") or len(live) == K:
                    break
                if token in eos:
                    if rank < K:  # an end among the K best finishes a hypothesis
                        ended = [*tokens[row], token], [*logprobs[row], float(step[row, token])]
                        finished[b].add(Hypothesis(*ended, total / penalty(t)))
                else:
                    live.append((row, token, total))
            live += [(b * K, 0, float("-inf"))] * (K - len(live))  # dead rows, never chosen
            kept += live
            done[b] = done[b] or finished[b].done(live[0][2] / penalty(t))
        logprobs = [[*logprobs[row], float(step[row, token])] for row, token, _ in kept]
        tokens = [[*tokens[row], token] for row, token, _ in kept]
        totals = torch.tensor([total for _, _, total in kept], device=cpu).view(B, K)
        if all(done):
            break
        rows = torch.tensor([row for row, _, _ in kept], device=cpu)
        state.keep(rows, torch.tensor([t for _, t, _ in kept], device=cpu))
    for b in range(B):  # beams still running at the limit are hypotheses too
        for k in range(K):
            if not done[b] and totals[b, k] > float("-inf"):
                row = b * K + k
                score = totals[b, k].item() / penalty(len(tokens[row]))
                finished[b].add(Hypothesis(tokens[row], logprobs[row], score))
    return [f.items[0] for f in finished]


@dataclass
class BeamResult:
    sequences: Tensor  # [B, T + new]: each prompt's best hypothesis, padded with its end
    logprobs: Tensor  # [B] log P of the generated tokens (their sum)
    scores: Tensor  # [B] logprobs / length ** length_penalty, by which hypotheses were ranked
    token_logprobs: list[list[float]]  # log P of each generated token


def beam_search(
    model: nn.Module,
    input_ids: Tensor,
    config: GenerationConfig | None = None,
    attention_mask: Tensor | None = None,
    **settings,
) -> BeamResult:
    """The best of `num_beams` beams for every prompt of input_ids [B,T], ranked by
    log P / length^length_penalty (length_penalty > 0 favours longer ones, 0 ranks by log
    P)."""
    from tlm.generate.decode import DecodeState

    c = config or GenerationConfig(**settings)
    input_ids = input_ids.to(placement(model)[0])  # the sequences come back there too
    attention_mask = None if attention_mask is None else attention_mask.to(input_ids.device)
    B, K = input_ids.shape[0], c.num_beams
    with torch.no_grad():
        state = DecodeState(
            model,
            input_ids.repeat_interleave(K, dim=0),  # row b*K + k is beam k of prompt b
            None if attention_mask is None else attention_mask.repeat_interleave(K, dim=0),
            c.use_cache,
            c.max_new_tokens,
        )
        best = search(
            state,
            B,
            K,
            c.max_new_tokens,
            set(c.eos_ids),
            lambda n: max(1, n) ** c.length_penalty,
        )
    return _result(input_ids, best)


def _result(input_ids: Tensor, best: list[Hypothesis]) -> BeamResult:
    """The hypotheses as tensors on the prompts' device."""
    width, device = max(len(h.tokens) for h in best), input_ids.device
    rows = [h.tokens + [h.tokens[-1] if h.tokens else 0] * (width - len(h.tokens)) for h in best]
    new = torch.tensor(rows, dtype=torch.long, device=device)  # an ended row repeats its end
    return BeamResult(
        sequences=torch.cat([input_ids, new.view(len(best), width)], dim=1),
        logprobs=torch.tensor([sum(h.logprobs) for h in best], device=device),
        scores=torch.tensor([h.score for h in best], device=device),
        token_logprobs=[h.logprobs for h in best],
    )
