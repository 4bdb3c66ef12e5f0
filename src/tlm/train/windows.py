"""What a language model trains on: windows of one token stream (J&M §10.9).

A batch source gives the `Trainer` each step's loss (its forward and backward passes), the
validation loss and the model card; `translate.PairBatches` is the other source. Here the
step's global batch of windows (`step_starts`) is the same on any number of processes:
each rank takes its slice and runs it in micro-batches of at most --batch-size windows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from tlm.config import ModelConfig, TrainConfig
from tlm.data import TokenData, document_starts, eval_windows, step_starts, windows_at
from tlm.model.loss import cross_entropy, window_nll
from tlm.train.loop import Batches
from tlm.train.report import write_model_card

if TYPE_CHECKING:
    from tlm.train.loop import Trainer

VAL_BATCH = 32  # validation windows per forward pass (and per rank's share of the split)


class TokenWindows(Batches):
    """The training split's windows and the validation windows of a `TokenData` folder."""

    def __init__(
        self, data: TokenData, model_config: ModelConfig, config: TrainConfig, world_size: int
    ) -> None:
        self.data, self.T, self.config = data, model_config.context_length, config
        self.global_batch = config.batch_size * config.grad_accum  # windows a step, all ranks
        self.share = self.global_batch // world_size  # a rank's windows
        self.tokens_per_step = self.global_batch * self.T  # all ranks'
        self.train_tokens = data.split("train")  # memory-mapped once
        self.choices = None  # where windows may start: anywhere, or at documents' starts
        if config.windows == "documents":
            self.choices = document_starts(self.train_tokens, data.meta["eot_id"], self.T)
        self.val_batches = self._val_batches()

    def _val_batches(self) -> list[torch.Tensor]:
        """The validation windows in batches of VAL_BATCH, the unit a rank scores: the first
        `eval_tokens` targets of the split, or every one with `eval_tokens` 0."""
        val = self.data.split("val")
        if len(val) < 2:
            return []
        limit = self.config.eval_tokens or None  # None: eval_windows takes the whole split
        chunks = eval_windows(val, self.T, limit)
        return [w[i : i + VAL_BATCH] for w in chunks for i in range(0, len(w), VAL_BATCH)]

    def step_loss(self, trainer: Trainer, step: int) -> float:
        """The backward passes of step `step`; returns its mean loss over every rank.

        Each micro-batch's mean loss is weighted by its share of the rank's slice, and DDP
        averages the ranks' gradients: the gradient of the global batch's mean loss.
        """
        c, rt = self.config, trainer.runtime
        starts = step_starts(
            len(self.train_tokens), self.T, c.seed, step, c.batch_size, c.grad_accum, self.choices
        )
        mine = starts[rt.rank * self.share : (rt.rank + 1) * self.share]
        micros = [mine[i : i + c.batch_size] for i in range(0, self.share, c.batch_size)]
        total = 0.0
        for i, micro in enumerate(micros):
            x, y = windows_at(self.train_tokens, micro, self.T)
            with rt.sync(trainer.wrapped, last=i == len(micros) - 1):
                with trainer.autocast():
                    loss = cross_entropy(
                        trainer.forward(x.to(trainer.device)), y.to(trainer.device)
                    )
                (loss / (self.share / len(micro))).backward()
            total += loss.item() / (self.share / len(micro))
        return rt.all_reduce_mean(total)  # every rank judges one loss

    @torch.no_grad()
    def validation_loss(self, trainer: Trainer) -> float | None:
        """The mean loss of every validation target. Under torchrun rank r scores batches
        r, r + K, ... and the sums are all-reduced; a rank whose batches ran out scores the
        first again and drops it, so every rank runs as many forward passes (FSDP gathers
        each block's shards in step across the ranks)."""
        batches, rt = self.val_batches, trainer.runtime
        if not batches:
            return None
        rounds = -(-len(batches) // rt.world_size)  # forward passes on every rank
        total = count = 0.0
        with trainer.autocast():
            for i in range(rt.rank, rounds * rt.world_size, rt.world_size):
                mine = i < len(batches)
                nll = window_nll(trainer.forward, batches[i if mine else 0], VAL_BATCH)
                if mine:
                    total, count = total + nll.double().sum().item(), count + nll.numel()
        return rt.all_reduce_mean(total) / rt.all_reduce_mean(count)

    def write_card(self, trainer: Trainer, results: dict[str, Any]) -> None:
        meta = self.data.meta
        write_model_card(trainer.run, trainer.model_config, self.config, meta, results)
