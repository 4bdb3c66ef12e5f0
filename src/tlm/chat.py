"""The chat template: a conversation as token ids and the loss mask of instruction tuning.

A base model continues text; an assistant answers in turns and stops (J&M ch. 12, after
pretraining ends at §10.11). Both see token ids. One template turns a conversation, a list
of messages `{"role", "content"}` (roles `system`, `user`, `assistant`: OpenAI's shape), into
ids: each turn is a role marker, the content's tokens, and an end-of-turn token,

    <|endoftext|> <|system|> You are terse. <|end|> <|user|> Hi <|end|> <|assistant|> Hello <|end|>

after the `<|endoftext|>` every prepared document starts with. The markers and `<|end|>` are
special tokens (`tokenizer.with_specials`): no text spells them, and nothing but the content
lies between them, so tokenizing the rendered string whole gives the same ids as rendering
turn by turn (what `transformers` does with the exported template, below).

Instruction tuning learns the assistant's turns only: the mask is 1 on the assistant's
content and its `<|end|>` (so the model learns to stop), 0 on everything else. For
generation the ids end with `<|assistant|>`: the prompt a reply continues, until `<|end|>`.

`render` is the one renderer: `tlm prepare --task chat`, training, `tlm chat`, the server
and the exported templates (`JINJA`, which `transformers`' `apply_chat_template` runs) all
speak it; a test holds `transformers`' ids and assistant mask equal to `render`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tlm.errors import UserError
from tlm.tokenizer import EOT, Tokenizer, with_specials

ROLES = ("system", "user", "assistant")
MARKERS = {role: f"<|{role}|>" for role in ROLES}
END = "<|end|>"
SPECIALS = (*MARKERS.values(), END)

# The same template in Jinja, for transformers (`chat_template.jinja`: `{% generation %}`
# marks what `return_assistant_tokens_mask` reports) and llama.cpp (GGUF's
# `tokenizer.chat_template`). Messages are checked by `check` before either sees them.
JINJA = (
    "{{- '" + EOT + "' -}}\n"
    "{%- for message in messages -%}\n"
    "{%- if message['role'] == 'assistant' -%}\n"
    "{{- '<|assistant|>' -}}{% generation %}{{- message['content'] + '" + END + "' -}}"
    "{% endgeneration %}\n"
    "{%- else -%}\n"
    "{{- '<|' + message['role'] + '|>' + message['content'] + '" + END + "' -}}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}\n"
)


# ... and without `{% generation %}`, which only transformers' Jinja knows (llama.cpp's
# and llama-cpp-python's renderers reject it): what GGUF's tokenizer.chat_template holds
JINJA_PLAIN = JINJA.replace("{% generation %}", "").replace("{% endgeneration %}", "")


class ChatError(UserError):
    """A conversation the template cannot render; the message names the rule it breaks."""


def speaks(tokenizer: Tokenizer) -> bool:
    """Whether `tokenizer` has the template's special tokens (a run made for chat)."""
    return all(tokenizer.special_id(name) is not None for name in SPECIALS)


def chat_tokenizer(tokenizer: Tokenizer) -> Tokenizer:
    """`tokenizer` with the template's special tokens added (ids after its own)."""
    return with_specials(tokenizer, SPECIALS)


def check(messages: Sequence[Any], generation: bool = False) -> list[dict[str, str]]:
    """The messages as {role, content} dicts, or a ChatError naming the broken rule.

    The rules: every message is {role, content} with a known role and non-empty text (a
    string, or OpenAI's list of text parts, joined); a
    system message comes first or not at all; then user and assistant turns alternate,
    starting with the user's. A conversation to train on has an assistant turn; one to
    answer (`generation`) ends with the user's turn. No content spells a special token."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ChatError("a conversation is a non-empty list of messages")
    checked = []
    for n, message in enumerate(messages, start=1):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ChatError(f"message {n} is not an object with a role and a content")
        role, content = message["role"], message["content"]
        if isinstance(content, list):  # OpenAI's content parts: their text, joined
            if not all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in content):
                raise ChatError(f"message {n} has content parts that are not text")
            content = "".join(p["text"] for p in content)
        if role not in ROLES:
            raise ChatError(f"message {n} has unknown role {role!r} (roles: {', '.join(ROLES)})")
        if not isinstance(content, str) or not content.strip():
            raise ChatError(f"message {n} ({role}) has empty content")
        special = next((s for s in (EOT, *SPECIALS) if s in content), None)
        if special is not None:
            raise ChatError(f"message {n} ({role}) contains the special token {special}")
        if role == "system" and n > 1:
            raise ChatError(f"message {n} is a system message; only the first may be")
        checked.append({"role": role, "content": content})
    turns = checked[1:] if checked[0]["role"] == "system" else checked
    for n, message in enumerate(turns):
        expected = "user" if n % 2 == 0 else "assistant"
        if message["role"] != expected:
            at = n + 1 + (len(checked) - len(turns))
            raise ChatError(
                f"message {at} is the {message['role']}'s turn where the {expected}'s is due "
                "(turns alternate, the user's first)"
            )
    if generation and (not turns or turns[-1]["role"] != "user"):
        raise ChatError("a conversation to answer ends with the user's turn")
    if not generation and not any(m["role"] == "assistant" for m in turns):
        raise ChatError("the conversation has no assistant turn to learn from")
    return checked


def render(
    messages: Sequence[Any], tokenizer: Tokenizer, generation: bool = False
) -> tuple[list[int], list[int]]:
    """(ids, mask) of a conversation: the template's token ids and, for each, 1 where
    instruction tuning learns it (the assistant's content and `<|end|>`), else 0. With
    `generation`, the ids end with `<|assistant|>`, the prompt of the next reply."""
    if not speaks(tokenizer):
        raise ChatError("the tokenizer has no chat template's tokens (tokenizer.with_specials)")
    ids, mask = [tokenizer.eot_id], [0]
    end = tokenizer.special_id(END)
    for message in check(messages, generation):
        learned = int(message["role"] == "assistant")
        content = tokenizer.encode(message["content"])
        ids += [tokenizer.special_id(MARKERS[message["role"]]), *content, end]
        mask += [0] + [learned] * (len(content) + 1)
    if generation:
        ids.append(tokenizer.special_id(MARKERS["assistant"]))
        mask.append(0)
    return ids, mask


def turn_ends(ids: Sequence[int], tokenizer: Tokenizer) -> list[int]:
    """The positions just after each `<|end|>` of rendered ids: where a whole turn ends."""
    end = tokenizer.special_id(END)
    return [i + 1 for i, token in enumerate(ids) if token == end]


def parse(ids: Sequence[int], tokenizer: Tokenizer) -> list[dict[str, str]]:
    """The messages of rendered ids (`render`'s inverse): each role marker opens a turn whose
    content runs to its `<|end|>` (or to the end of the ids)."""
    roles = {tokenizer.special_id(marker): role for role, marker in MARKERS.items()}
    end = tokenizer.special_id(END)
    messages, role, content = [], None, []
    for token in ids:
        if token in roles or token == end:
            if role is not None and content:
                messages.append({"role": role, "content": tokenizer.decode(content)})
            role, content = roles.get(token), []
        elif role is not None:
            content.append(token)
    if role is not None and content:
        messages.append({"role": role, "content": tokenizer.decode(content)})
    return messages


def plain_prompt(messages: Sequence[Any]) -> str:
    """A conversation for a model without the template (a base model): a line per message,
    "System: ...", "User: ...", "Assistant: ...", then "Assistant:"; its reply ends where it
    writes PLAIN_STOP. The server's `/v1/chat/completions` speaks this to base runs."""
    names = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant"}
    lines = [f"{names[m['role']]}: {m['content']}\n" for m in messages]
    return "".join(lines) + "Assistant:"


PLAIN_STOP = "\nUser:"
