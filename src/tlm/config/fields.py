"""A dict (from TOML, JSON or command-line strings) -> a frozen dataclass, every error
naming the field and what it accepts, so that a typo is a one-line message rather than a
stack trace deep inside the model."""

from __future__ import annotations

import dataclasses
from typing import Any, get_type_hints

from tlm.errors import UserError


class ConfigError(UserError):
    """A configuration value that cannot be used; the message names the field."""


def check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")


def from_dict(cls: type, values: dict[str, Any]) -> Any:
    """Build dataclass `cls` from `values`; unknown keys and wrong types are errors."""
    hints = get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ConfigError(
            f"unknown {cls.__name__} key(s): {', '.join(unknown)} "
            f"(known: {', '.join(sorted(names))})"
        )
    return cls(**{k: coerce(k, v, hints[k]) for k, v in values.items()})


def coerce(name: str, value: Any, hint: Any) -> Any:
    """Convert `value` (from TOML, JSON or a command-line string) to the field's type."""
    kinds = _kinds(hint)
    if value is None:
        if type(None) in kinds:
            return None
        raise ConfigError(f"{name} must not be empty")
    if isinstance(value, str) and str not in kinds:
        return _parse_string(name, value, kinds)
    for kind in kinds:
        if kind is bool and isinstance(value, bool):
            return value
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if kind is float and isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if kind is str and isinstance(value, str):
            return value
        names = _is_names(kind) and isinstance(value, list | tuple)
        if names and all(isinstance(v, str) for v in value):
            return tuple(value)
    expected = " or ".join(k.__name__ for k in kinds if k is not type(None))
    raise ConfigError(f"{name} must be {expected}, got {value!r}")


def _is_names(kind: Any) -> bool:
    """A `tuple[str, ...]` field: names (a fine-tuned head's labels), a list in JSON and
    comma-separated on a command line."""
    return getattr(kind, "__origin__", None) is tuple


def _kinds(hint: Any) -> tuple[type, ...]:
    args = getattr(hint, "__args__", None)
    return tuple(args) if args else (hint,)


def _parse_string(name: str, text: str, kinds: tuple[type, ...]) -> Any:
    lowered = text.strip().lower()
    if type(None) in kinds and lowered in ("none", "null", ""):
        return None
    if bool in kinds:
        if lowered in ("true", "1", "yes", "on"):
            return True
        if lowered in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{name} must be true or false, got {text!r}")
    if any(_is_names(kind) for kind in kinds):
        return tuple(part.strip() for part in text.split(","))
    for kind in (int, float):
        if kind in kinds:
            try:
                return kind(text)
            except ValueError:
                continue
    expected = " or ".join(k.__name__ for k in kinds if k is not type(None))
    raise ConfigError(f"{name} must be {expected}, got {text!r}")
