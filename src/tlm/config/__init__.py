"""Configuration: frozen, validated dataclasses, and their conversion to and from dicts.

Every error names the field and what it accepts, so a typo in a TOML file or a `--flag`
is a one-line message rather than a stack trace deep inside the model.

    model.py    ModelConfig: the shape and the choices of a transformer
    train.py    TrainConfig: how to train; a TOML file's keys sorted between the two
    fields.py   a dict -> a dataclass: unknown keys, types, strings as typed (ConfigError)
"""

from tlm.config.fields import ConfigError, coerce, from_dict
from tlm.config.model import ModelConfig
from tlm.config.train import TrainConfig, load_toml, renamed, split_fields

__all__ = [
    "ConfigError",
    "ModelConfig",
    "TrainConfig",
    "coerce",
    "from_dict",
    "load_toml",
    "renamed",
    "split_fields",
]
