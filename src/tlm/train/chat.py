"""Instruction tuning (J&M ch. 12): a base model fine-tuned on conversations.

`ChatWindows` is the `Trainer`'s batch source for a `ChatData` folder (`tlm prepare --task
chat`): its conversations packed whole into windows (`data/packing.py: pack`), each alone in
its window.

The loss is the mean cross-entropy over the supervised targets only (the chat mask's 1s: the
assistant's content and its `<|end|>`), normalised by the supervised targets of the whole
step (every micro-batch and every process), not per micro-batch: a window with more
answer tokens weighs more, as it should. A step with no supervised target makes no update
and is counted (its loss reads 0), never a NaN; the count is saved with the run's
checkpoints (`state_dict`), so the model card of a resumed run counts every step. Windows
come in a new order each pass over the data (seed, pass), so a resumed run sees the batches
an uninterrupted one would. The validation loss (`model/loss.py: packed_nll`) is the one
`tlm eval --task chat` reports.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tlm.chat import END
from tlm.config import ModelConfig, TrainConfig
from tlm.data.packing import pack
from tlm.data.tokens import ChatData
from tlm.io import write_text_atomic
from tlm.model.loss import packed_nll, supervised_loss
from tlm.tokenizer import load_tokenizer
from tlm.train.loop import Batches
from tlm.train.order import PassOrder
from tlm.train.report import model_section
from tlm.train.run import RunError

if TYPE_CHECKING:
    from tlm.train.loop import Trainer


class ChatWindows(Batches):
    """The packed windows of a `ChatData` folder as a `Trainer`'s batches."""

    def __init__(
        self, data: ChatData, model_config: ModelConfig, config: TrainConfig, world_size: int
    ) -> None:
        self.data, self.config, self.T = data, config, model_config.context_length
        tokenizer = load_tokenizer(data.folder)
        end_id, pad_id = tokenizer.special_id(END), tokenizer.eot_id
        if end_id is None:
            raise RunError(f"{data.folder}'s tokenizer has no chat template; prepare it again")
        self.train = pack(data, "train", self.T, end_id, pad_id)
        self.val = pack(data, "val", self.T, end_id, pad_id)
        if len(self.train) == 0:
            raise RunError(f"no training conversation has an assistant turn within {self.T} tokens")
        self.global_batch = config.batch_size * config.grad_accum  # windows a step, all ranks
        self.share = self.global_batch // world_size
        self.tokens_per_step = self.global_batch * self.T
        self.empty_steps = 0  # steps with no supervised target (no update)
        self.order = PassOrder(len(self.train), self.global_batch, config.seed)

    def summary(self) -> str:
        """What packing did, in one line (`tlm train` prints it)."""
        p = self.train
        return (
            f"chat: {p.conversations:,} conversations in {len(p):,} windows of "
            f"{self.T} ({p.cut:,} cut after their last whole answer that fits, {p.dropped:,} "
            f"dropped), padding {p.padding:.1%}"
        )

    def step_windows(self, step: int) -> np.ndarray:
        """The window indices of step `step`'s global batch (`order.PassOrder`)."""
        return self.order.step(step)

    def step_loss(self, trainer: Trainer, step: int) -> float:
        """The backward passes of step `step`; returns its mean loss per supervised target
        over every process (0.0 for a step with none, which then makes no update)."""
        c, rt = self.config, trainer.runtime
        windows = self.step_windows(step)
        supervised = int(self.train.supervised[windows].sum())  # all ranks' windows
        if supervised == 0:
            self.empty_steps += 1
            return 0.0
        mine = windows[rt.rank * self.share : (rt.rank + 1) * self.share]
        micros = [mine[i : i + c.batch_size] for i in range(0, self.share, c.batch_size)]
        total = 0.0
        for i, micro in enumerate(micros):
            x, y, learned, d = (t.to(trainer.device) for t in self.train.batch(micro))
            with rt.sync(trainer.wrapped, last=i == len(micros) - 1):
                with trainer.autocast():
                    loss = supervised_loss(trainer.forward(x, documents=d), y, learned)
                # DDP averages the ranks' gradients: each rank's share times world_size
                (loss * rt.world_size / supervised).backward()
            total += loss.item() * rt.world_size / supervised
        return rt.all_reduce_mean(total)

    @torch.no_grad()
    def validation_loss(self, trainer: Trainer) -> float | None:
        """The mean loss per supervised target of the validation windows (every rank takes
        part: `packed_nll` gives each its share)."""
        rt = trainer.runtime
        if len(self.val) == 0:
            return None
        with trainer.autocast():
            total, count = packed_nll(
                trainer.forward, self.val, trainer.device, rt.rank, rt.world_size
            )
        return rt.all_reduce_mean(total) / max(rt.all_reduce_mean(count), 1e-9)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of this source (JSON): the steps with nothing to learn."""
        return {"empty_steps": self.empty_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back a checkpoint's `state_dict`; one saved before it was kept counts 0."""
        self.empty_steps = int(state.get("empty_steps", 0))

    def write_card(self, trainer: Trainer, results: dict[str, Any]) -> None:
        """MODEL_CARD.md: the base run, the conversations and their counts, the results."""
        meta, p, run = self.data.meta, self.train, trainer.run
        train, val = meta["splits"]["train"], meta["splits"]["val"]
        sources = ", ".join(
            f"`{s['name']}` (sha256 `{s['sha256'][:12]}…`)" for s in meta["sources"]
        )
        loss = results.get("val_loss")
        base = self.config.init_from
        origin = f"fine-tuned from the base run `{base}`" if base else "from scratch (no base run)"
        card = f"""# Model card: `{run.name}`

An assistant: a causal transformer language model trained with tlm on conversations
(instruction tuning, J&M ch. 12), {origin}. It answers in turns of tlm's chat template
(`tlm/chat.py`) and ends each answer with `<|end|>`.

## Data

{sources}, prepared in `{self.data.folder}`: {train["conversations"]:,} training
conversations ({train["tokens"]:,} tokens, {train["supervised"]:,} learned: the assistant's
turns), {val["conversations"]:,} held out ({val["tokens"]:,} tokens, {val["supervised"]:,}
learned). Packed into {len(p):,} windows of {self.T}: {p.conversations:,}
conversations, {p.cut:,} cut after their last whole answer that fits, {p.dropped:,} dropped
(no whole answer fits); padding {p.padding:.1%}. Steps with no learned token: {self.empty_steps}.

{model_section(trainer, results)}

## Results

| | |
|---|---|
| steps | {results["step"]:,} |
| wall time | {results["elapsed"]:.1f} s |
| final train loss (nats per learned token) | {results["train_loss"]:.4f} |
| final validation loss (nats per learned token) | {"n/a" if loss is None else f"{loss:.4f}"} |

## How to use

```
tlm chat {run}
tlm chat {run} --message "What does json.dumps do?"
tlm eval --task chat {run} --data {self.data.folder}
```

## Limits

A small model answers like its conversations and from what its base run read; it states
falsehoods as fluently as facts, and it reproduces the biases of both data sets.
"""
        write_text_atomic(run / "MODEL_CARD.md", card)
