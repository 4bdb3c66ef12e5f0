"""Measuring an assistant on held-out conversations: loss, stop rate and chrF.

Each held-out conversation (a `ChatData` split) is asked up to its last user turn, and the
greedy reply is compared with the conversation's own last answer:

- **loss**: the mean cross-entropy over the learned tokens (the assistant's turns and their
  `<|end|>`) of the whole split, each conversation alone in its window, as training packs it;
- **stop rate**: the share of replies that end their turn (`<|end|>`) within
  `max_new_tokens`;
- **chrF** (Popović 2015, sacrebleu's implementation): character n-gram F-score of the
  replies against the answers, in points.

A base model (a run without the template) is measured the way one would prompt it: the plain
template (`chat.plain_prompt`) after three short training conversations as examples (fewer
where three do not fit the context), its reply ending at the next "User:" line or at
`<|endoftext|>` (that is its stop). It has no loss here: it never learned the template's
tokens.
"""

from __future__ import annotations

import time
from typing import Any

import sacrebleu
import torch
from torch import nn

from tlm.chat import END, PLAIN_STOP, ChatError, parse, plain_prompt, speaks
from tlm.data.packing import pack
from tlm.data.tokens import ChatData
from tlm.device import placement
from tlm.generate import GenerationConfig
from tlm.generate.chat import Prompt, chat_prompt, replies, reply_room
from tlm.generate.text import complete_tokens
from tlm.model.loss import packed_nll
from tlm.tokenizer import Tokenizer, document_ids, load_tokenizer

EXAMPLES = 3  # the base model's examples


def held_out(data: ChatData, split: str, limit: int | None) -> list[list[dict[str, str]]]:
    """The conversations of `split` as messages, the first `limit` of them."""
    tokenizer = load_tokenizer(data.folder)
    tokens, offsets = data.split(split), data.offsets(split)
    count = len(offsets) - 1 if limit is None else min(limit, len(offsets) - 1)
    return [parse(tokens[offsets[i] : offsets[i + 1]].tolist(), tokenizer) for i in range(count)]


def asked(conversation: list[dict[str, str]]) -> tuple[list[dict[str, str]], str]:
    """(the messages up to the last user turn, the last answer: the reference)."""
    last = max(i for i, m in enumerate(conversation) if m["role"] == "assistant")
    return conversation[:last], conversation[last]["content"]


@torch.no_grad()
def chat_loss(model: nn.Module, data: ChatData, split: str) -> float:
    """Mean loss per learned token of the split, its conversations packed as training packs
    them and scored as training's validation scores them (`packed_nll`)."""
    tokenizer = load_tokenizer(data.folder)
    T = model.config.context_length
    packed = pack(data, split, T, tokenizer.special_id(END), tokenizer.eot_id)
    total, count = packed_nll(model, packed, placement(model)[0])
    return total / max(count, 1)


def evaluate_chat(
    model: nn.Module,
    tokenizer: Tokenizer,
    data: ChatData,
    split: str = "val",
    max_new_tokens: int = 64,
    limit: int | None = None,
    batch_size: int = 32,
    examples: int = 0,
) -> dict[str, Any]:
    """Loss (assistants only), stop rate and chrF of greedy replies to the held-out
    conversations of `data` (the first `limit`); `examples` of them returned as shown."""
    started = time.perf_counter()
    T, config = model.config.context_length, GenerationConfig(max_new_tokens=max_new_tokens)
    every = held_out(data, split, limit)
    theirs = load_tokenizer(data.folder)  # the data's: the template's tokens
    prompts = [
        template_prompt(asked(c)[0], theirs, T, reply_room(config.max_new_tokens, T)) for c in every
    ]
    conversations = [c for c, p in zip(every, prompts, strict=True) if p is not None]
    prompts = [p for p in prompts if p is not None]
    assistant = speaks(tokenizer)
    shots = [] if assistant else shortest(data, EXAMPLES)
    answers, stopped, references = [], [], [asked(c)[1] for c in conversations]
    for i in range(0, len(conversations), batch_size):
        if assistant:
            got = replies(model, tokenizer, prompts[i : i + batch_size], config)
            got = [(c.text, c.finish_reason == "eos") for c in got]
        else:
            part = [asked(c)[0] for c in conversations[i : i + batch_size]]
            got = base_replies(model, tokenizer, shots, part, config)
        answers += [text for text, _ in got]
        stopped += [ended for _, ended in got]
    results = {
        "conversations": len(conversations),
        "skipped": len(every) - len(conversations),  # a last question longer than the context
        "template": "tlm" if assistant else "plain, with examples",
        "stop_rate": sum(stopped) / max(1, len(stopped)),
        "chrf": sacrebleu.corpus_chrf(answers, [references]).score,
    }
    if assistant:
        results["loss"] = chat_loss(model, data, split)
    results["seconds"] = time.perf_counter() - started
    results["examples"] = [
        {"question": m[-1]["content"], "reply": a, "reference": r}
        for (m, r), a in zip(map(asked, conversations[:examples]), answers, strict=False)
    ]
    return results


def template_prompt(messages, tokenizer: Tokenizer, T: int, room: int) -> Prompt | None:
    """The template's prompt of a conversation, leaving `room` positions for the reply where
    it can, else one (the reply then slides the window, as any generation past the
    context); None where even the last question does not fit the context."""
    for left in (room, 1):
        try:
            return chat_prompt(messages, tokenizer, T, left)
        except ChatError:
            continue
    return None


def base_replies(model, tokenizer, shots, conversations, config) -> list[tuple[str, bool]]:
    """(reply, whether it stopped) for each conversation, in the plain template after the
    examples (`shots`) that fit."""
    T, eos = model.config.context_length, (tokenizer.eot_id,)
    room = reply_room(config.max_new_tokens, T)
    rows = []
    for messages in conversations:
        for k in range(len(shots), -1, -1):  # drop examples until the prompt fits
            text = plain_prompt([m for shot in shots[len(shots) - k :] for m in shot] + messages)
            ids = document_ids(tokenizer, text)
            if len(ids) + room <= T:
                break
        rows.append(ids[-(T - room) :])  # without examples, its last tokens if still too long
    config = GenerationConfig(max_new_tokens=config.max_new_tokens, eos_token_id=eos)
    done = complete_tokens(model, tokenizer, rows, config, stop=(PLAIN_STOP,))
    return [(c.text.strip(), c.finish_reason in ("eos", "stop")) for c in done]


def shortest(data: ChatData, k: int) -> list[list[dict[str, str]]]:
    """The base model's examples: the shortest one-turn training conversation (no system
    message) for each of the first `k` ways a question begins (its first word), shortest
    last, so that the examples show more than one kind of question."""
    offsets = data.offsets("train")
    lengths = offsets[1:] - offsets[:-1]
    tokenizer, tokens, found = load_tokenizer(data.folder), data.split("train"), {}
    for i in sorted(range(len(lengths)), key=lambda i: (lengths[i], i)):
        messages = parse(tokens[offsets[i] : offsets[i + 1]].tolist(), tokenizer)
        if [m["role"] for m in messages] == ["user", "assistant"]:
            found.setdefault(messages[0]["content"].split()[0], messages)
        if len(found) == k:
            break
    return list(found.values())[::-1]
