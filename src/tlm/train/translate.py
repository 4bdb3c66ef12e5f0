"""Training the encoder-decoder on sentence pairs (Vaswani et al. 2017 §5).

`PairBatches` is the `Trainer`'s batch source for sentence pairs (the language model's is
`windows.TokenWindows`): pairs of similar length, at most `batch_tokens` tokens a side
(padding included), `grad_accum` of them a step, in a new order each pass over the data
(`token_batches`). The decoder is fed
the target shifted right behind <|endoftext|> (teacher forcing) and learns the target
followed by <|endoftext|>; the loss is label-smoothed (`label_smoothing`). Checkpoints,
resume, metrics, plots and the model card are the `Trainer`'s. Pairs longer than the
context on either side are left out and counted. Validation reports the plain
cross-entropy per target token (no smoothing), so it reads as a log-perplexity.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from tlm.config import ModelConfig, TrainConfig
from tlm.data.pairs import token_batches
from tlm.data.tokens import PairData, Pairs
from tlm.io import write_text_atomic
from tlm.model.loss import IGNORE, label_smoothed_cross_entropy
from tlm.train.distributed import Runtime
from tlm.train.loop import Batches
from tlm.train.report import best_row, best_usage
from tlm.train.run import RunError

if TYPE_CHECKING:
    from tlm.train.loop import Trainer

Batch = tuple[Tensor, Tensor, Tensor, Tensor]  # source, source mask, decoder input, labels


def collate(pairs: Pairs, rows: np.ndarray, start_id: int) -> Batch:
    """Pairs `rows`, right-padded: source [B,S] and its mask (1 = token), decoder input
    [B,T] = <|endoftext|> + target[:-1], labels [B,T] = target (IGNORE on padding)."""
    sources = [pairs.sentence("src", i) for i in rows]
    targets = [pairs.sentence("tgt", i) for i in rows]
    B, S, T = len(rows), max(map(len, sources)), max(map(len, targets))
    src, mask = torch.zeros(B, S, dtype=torch.long), torch.zeros(B, S, dtype=torch.long)
    inputs, labels = torch.zeros(B, T, dtype=torch.long), torch.full((B, T), IGNORE)
    for b, (x, y) in enumerate(zip(sources, targets, strict=True)):
        src[b, : len(x)], mask[b, : len(x)] = torch.from_numpy(x.astype(np.int64)), 1
        y = torch.from_numpy(y.astype(np.int64))
        inputs[b, 0], inputs[b, 1 : len(y)] = start_id, y[:-1]
        labels[b, : len(y)] = y
    return src, mask, inputs, labels


def fitting(pairs: Pairs, context_length: int) -> np.ndarray:
    """Indices of the pairs whose sides both fit the context."""
    fits = (pairs.lengths("src") <= context_length) & (pairs.lengths("tgt") <= context_length)
    return np.flatnonzero(fits)


class PairBatches(Batches):
    """The pairs of a `PairData` folder, for an encoder-decoder, as a `Trainer`'s batches."""

    def __init__(
        self, data: PairData, model_config: ModelConfig, config: TrainConfig, rt: Runtime
    ) -> None:
        T = model_config.context_length
        if model_config.model_type != "encoder-decoder":
            raise RunError("sentence pairs train an encoder-decoder: --model-type encoder-decoder")
        if rt.distributed:
            raise RunError("translation runs train on one process (torchrun is for LM runs)")
        if config.batch_tokens is None:
            raise RunError("translation batches by token count: give --batch-tokens N (4096)")
        self.data, self.config, self.context_length = data, config, T
        self.start_id = data.meta["eot_id"]
        self.train_pairs = data.split("train")
        self.keep = fitting(self.train_pairs, T)
        self.skipped_long = len(self.train_pairs) - len(self.keep)
        if len(self.keep) == 0:
            raise RunError(f"no training pair fits the context of {T} tokens a side")
        lengths = (self.train_pairs.lengths("src"), self.train_pairs.lengths("tgt"))
        self.lengths = tuple(x[self.keep] for x in lengths)
        self.epoch, self.epoch_batches, self.epoch_start = -1, [], 0  # micro-batches so far
        val = data.split("val")
        rows = fitting(val, T)
        order = token_batches(
            val.lengths("src")[rows], val.lengths("tgt")[rows], config.batch_tokens
        )
        self.val_batches = [collate(val, rows[b], self.start_id) for b in order]
        self.tokens_per_step = 0  # target tokens of the last step

    def _micro_batch(self, m: int) -> np.ndarray:
        """Pair indices of micro-batch `m` of the run: pass e over the data has its own
        order (seed + e), so any step is found again after a resume."""
        if m < self.epoch_start:  # (a resume goes forward only; start over if asked back)
            self.epoch, self.epoch_batches, self.epoch_start = -1, [], 0
        while m >= self.epoch_start + len(self.epoch_batches):
            self.epoch_start += len(self.epoch_batches)
            self.epoch += 1
            seed = self.config.seed * 1000 + self.epoch
            self.epoch_batches = token_batches(*self.lengths, self.config.batch_tokens, seed)
        return self.keep[self.epoch_batches[m - self.epoch_start]]

    def step_loss(self, trainer: Trainer, step: int) -> float:
        """The step's `grad_accum` batches, each loss weighted by its share of the step's
        target tokens; returns the step's mean label-smoothed loss."""
        c = self.config
        batches = [
            collate(self.train_pairs, self._micro_batch(step * c.grad_accum + j), self.start_id)
            for j in range(c.grad_accum)
        ]
        counts = [int((labels != IGNORE).sum()) for *_, labels in batches]
        total, loss_sum = sum(counts), 0.0
        for (src, mask, inputs, labels), n in zip(batches, counts, strict=True):
            src, mask, inputs, labels = (t.to(trainer.device) for t in (src, mask, inputs, labels))
            with trainer.autocast():
                logits = trainer.forward(src, inputs, mask)
                loss = label_smoothed_cross_entropy(logits, labels, c.label_smoothing)
            (loss * n / total).backward()  # the step's mean over its target tokens
            loss_sum += loss.item() * n / total
        self.tokens_per_step = total
        return loss_sum

    @torch.no_grad()
    def validation_loss(self, trainer: Trainer) -> float | None:
        """Cross-entropy per target token of the validation pairs (no smoothing)."""
        if not self.val_batches:
            return None
        total, count, device = 0.0, 0, trainer.device
        with trainer.autocast():
            for src, mask, inputs, labels in self.val_batches:
                logits = trainer.model(src.to(device), inputs.to(device), mask.to(device))
                labels = labels.to(device)
                n = int((labels != IGNORE).sum())
                total += label_smoothed_cross_entropy(logits, labels, 0.0).item() * n
                count += n
        return total / count

    def write_card(self, trainer: Trainer, results: dict[str, Any]) -> None:
        run = trainer.run
        meta, splits = self.data.meta, self.data.meta["splits"]
        val = results.get("val_loss")
        best = best_row(results, "nats/target token")
        card = f"""# Model card: `{run.name}`

An encoder-decoder transformer (Vaswani et al. 2017) trained with tlm to translate: the
source sentence in, the target sentence out, one shared {meta["vocab_size"]}-token BPE.

## Data

{", ".join(f"`{s['name']}`" for s in meta["sources"])}: {splits["train"]["pairs"]:,} training
pairs ({splits["train"]["skipped_empty"]:,} skipped for an empty side, {self.skipped_long:,}
left out as longer than {self.context_length} tokens), {splits["val"]["pairs"]:,}
validation pairs.

## Model and training

{trainer.model.num_parameters():,} parameters.

```json
{json.dumps({"model": trainer.model_config.to_dict(), "train": self.config.to_dict()}, indent=2)}
```

## Results

| | |
|---|---|
| steps | {results["step"]:,} |
| target tokens seen | {results["tokens"]:,} |
| wall time | {results["elapsed"]:.1f} s |
| final train loss (label-smoothed, nats/token) | {results["train_loss"]:.4f} |
| final validation loss (nats/target token) | {"n/a" if val is None else f"{val:.4f}"} |{best}

## How to use

```
tlm translate {run} "A man rides a bike."
tlm eval {run} --task translate{best_usage(f"tlm translate {run}", results)}
```

## Limits

It translates sentences like its training pairs (short image captions for Multi30k) and
nothing else well; it can drop, repeat or invent content, and it reproduces the biases of
its data.
"""
        write_text_atomic(run / "MODEL_CARD.md", card)
