"""`tlm train --compile`: one graph per shape, the same losses as eager."""

import json

import pytest
import torch
from torch._dynamo.utils import counters

from tlm.train import new_run_configs, open_run


def rows(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_compiled_training_has_no_graph_break_through_validations(docs_chars, tmp_path):
    """Validation scores its tokens in batches of 32 windows, then fewer, then one window
    shorter than the context (every shape scoring the whole split meets; 35 windows and 5
    tokens here): each shape gets its own graph. Compiled with dynamic shapes, the shorter
    window made SDPA's is_causal symbolic, the forward broke into pieces, and training ran
    them from the first validation on."""
    torch._dynamo.reset()
    counters.clear()
    losses = {}
    for compiled in (True, False):
        run = tmp_path / str(compiled)
        values = {"data": str(docs_chars), "out": str(run), "max_steps": 9, "compile": compiled}
        values |= {"eval_interval": 3, "eval_tokens": 35 * 16 + 5, "batch_size": 8}
        values |= {"log_interval": 3}  # validation: [32, 17], [3, 17] and [1, 6] windows
        shape = {"n_layers": 1, "d_model": 16, "n_heads": 2, "context_length": 16}
        model_config, train_config, data = new_run_configs(shape, values)
        tokenizer = (docs_chars / "tokenizer.json").read_text()
        open_run(model_config, train_config, data, tokenizer, progress_bar=False).fit()
        losses[compiled] = [r.get("train_loss", r.get("val_loss")) for r in rows(run)]
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert losses[True] == pytest.approx(losses[False], rel=1e-4)
