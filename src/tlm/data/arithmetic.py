"""`arithmetic`: a built-in task a verifier can check, made offline (J&M ch. 12).

Problems of two numbers with 2 to 4 digits between them (7 × 8, 48 + 7, 36 − 91, 482 × 7),
joined by +, − or ×, each asked in one of a few wordings, in symbols ("What is 48 + 7?") or
in words ("What is 48 plus 7?", "Multiply 482 by 7."), chosen by the problem's hash; the
answer is the result, and a reply is right when its last number is (the `number` reward).
The digits are counted over the problem, not each side: with 2 to 4 digits a side (products
of 8 digits) the demo's 0.9M-parameter assistant got none right after SFT (pass@1 0%, pass@8
2% on held-out problems), which leaves RL nothing to reinforce; with 2 to 4 in all it gets
about half right and more with samples (pass@1 52%, pass@8 70% after the same SFT), the
regime in which RL and DPO have something to sharpen. The problems come from a generator
seeded with `SEED`, the same on every machine: each problem's total of digits drawn from 2
to 4, split between its sides at random. The held-out split is every problem whose hash puts
it in the tenth `HELD_OUT` (no held-out problem is trained on, in any of its wordings). The
same problems serve three tasks:

- chat (`tlm prepare --task chat arithmetic`): the question, and an answer that writes the
  problem out and ends with the number ("48 + 7 = 55.");
- preference (`--task preference arithmetic`): the question, that answer chosen, and one
  with a plausible mistake (off by one, by ten, two digits swapped, or a sign) rejected;
- prompts (`--task prompts arithmetic`): the question, with the number as its answer.
"""

from __future__ import annotations

import hashlib
import json
import random

SEED = 2026
PROBLEMS = 6000  # before the held-out split: about 5,400 to train on, 600 held out
HELD_OUT = 0  # problems whose hash is this modulo 10 are held out
SYMBOLS = {"+": "plus", "-": "minus", "*": "times"}
WORDINGS = {
    "+": ("What is {a} + {b}?", "What is {a} plus {b}?", "Add {a} and {b}."),
    "-": ("What is {a} - {b}?", "What is {a} minus {b}?", "Subtract {b} from {a}."),
    "*": ("What is {a} * {b}?", "What is {a} times {b}?", "Multiply {a} by {b}."),
}

Problem = tuple[int, str, int]  # a, op, b


def problems(count: int | None = None, seed: int = SEED) -> list[Problem]:
    """`count` (PROBLEMS) distinct problems of 2 to 4 digits in all, + − × alike."""
    count = PROBLEMS if count is None else count
    rng, seen, out = random.Random(seed), set(), []
    while len(out) < count:
        digits = rng.randint(2, 4)
        left = rng.randint(1, digits - 1)
        a, b = (_number(rng, n) for n in (left, digits - left))
        op = rng.choice("+-*")
        if (a, op, b) not in seen:
            seen.add((a, op, b))
            out.append((a, op, b))
    return out


def _number(rng: random.Random, digits: int) -> int:
    """A number of exactly `digits` digits (0 counts as a one-digit number)."""
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def result(problem: Problem) -> int:
    a, op, b = problem
    return a + b if op == "+" else a - b if op == "-" else a * b


def question(problem: Problem) -> str:
    a, op, b = problem
    wordings = WORDINGS[op]
    return wordings[_hash(problem) % len(wordings)].format(a=a, b=b)


def worked(problem: Problem, value: int | None = None) -> str:
    """The answer: the problem written out, ending with `value` (the result unless given)."""
    a, op, b = problem
    value = result(problem) if value is None else value
    symbol = {"+": "+", "-": "-", "*": "×"}[op]
    return f"{a} {symbol} {b} = {value}."


def mistake(problem: Problem) -> int:
    """A plausible wrong result: off by one or ten, two digits swapped, or the sign."""
    right = result(problem)
    kind = _hash(problem) // 7 % 4
    if kind == 3 and right != 0:
        return -right
    digits = list(str(abs(right)))
    if kind == 2 and len(digits) > 1 and digits[-1] != digits[-2]:
        digits[-1], digits[-2] = digits[-2], digits[-1]
        return int("".join(digits)) * (1 if right >= 0 else -1)
    return right + (10 if kind == 1 else 1)


def split(items) -> tuple[list, list]:
    """(train, held out) of the problems, by their hash."""
    train, val = [], []
    for n, problem in enumerate(problems(), start=1):
        (val if _hash(problem) % 10 == HELD_OUT else train).append(
            (f"arithmetic:{n}", items(problem))
        )
    return train, val


def _text(train: list, val: list) -> str:
    """The corpus as JSON lines (what its sha256 describes)."""
    return "".join(json.dumps(item, sort_keys=True) + "\n" for _, item in [*train, *val])


def arithmetic_chat() -> tuple[list, list, str]:
    """(train, held-out, text): each problem as a one-turn conversation."""
    train, val = split(
        lambda p: [
            {"role": "user", "content": question(p)},
            {"role": "assistant", "content": worked(p)},
        ]
    )
    return train, val, _text(train, val)


def arithmetic_pairs() -> tuple[list, list, str]:
    """(train, held-out, text): each problem as a {prompt, chosen, rejected} record."""
    train, val = split(
        lambda p: {"prompt": question(p), "chosen": worked(p), "rejected": worked(p, mistake(p))}
    )
    return train, val, _text(train, val)


def arithmetic_prompts() -> tuple[list, list, str]:
    """(train, held-out, text): each problem as a {prompt, answer} record."""
    train, val = split(lambda p: {"prompt": question(p), "answer": result(p)})
    return train, val, _text(train, val)


def _hash(problem: Problem) -> int:
    return int.from_bytes(hashlib.sha256(repr(problem).encode()).digest()[:8], "big")
