"""Fine-tuning an encoder for a task (J&M §11.4): a classifier of whole inputs from [CLS],
or a tagger of each word, trained on labeled examples (`data/labeled.py`) from a pretrained
run (`--init-from`, whose MLM head gives way to the task's) or from random weights.

Each step takes `batch_size` examples, a new order each pass (`PassOrder`; with
`group_by_length`, the default, each step's examples of similar length, as transformers'
Trainer groups them), pads them to the longest with [PAD] (hidden by the attention mask),
and minimises the cross-entropy of the labels: one a sequence, or one a word at its first
token (other positions IGNORED).
Validation scores every held-out example: the loss, accuracy and F1 (a tagger's over BIO
chunks, as seqeval counts them), logged as `val_accuracy` and `val_f1`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from tlm.config import ModelConfig, TrainConfig
from tlm.data.labeled import LabeledData, encode_example
from tlm.evaluate import labeled_scores, padded, task_loss
from tlm.io import write_text_atomic
from tlm.tokenizer import Tokenizer
from tlm.train.loop import Batches
from tlm.train.order import PassOrder
from tlm.train.report import model_section

if TYPE_CHECKING:
    from tlm.train.loop import Trainer


class LabeledBatches(Batches):
    """The examples of a `LabeledData`, encoded once with the run's tokenizer."""

    def __init__(
        self,
        data: LabeledData,
        tokenizer: Tokenizer,
        model_config: ModelConfig,
        config: TrainConfig,
    ) -> None:
        self.data, self.config, self.pad = data, config, tokenizer.special_id("[PAD]")
        T = model_config.context_length

        def encode(part):
            return [encode_example(e, tokenizer, data.task, T) for e in part]

        self.train, self.val = encode(data.train), encode(data.val)
        self.cut = sum(e.cut for e in self.train + self.val)
        lengths = [len(e.ids) for e in self.train] if config.group_by_length else None
        self.order = PassOrder(len(self.train), config.batch_size, config.seed, lengths)
        self.tokens_per_step = 0
        self.last: dict[str, float] = {}

    def step_loss(self, trainer: Trainer, step: int) -> float:
        batch = [self.train[i] for i in self.order.step(step)]
        ids, segments, mask, labels = (t.to(trainer.device) for t in padded(batch, self.pad))
        self.tokens_per_step = int(mask.sum())
        with trainer.autocast():
            loss = task_loss(trainer.forward(ids, segments, mask), labels)
        loss.backward()
        return loss.item()

    @torch.no_grad()
    def validation_loss(self, trainer: Trainer) -> float | None:
        if not self.val:
            return None
        d, device = self.data, trainer.device
        scores = labeled_scores(trainer.model, self.val, d.task, d.labels, self.pad, device)
        loss = scores.pop("loss")
        self.last = scores
        return loss

    def logged(self, kind: str) -> dict[str, float]:
        return {f"val_{k}": v for k, v in self.last.items()} if kind == "val" else {}

    def write_card(self, trainer: Trainer, results: dict[str, Any]) -> None:
        """MODEL_CARD.md: the task, its labels and examples, the base run, the results."""
        d, c, run = self.data, self.config, trainer.run
        origin = f"from the weights of `{c.init_from}`"
        if c.reinit:
            origin = f"from random weights (the shape and tokenizer of `{c.init_from}`)"
        what = "each input as a whole, from [CLS]" if d.task == "classify" else "each word"
        loss = results.get("val_loss")
        figures = " | ".join(f"{k} {v:.3f}" for k, v in self.last.items()) or "n/a"
        card = f"""# Model card: `{run.name}`

A bidirectional transformer encoder (J&M ch. 11) with a {d.task} head, {origin}: it labels
{what} with one of {len(d.labels)} labels: {", ".join(f"`{name}`" for name in d.labels)}.

## Data

`{d.folder}`: {len(d.train):,} training examples, {len(d.val):,} held out; {self.cut:,} longer
than {trainer.model_config.context_length} tokens and cut.

{model_section(trainer, results)}

## Results

| | |
|---|---|
| steps | {results["step"]:,} |
| wall time | {results["elapsed"]:.1f} s |
| final train loss | {results["train_loss"]:.4f} |
| final validation loss | {"n/a" if loss is None else f"{loss:.4f}"} |
| validation | {figures} |

## How to use

```
tlm {"classify" if d.task == "classify" else "tag"} {run} "..."
tlm eval {run} --data {d.folder} --json
```

## Limits

It knows only the labels above and the examples it was shown; it reproduces their biases.
"""
        write_text_atomic(run / "MODEL_CARD.md", card)
