"""Text in, text out: prompts to a left-padded batch, and token steps back to completions.

Every prompt starts after `<|endoftext|>`, as documents do in training
(`tokenizer.document_ids`), so an empty prompt is a valid start; a prompt longer than the
context is refused. Stop strings end a completion at the first place its text contains one
(the stop string itself is not returned, `stops.StopText`); stop tokens end it at the
token.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from tlm.device import placement
from tlm.generate.beam import beam_search
from tlm.generate.config import GenerationConfig
from tlm.generate.decode import best_rows, generate
from tlm.generate.stops import StopText
from tlm.inference import Decoder
from tlm.tokenizer import Tokenizer, document_ids


@dataclass
class Completion:
    prompt: str
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "length"  # "length", "eos" (end of text) or "stop" (a stop string)
    prompt_tokens: list[int] | None = None  # with prompt_logprobs: the prompt after <|endoftext|>
    prompt_logprobs: list[float] | None = None  # log P(each prompt token | the ones before)
    speculation: dict | None = None  # with a draft: tokens drafted, kept, target steps


def encode_prompts(
    tokenizer: Tokenizer, prompts: list[str], context_length: int | None
) -> tuple[Tensor, Tensor | None]:
    """Prompts -> ids [B,S] left-padded with <|endoftext|>, and a mask (None if no padding).
    A prompt longer than `context_length` is refused (`tokenizer.within`; None: any)."""
    rows = [
        document_ids(tokenizer, prompt, context_length, f"prompt {i + 1}")
        for i, prompt in enumerate(prompts)
    ]
    return left_padded(rows, tokenizer.eot_id)


def left_padded(rows: list[list[int]], pad: int) -> tuple[Tensor, Tensor | None]:
    """Token rows -> ids [B,S] left-padded with `pad`, and a mask (None if no padding), on
    the CPU: the decoding loop moves them to the model's device once."""
    width, cpu = max(len(row) for row in rows), torch.device("cpu")
    padded = [[pad] * (width - len(row)) + row for row in rows]
    kept = [[0] * (width - len(row)) + [1] * len(row) for row in rows]
    ids = torch.tensor(padded, dtype=torch.long, device=cpu)
    mask = torch.tensor(kept, dtype=torch.long, device=cpu)
    return ids, None if all(len(row) == width for row in rows) else mask


def complete(
    model: nn.Module,
    tokenizer: Tokenizer,
    prompts: list[str],
    config: GenerationConfig,
    stop: tuple[str, ...] = (),
    prompt_logprobs: bool = False,
) -> list[Completion]:
    """Completions of every prompt (num_return_sequences each, prompt by prompt)."""
    ids, mask = encode_prompts(tokenizer, prompts, model.config.reads)
    return _complete(model, tokenizer, prompts, ids, mask, config, stop, prompt_logprobs)


def complete_tokens(
    model: nn.Module,
    tokenizer: Tokenizer,
    rows: list[list[int]],
    config: GenerationConfig,
    stop: tuple[str, ...] = (),
) -> list[Completion]:
    """Completions of prompts given as token ids, each read as it is (no <|endoftext|> put
    before it), left-padded into one batch."""
    ids, mask = left_padded(rows, tokenizer.eot_id)
    prompts = [tokenizer.decode(row) for row in rows]
    return _complete(model, tokenizer, prompts, ids, mask, config, stop, False)


def _complete(model, tokenizer, prompts, ids, mask, config, stop, prompt_logprobs):
    """With `best_of` m, m samples of each prompt are completed and the n of highest total
    log-probability (of the text returned) kept, best first."""
    device = placement(model)[0]
    ids, mask = ids.to(device), None if mask is None else mask.to(device)
    config, keep = config.candidates()
    n = config.num_return_sequences  # candidates per prompt
    out = [Completion(prompt) for prompt in prompts for _ in range(n)]
    if prompt_logprobs:
        for row, (tokens, logprobs) in enumerate(score_prompts(model, ids, mask)):
            for completion in out[row * n : (row + 1) * n]:
                completion.prompt_tokens, completion.prompt_logprobs = tokens, logprobs
    if config.num_beams > 1:
        result = beam_search(model, ids, config, mask)
        for row, completion in enumerate(out):
            tokens = result.sequences[row, ids.shape[1] :].tolist()[
                : len(result.token_logprobs[row])
            ]
            _finish(completion, tokenizer, tokens, result.token_logprobs[row], stop, config.eos_ids)
        return out
    steps = list(_until_stopped(generate(model, ids, config, mask), tokenizer, stop, len(out)))
    for row, completion in enumerate(out):
        rows = [step.lists() for step in steps]
        tokens = [tokens[row] for tokens, _, _ in rows]
        logprobs = [logprobs[row] for _, logprobs, _ in rows]
        _finish(completion, tokenizer, tokens, logprobs, stop, config.eos_ids)
        if steps and steps[-1].drafts is not None:
            completion.speculation = speculation(*steps[-1].drafts[row])
    if n > keep:
        totals = [math.fsum(c.logprobs) for c in out]
        totals = torch.tensor(totals, dtype=torch.float64, device=torch.device("cpu"))
        out = [out[i] for i in best_rows(totals, n, keep).tolist()]
    return out


def speculation(drafted: int, kept: int, steps: int) -> dict:
    """What a row's drafts did: tokens drafted and kept, the share kept, the target's
    steps and the tokens each step gave (every step gives its kept tokens and one more)."""
    return {
        "drafted": drafted,
        "accepted": kept,
        "acceptance": round(kept / drafted, 4) if drafted else None,
        "target_steps": steps,
        "tokens_per_step": round((steps + kept) / steps, 4) if steps else None,
    }


def score_prompts(
    model: nn.Module, ids: Tensor, mask: Tensor | None
) -> list[tuple[list[int], list[float]]]:
    """For every row: its tokens after <|endoftext|>, and log P of each given the ones before."""
    with torch.no_grad():
        logprobs = model(ids, attention_mask=mask).float().log_softmax(dim=-1)  # [B,S,V]
    scored = logprobs[:, :-1].gather(2, ids[:, 1:, None])[..., 0]  # [B,S-1]: token t+1 | <= t
    rows = []
    for r in range(len(ids)):
        first = 1 if mask is None else int(mask.shape[1] - mask[r].sum()) + 1  # after padding
        rows.append((ids[r, first:].tolist(), scored[r, first - 1 :].tolist()))
    return rows


@torch.no_grad()
def token_logprobs(
    model: nn.Module, ids: list[int], top: int = 0
) -> list[tuple[float, list[tuple[int, float]]]]:
    """What an echo with log-probabilities reports of a prompt, in one forward pass: for
    each token after the first, log P(ids[i] | ids[:i]) and the `top` likeliest tokens at
    that position with theirs (the model's distribution, before any sampling filter)."""
    device = placement(model)[0]
    x = torch.tensor([ids], device=device)
    logprobs = model(x)[0, :-1].float().log_softmax(dim=-1)  # [T-1, V]
    chosen = logprobs.gather(1, x[0, 1:, None])[:, 0].tolist()
    if not top:
        return [(c, []) for c in chosen]
    values, order = logprobs.topk(min(top, logprobs.shape[-1]), dim=-1)
    pairs = zip(order.tolist(), values.tolist(), strict=True)
    return [(c, list(zip(o, v, strict=True))) for c, (o, v) in zip(chosen, pairs, strict=True)]


def stream_completion(
    model: nn.Module,
    tokenizer: Tokenizer,
    prompt: str,
    config: GenerationConfig,
    stop: tuple[str, ...] = (),
) -> Iterator[str]:
    """The text of one sampled completion, piece by piece as it is generated.

    Text that could be the start of a stop string is held back until it is not.
    """
    ids, _ = encode_prompts(tokenizer, [prompt], model.config.reads)
    yield from stream_tokens(model, tokenizer, ids, config, stop)


def stream_tokens(
    model: nn.Module,
    tokenizer: Tokenizer,
    ids: Tensor,
    config: GenerationConfig,
    stop: tuple[str, ...] = (),
    decoder: Decoder | None = None,
) -> Iterator[str]:
    """`stream_completion` of a prompt given as ids [1, S], read as they are (on `decoder`,
    a caller's that it keeps from one prompt to the next, if given)."""
    text = StopText(tokenizer, stop)
    for step in generate(model, ids.to(placement(model)[0]), config, decoder=decoder):
        token = step.lists()[0][0]
        if token in config.eos_ids:
            break
        piece = text.push(token)
        if piece:
            yield piece
        if text.stopped:
            return
    yield text.finish()


def _until_stopped(steps, tokenizer: Tokenizer, stop: tuple[str, ...], rows: int):
    """Pass steps on until every row has ended, by an end token or by a stop string."""
    if not stop:
        yield from steps
        return
    texts = [StopText(tokenizer, stop) for _ in range(rows)]  # no row is decoded twice
    ended = [False] * rows
    for step in steps:
        yield step
        tokens, _, finished = step.lists()
        for r in range(rows):
            if not ended[r]:
                texts[r].push(tokens[r])
                ended[r] = finished[r] or texts[r].stopped
        if all(ended):
            return


def _finish(
    completion: Completion,
    tokenizer: Tokenizer,
    tokens: list[int],
    logprobs: list[float],
    stop: tuple[str, ...],
    eos: tuple[int, ...],
) -> None:
    """Cut the tokens at the first end token, the text at the first stop string."""
    end = next((i for i, t in enumerate(tokens) if t in eos), None)
    if end is not None:
        tokens, logprobs, completion.finish_reason = tokens[:end], logprobs[:end], "eos"
    holder = StopText(tokenizer, stop)
    text = "".join(holder.push(token) for token in tokens) + holder.finish()
    if holder.stopped:
        completion.finish_reason = "stop"
        while tokens and len(tokenizer.decode(tokens[:-1])) >= len(text):  # drop those past it
            tokens, logprobs = tokens[:-1], logprobs[:-1]
    completion.text, completion.tokens, completion.logprobs = text, tokens, logprobs
