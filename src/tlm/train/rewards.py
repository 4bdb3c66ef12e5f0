"""Verifiable rewards: a reply and the answer it should give -> a number (J&M ch. 12).

What RL on verifiable rewards maximises and `tlm eval --task verify` measures. Built in,
each 1.0 for a correct reply and 0.0 otherwise:

- `number`: the reply's last number equals the answer (a number, or a string of one);
  "1,234" and "1234" are one number, and 3 equals 3.0;
- `regex`: the whole reply (stripped) matches the answer, a regular expression;
- `json-schema`: the reply is JSON that is valid against the answer, a JSON schema.

A user's own is `module:function`, any importable function (reply: str, answer) -> float.
A reply counts as passing when its reward is at least 1 (`PASS`).
"""

from __future__ import annotations

import importlib
import json
import math
import re
from collections.abc import Callable
from typing import Any

from tlm.errors import UserError

PASS = 1.0  # a reward at least this counts the reply as correct (pass@k)
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")

Reward = Callable[[str, Any], float]


class RewardError(UserError):
    """A reward that cannot be found or used."""


def last_number(text: str) -> float | None:
    """The last number written in `text` (commas between digits dropped), or None."""
    found = NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def number(reply: str, answer: Any) -> float:
    """1.0 when the reply's last number equals the answer's value."""
    got = last_number(reply)
    want = answer if isinstance(answer, (int, float)) else last_number(str(answer))
    return float(got is not None and want is not None and math.isclose(got, want, abs_tol=1e-9))


def regex(reply: str, answer: Any) -> float:
    """1.0 when the whole stripped reply matches the answer's pattern."""
    try:
        return float(re.fullmatch(str(answer), reply.strip()) is not None)
    except re.error as exc:
        raise RewardError(f"the answer {answer!r} is not a regular expression ({exc})") from None


def json_schema(reply: str, answer: Any) -> float:
    """1.0 when the reply parses as JSON valid against the answer's schema."""
    try:
        import jsonschema_rs
    except ImportError:
        raise RewardError(
            'the json-schema reward needs jsonschema_rs: pip install "tlm[align]"'
        ) from None
    try:
        value = json.loads(reply)
    except json.JSONDecodeError:
        return 0.0
    schema = json.loads(answer) if isinstance(answer, str) else answer
    try:
        return float(jsonschema_rs.is_valid(schema, value))
    except ValueError as exc:
        raise RewardError(f"the answer is not a JSON schema ({exc})") from None


REWARDS: dict[str, Reward] = {"number": number, "regex": regex, "json-schema": json_schema}


def reward_of(name: str) -> Reward:
    """A built-in reward by name, or `module:function` imported."""
    if name in REWARDS:
        return REWARDS[name]
    if ":" not in name:
        raise RewardError(
            f"reward must be one of {', '.join(REWARDS)} or module:function; got {name!r}"
        )
    module_name, function_name = name.split(":", 1)
    try:
        function = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as exc:
        raise RewardError(f"cannot use reward {name}: {exc}") from None
    if not callable(function):
        raise RewardError(f"reward {name} is not a function")
    return function
