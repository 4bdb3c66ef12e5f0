"""Instruction tuning (J&M ch. 12): a base model fine-tuned on conversations.

`ChatWindows` is the `Trainer`'s batch source for a `ChatData` folder (`tlm prepare --task
chat`). Conversations are packed whole into windows of T positions, best fit first, largest
first (`pack`): a conversation of n tokens takes n - 1 positions (its inputs; the targets are
the same tokens one ahead), and padding fills what is left. In a window, a conversation
attends only to itself and its positions count from 0 (`TransformerLM(documents=...)`), so
it is learned exactly as if it were alone. One longer than the window is cut after the last
assistant turn that fits whole (a user turn after it would teach nothing) or, when even the
first assistant turn does not fit, dropped; both are counted.

The loss is the mean cross-entropy over the supervised targets only (the chat mask's 1s: the
assistant's content and its `<|end|>`), normalised by the supervised targets of the whole
step (every micro-batch and every process), not per micro-batch: a window with more
answer tokens weighs more, as it should. A step with no supervised target makes no update
and is counted (its loss reads 0), never a NaN. Windows come in a new order each pass over
the data (seed, pass), so a resumed run sees the batches an uninterrupted one would.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from tlm.chat import END
from tlm.config import ModelConfig, TrainConfig
from tlm.data.tokens import ChatData
from tlm.io import write_text_atomic
from tlm.model.loss import IGNORE
from tlm.tokenizer import load_tokenizer
from tlm.train.run import RunError

if TYPE_CHECKING:
    from tlm.train.loop import Trainer

VAL_BATCH = 32  # validation windows per forward pass


@dataclass
class Packed:
    """A split's conversations in windows of T positions: each window's conversations as
    (first token in the split, tokens kept), the learned targets of each window, and the
    counts of what packing did. `batch` builds the tensors of some windows, when asked: a
    split of any size costs memory for its conversations' places, not for its windows."""

    tokens: np.ndarray  # the split's ids (memory-mapped)
    mask: np.ndarray  # and its loss mask
    windows: list[list[tuple[int, int]]]
    supervised: np.ndarray  # [W]: the learned targets of each window
    T: int
    pad_id: int
    conversations: int  # packed, whole or cut
    cut: int  # cut after their last whole assistant turn that fits
    dropped: int  # whose first assistant turn does not fit
    padding: float  # the share of window positions that are padding

    def __len__(self) -> int:
        return len(self.windows)

    def batch(self, rows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Windows `rows` as inputs [B,T], targets [B,T] (IGNORE where nothing is learned,
        padding included) and documents [B,T] (a conversation's number within its window;
        -1 on padding)."""
        B, T = len(rows), self.T
        inputs = torch.full((B, T), self.pad_id, dtype=torch.long)
        targets = torch.full((B, T), IGNORE, dtype=torch.long)
        documents = torch.full((B, T), -1, dtype=torch.long)
        for r, w in enumerate(rows):
            at = 0
            for number, (first, n) in enumerate(self.windows[w]):
                ids = torch.from_numpy(self.tokens[first : first + n].astype(np.int64))
                learned = torch.from_numpy(self.mask[first + 1 : first + n].astype(bool))
                inputs[r, at : at + n - 1] = ids[:-1]  # n tokens: n - 1 inputs and targets
                targets[r, at : at + n - 1] = torch.where(learned, ids[1:], IGNORE)
                documents[r, at : at + n - 1] = number
                at += n - 1
        return inputs, targets, documents


def fitted(ids: np.ndarray, mask: np.ndarray, T: int, end_id: int) -> int:
    """How many tokens of a conversation go into a window of T positions: all n if
    n - 1 <= T, else up to the last assistant `<|end|>` (a learned one) within the first
    T + 1 tokens, else 0 (dropped)."""
    if len(ids) - 1 <= T:
        return len(ids)
    head_ids, head_mask = ids[: T + 1], mask[: T + 1]
    ends = np.flatnonzero((head_ids == end_id) & (head_mask == 1))
    return int(ends[-1]) + 1 if len(ends) else 0


def best_fit(lengths: list[int], T: int) -> list[list[int]]:
    """Indices of `lengths` in bins of total at most T: largest first, each into the bin it
    fills most tightly (best-fit decreasing), a new bin when none has room."""
    bins: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (space left, bin), sorted
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        k = bisect.bisect_left(room, (lengths[i], -1))
        if k == len(room):
            bins.append([i])
            bisect.insort(room, (T - lengths[i], len(bins) - 1))
        else:
            left, b = room.pop(k)
            bins[b].append(i)
            bisect.insort(room, (left - lengths[i], b))
    return bins


def pack(data: ChatData, split: str, T: int, end_id: int, pad_id: int) -> Packed:
    """The conversations of `split` packed into windows of T positions."""
    tokens, mask, offsets = data.split(split), data.mask(split), data.offsets(split)
    pieces, learned, cut, dropped = [], [], 0, 0  # (first token, tokens kept) of each kept
    for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True):
        n = fitted(tokens[a:b], mask[a:b], T, end_id)
        cut, dropped = cut + (0 < n < b - a), dropped + (n == 0)
        if n > 1:
            pieces.append((a, n))
            learned.append(int(mask[a + 1 : a + n].sum(dtype=np.int64)))  # its targets' mask
    bins = best_fit([n - 1 for _, n in pieces], T)
    windows = [[pieces[i] for i in members] for members in bins]
    supervised = np.array([sum(learned[i] for i in members) for members in bins], dtype=np.int64)
    used = sum(n - 1 for _, n in pieces)
    padding = 1 - used / max(1, len(bins) * T)
    return Packed(tokens, mask, windows, supervised, T, pad_id, len(pieces), cut, dropped, padding)


def supervised_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The SUM of -log p(target) over the supervised targets (targets != IGNORE)."""
    V = logits.shape[-1]
    flat = logits.reshape(-1, V).float()
    return F.cross_entropy(flat, targets.reshape(-1), ignore_index=IGNORE, reduction="sum")


class ChatWindows:
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
        self._order: tuple[int, np.ndarray] | None = None  # (pass, its window order)

    def summary(self) -> str:
        """What packing did, in one line (`tlm train` prints it)."""
        p = self.train
        return (
            f"chat: {p.conversations:,} conversations in {len(p):,} windows of "
            f"{self.T} ({p.cut:,} cut after their last whole answer that fits, {p.dropped:,} "
            f"dropped), padding {p.padding:.1%}"
        )

    def step_windows(self, step: int) -> np.ndarray:
        """The window indices of step `step`'s global batch: pass e over the windows has
        its own order (seed, e), so any step is found again after a resume."""
        W = len(self.train)
        first = step * self.global_batch
        picked = []
        for k in range(first, first + self.global_batch):
            e = k // W
            if self._order is None or self._order[0] != e:
                generator = np.random.default_rng([self.config.seed, e])
                self._order = (e, generator.permutation(W))
            picked.append(self._order[1][k % W])
        return np.asarray(picked)

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
            x, y, d = (t.to(trainer.device) for t in self.train.batch(micro))
            with rt.sync(trainer.wrapped, last=i == len(micros) - 1):
                with trainer.autocast():
                    loss = supervised_loss(trainer.forward(x, documents=d), y)
                # DDP averages the ranks' gradients: each rank's share times world_size
                (loss * rt.world_size / supervised).backward()
            total += loss.item() * rt.world_size / supervised
        return rt.all_reduce_mean(total)

    @torch.no_grad()
    def validation_loss(self, trainer: Trainer) -> float | None:
        """The mean loss per supervised target of the validation windows; under torchrun
        rank r scores batches r, r + K, ... (every rank as many forward passes)."""
        rt, W = trainer.runtime, len(self.val)
        if W == 0:
            return None
        batches = [range(i, min(i + VAL_BATCH, W)) for i in range(0, W, VAL_BATCH)]
        rounds = -(-len(batches) // rt.world_size)
        total = count = 0.0
        with trainer.autocast():
            for i in range(rt.rank, rounds * rt.world_size, rt.world_size):
                mine = i < len(batches)
                rows = list(batches[i if mine else 0])
                x, y, d = (t.to(trainer.device) for t in self.val.batch(rows))
                loss = supervised_loss(trainer.forward(x, documents=d), y)
                if mine:
                    total, count = total + loss.item(), count + int((y != IGNORE).sum())
        return rt.all_reduce_mean(total) / max(rt.all_reduce_mean(count), 1e-9)

    def write_card(self, trainer: Trainer, results: dict[str, Any]) -> None:
        """MODEL_CARD.md: the base run, the conversations and their counts, the results."""
        meta, p, run = self.data.meta, self.train, trainer.run
        train, val = meta["splits"]["train"], meta["splits"]["val"]
        sources = ", ".join(
            f"`{s['name']}` (sha256 `{s['sha256'][:12]}…`)" for s in meta["sources"]
        )
        loss = results.get("val_loss")
        settings = {"model": trainer.model_config.to_dict(), "train": self.config.to_dict()}
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

## Model and training

{trainer.model.num_parameters():,} parameters. Precision: {results.get("precision")}.

```json
{json.dumps(settings, indent=2)}
```

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
