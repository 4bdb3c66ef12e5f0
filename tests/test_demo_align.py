"""`tlm demo align` end to end on a tiny assistant (issue 63, part 5): SFT on arithmetic, GRPO
and DPO from it, each measured on held-out problems, align_eval.json and the RL plot."""

import json

import pytest
import torch

from conftest import save_run, tiny_config
from tlm import TransformerLM
from tlm.chat import chat_tokenizer
from tlm.cli import demo_align, main
from tlm.data import arithmetic
from tlm.tokenizer import train_tokenizer


@pytest.mark.slow
def test_demo_align_runs_its_three_phases_and_writes_their_figures(tmp_path, monkeypatch, capsys):
    _, _, text = arithmetic.arithmetic_chat()
    tok = chat_tokenizer(train_tokenizer("bpe", text.splitlines()[:2000], 300))
    torch.manual_seed(0)
    model = TransformerLM(tiny_config(vocab_size=tok.vocab_size, context_length=64))
    assistant = save_run(tmp_path / "assistant", model, tok)
    monkeypatch.setattr(demo_align, "EVAL_PROMPTS", 8)
    monkeypatch.setattr(arithmetic, "PROBLEMS", 400)  # the task's shape, a fifteenth of it
    args = ["demo", "align", "--assistant", str(assistant), "--out", str(tmp_path / "align")]
    args += ["--data", str(tmp_path / "data"), "--sft-steps", "6", "--grpo-steps", "2"]
    assert main([*args, "--dpo-steps", "2", "--quiet"]) == 0
    printed = capsys.readouterr().out
    for phase in ("[1/5] prepare arithmetic", "[2/5] supervised", "[3/5] RL", "[4/5] DPO"):
        assert phase in printed
    figures = json.loads((tmp_path / "align" / "align_eval.json").read_text())
    assert set(figures) == {"sft", "grpo", "dpo"}
    assert {"pass1", "pass8", "minutes"} <= set(figures["grpo"])
    assert 0 <= figures["dpo"]["pref_accuracy"] <= 1
    assert (tmp_path / "align" / "plots" / "rl.png").read_bytes()[:4] == b"\x89PNG"
    config = json.loads((tmp_path / "align" / "grpo" / "config.json").read_text())["train"]
    assert config["init_from"] == str(tmp_path / "align" / "sft") and config["reward"] == "number"
