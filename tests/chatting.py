"""What the chat tests share: 'say X' -> 'X' conversations, a base run of a random tiny model
on their characters, the conversations prepared with its tokenizer, and a fine-tuned run."""

import json
from pathlib import Path

import numpy as np
import torch

from conftest import save_run, tiny_config
from tlm import TransformerLM
from tlm.cli import main
from tlm.data import ChatData, prepare_chat
from tlm.tokenizer import train_tokenizer

WORDS = ["cat", "dog", "sun", "moon", "tree", "leaf", "rain", "snow", "fish", "bird", "star"]


def chats(n=60, seed=0):
    """'say X' -> 'X': answers of 3-4 characters that end with <|end|>; some two-turn."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        a, b = rng.choice(WORDS, 2)
        turns = [{"role": "user", "content": f"say {a}"}, {"role": "assistant", "content": a}]
        if i % 3 == 0:
            turns += [{"role": "user", "content": f"say {b}"}, {"role": "assistant", "content": b}]
        out.append({"messages": turns})
    return out


def base_and_data(folder: Path) -> tuple[Path, ChatData]:
    """A base run (a random tiny model, context 32, on the chats' characters) and the
    chats prepared with its tokenizer (a fifth held out)."""
    tok = train_tokenizer("char", ["say " + " ".join(WORDS)])
    torch.manual_seed(0)
    model = TransformerLM(tiny_config(vocab_size=tok.vocab_size, position="rope"))
    base = save_run(folder / "base", model, tok)
    source = folder / "chats.jsonl"
    source.write_text("".join(json.dumps(c) + "\n" for c in chats()))
    prepare_chat([str(source)], folder / "data", tokenizer=str(base), val_fraction=0.2)
    return base, ChatData(folder / "data")


def fine_tuned(folder: Path) -> Path:
    """The base run fine-tuned on the chats for 60 steps: it answers and stops."""
    base, data = base_and_data(folder)
    run = folder / "chat"
    args = ["train", "--init-from", str(base), "--data", str(data.folder), "--out", str(run)]
    assert main([*args, "--max-steps", "60", "--lr", "3e-3", "--quiet"]) == 0
    return run
