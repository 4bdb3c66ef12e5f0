import dataclasses

import pytest

from tlm.config import ConfigError, ModelConfig


def test_derived_sizes():
    config = ModelConfig(vocab_size=10, d_model=64, n_layers=2, n_heads=4, context_length=8)
    assert config.d_head == 16 and config.d_ff == 256 and config.d_attn == 64
    custom = ModelConfig(d_model=64, n_heads=3, d_head=20, d_ff=100)
    assert custom.d_head == 20 and custom.d_attn == 60 and custom.d_ff == 100


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ModelConfig().d_model = 3


@pytest.mark.parametrize(
    "values, field",
    [
        ({"d_model": 64, "n_heads": 3}, "n_heads"),
        ({"d_model": -8}, "d_model"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"n_layers": -1}, "n_layers"),
        ({"n_heads": 0}, "n_heads"),
        ({"context_length": -5}, "context_length"),
        ({"d_ff": -1}, "d_ff"),
        ({"d_head": 0}, "d_head"),
        ({"position": "absolute"}, "position"),
        ({"norm": "sandwich"}, "norm"),
        ({"activation": "swish"}, "activation"),
        ({"dropout": 1.5}, "dropout"),
        ({"layer_norm_eps": 0.0}, "layer_norm_eps"),
        ({"position": "rope", "d_model": 30, "n_heads": 2}, "d_head"),
        ({"d_model": 2.5}, "d_model"),
    ],
)
def test_bad_values_name_the_field(values, field):
    with pytest.raises(ValueError, match=field):
        ModelConfig(**values)


def test_round_trip_through_dict():
    config = ModelConfig(d_model=48, n_heads=3, position="rope", norm="post", bias=False)
    assert ModelConfig.from_dict(config.to_dict()) == config


def test_from_dict_rejects_unknown_keys_and_coerces_strings():
    with pytest.raises(ConfigError, match="d_modle"):
        ModelConfig.from_dict({"d_modle": 64})
    config = ModelConfig.from_dict(
        {"d_model": "96", "dropout": "0.1", "tie_embeddings": "false", "d_ff": "none"}
    )
    assert config.d_model == 96 and config.dropout == 0.1
    assert config.tie_embeddings is False and config.d_ff == 4 * 96
    with pytest.raises(ConfigError, match="n_layers"):
        ModelConfig.from_dict({"n_layers": "two"})
    with pytest.raises(ConfigError, match="bias"):
        ModelConfig.from_dict({"bias": "maybe"})


def test_an_older_runs_attention_impl_is_ignored():
    old = {**ModelConfig(d_model=48, n_heads=3).to_dict(), "attention_impl": "reference"}
    assert ModelConfig.from_dict(old) == ModelConfig(d_model=48, n_heads=3)
    with pytest.raises(TypeError, match="attention_impl"):
        ModelConfig(attention_impl="fused")  # not a field any more


def test_the_training_precision_keeps_its_older_name_as_an_alias(capsys):
    """TrainConfig.precision was `dtype`: old runs' config.json, TOML files and the
    `--dtype` flag (nanoGPT's name) still set it; the flag says, in one line, that it is
    `--precision` now (`--dtype` names the weight format a model is read in)."""
    import argparse

    from tlm.cli.args import add_config_flags, config_overrides
    from tlm.config import TrainConfig, split_fields

    assert TrainConfig.from_dict({"dtype": "float32"}).precision == "float32"
    assert split_fields({"dtype": "bfloat16"})[1] == {"precision": "bfloat16"}
    assert split_fields({"train": {"dtype": "bfloat16"}})[1] == {"precision": "bfloat16"}
    parser = argparse.ArgumentParser()
    add_config_flags(parser, TrainConfig, "training")
    for flag in ("--dtype", "--precision"):
        args = parser.parse_args([flag, "float32"])
        assert config_overrides(args, TrainConfig) == {"precision": "float32"}
        said = capsys.readouterr().err.strip().splitlines()
        moved = "tlm: --dtype is now --precision here (the training precision); --dtype names"
        assert said == ([moved + " a weight format"] if flag == "--dtype" else [])
    with pytest.raises(ConfigError, match="precision must be one of"):
        TrainConfig(precision="float16")
