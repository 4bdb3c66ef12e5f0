"""The serving engine's thread owns the model's work: it loads the model when given a
loader, makes the KV cache, and decodes (serve/engine.py); a load's error reaches the
caller."""

import threading

import pytest

from tlm.checkpoint import CheckpointError
from tlm.cli import main
from tlm.serve import Engine


def test_the_engine_loads_its_model_in_its_own_thread(make_model):
    where = []

    def load():
        where.append(threading.current_thread())
        return make_model()

    engine = Engine(load, None, slots=2)
    try:
        assert where == [engine.thread] and engine.thread is not threading.main_thread()
        assert len(engine.slots.rows) == 2 and engine.slots.model.config.vocab_size == 97
    finally:
        engine.close()
    model = make_model()
    engine = Engine(model, None, slots=1)  # a model given as it is
    try:
        assert engine.slots.model.config is model.config
    finally:
        engine.close()


def test_a_load_that_fails_raises_from_the_constructor(tmp_path, capsys):
    def load():
        raise CheckpointError("no weights here")

    with pytest.raises(CheckpointError, match="no weights here"):
        Engine(load, None)
    assert main(["serve", str(tmp_path / "missing"), "--port", "0"]) != 0
    assert len(capsys.readouterr().err.strip().splitlines()) == 1  # one line, no traceback
