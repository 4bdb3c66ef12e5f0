"""Beam search: keep the K most probable continuations instead of the single greedy one.

At every step each of the K beams of a prompt is extended by every token; the K best
(by summed log-probability) survive and the KV cache follows them (`Context.reorder`). A beam
that produces an end-of-sequence token leaves as a finished hypothesis, ranked by
log P / length^length_penalty (length_penalty > 0 favours longer ones, 0 ranks by log P).
A prompt is done when it holds K finished hypotheses and no running beam can still beat the
worst of them (the usual heuristic), or after `max_new_tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from tlm.generate.decode import Context, GenerationConfig


@dataclass
class BeamResult:
    sequences: Tensor  # [B, T + new]: each prompt's best hypothesis, end-padded
    logprobs: Tensor  # [B] log P of the generated tokens (their sum)
    scores: Tensor  # [B] logprobs / length ** length_penalty, by which hypotheses were ranked


@dataclass
class _Hypotheses:
    """The finished hypotheses of one prompt, the best `size` of them."""

    size: int
    length_penalty: float
    items: list[tuple[float, float, list[int]]] = field(default_factory=list)

    def add(self, logprob: float, tokens: list[int]) -> None:
        score = logprob / max(1, len(tokens)) ** self.length_penalty
        self.items.append((score, logprob, tokens))
        self.items.sort(key=lambda item: item[0], reverse=True)
        del self.items[self.size :]

    def done(self, best_running_logprob: float, length: int) -> bool:
        if len(self.items) < self.size:
            return False
        return self.items[-1][0] >= best_running_logprob / length**self.length_penalty


def beam_search(
    model: nn.Module,
    input_ids: Tensor,
    config: GenerationConfig | None = None,
    attention_mask: Tensor | None = None,
    **settings,
) -> BeamResult:
    """The best of `num_beams` beams for every prompt of input_ids [B,T]."""
    c = config or GenerationConfig(**settings)
    B, T = input_ids.shape
    K, V = c.num_beams, model.config.vocab_size
    eos = set(c.eos_ids)
    end = c.pad_id
    with torch.no_grad():
        context = Context(
            model,
            input_ids.repeat_interleave(K, dim=0),  # row b*K + k is beam k of prompt b
            None if attention_mask is None else attention_mask.repeat_interleave(K, dim=0),
            c.use_cache,
            c.max_new_tokens,
        )
        beams = torch.full((B, K), float("-inf"))
        beams[:, 0] = 0.0  # the K beams start equal: only one of them may grow at first
        finished = [_Hypotheses(K, c.length_penalty) for _ in range(B)]
        done = [False] * B
        for t in range(1, c.max_new_tokens + 1):
            logprobs = context.next_logits().float().log_softmax(dim=-1).cpu()  # [B*K, V]
            totals = (beams[:, :, None] + logprobs.view(B, K, V)).view(B, K * V)
            rows, tokens = torch.arange(K).repeat(B, 1), torch.full((B, K), end)
            beams = torch.full((B, K), float("-inf"))  # a slot no candidate fills stays dead
            for b in range(B):
                if done[b]:  # its rows run on, but their outputs no longer matter
                    continue
                kept = _survivors(totals[b], K, V, eos, finished[b], context, b * K, T)
                for k, (row, token, total) in enumerate(kept):
                    rows[b, k], tokens[b, k], beams[b, k] = row, token, total
                done[b] = finished[b].done(beams[b].max().item(), t)
            context.reorder((torch.arange(B)[:, None] * K + rows).view(-1).to(context.ids.device))
            context.append(tokens.view(-1).to(context.ids.device))
            if all(done):
                break
        for b in range(B):  # beams still running at the end are hypotheses too
            for k in range(K):
                if not done[b] and beams[b, k] > float("-inf"):
                    finished[b].add(beams[b, k].item(), _generated(context, b * K + k, T))
        return _result(input_ids, finished, end)


def _survivors(
    totals: Tensor,
    K: int,
    V: int,
    eos: set[int],
    finished: _Hypotheses,
    context: Context,
    first_row: int,
    T: int,
) -> list[tuple[int, int, float]]:
    """The K best continuations (beam, token, total) of one prompt that do not end here.

    `totals` [K*V] are the summed log-probs of every beam x token. A continuation that ends
    with an end token becomes a finished hypothesis if it ranks among the top K.
    """
    best, index = totals.topk(min(2 * K, K * V))  # 2K: room for K that do not end
    kept = []
    for rank, (total, i) in enumerate(zip(best.tolist(), index.tolist(), strict=True)):
        beam, token = divmod(i, V)
        if token in eos:
            if rank < K:
                finished.add(total, _generated(context, first_row + beam, T) + [token])
            continue
        kept.append((beam, token, total))
        if len(kept) == K:
            break
    return kept


def _generated(context: Context, row: int, T: int) -> list[int]:
    return context.ids[row, T:].tolist()


def _result(input_ids: Tensor, finished: list[_Hypotheses], end: int) -> BeamResult:
    best = [hyps.items[0] for hyps in finished]
    width = max(len(tokens) for _, _, tokens in best)
    new = torch.full((len(best), width), end, dtype=torch.long)
    for b, (_, _, tokens) in enumerate(best):
        new[b, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    return BeamResult(
        sequences=torch.cat([input_ids.cpu(), new], dim=1),
        logprobs=torch.tensor([logprob for _, logprob, _ in best]),
        scores=torch.tensor([score for score, _, _ in best]),
    )
