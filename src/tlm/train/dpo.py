"""Aligning a chat run with preference pairs (J&M ch. 12): direct preference optimization.

`PreferencePairs` is the `Trainer`'s batch source for a `PreferenceData` folder (`tlm
prepare --task preference`) under `--objective dpo`. The policy starts as the `--init-from`
run, which is also the reference π_ref the loss pulls it towards (`model/loss.py:
dpo_loss`). The reference never changes, so its log-probabilities of every pair are
computed once, when the run opens, with the run's first weights, and kept in
RUN/reference.safetensors (a resumed run reads them back): a pair is then scored by the
reference once, however many passes training makes over it, and no second model is held
in memory while training. A step's loss is the mean of the per-pair losses over the pairs
of the whole step (every micro-batch and process). Logged beside the loss: the implicit
rewards r = β (log π - log π_ref) of the chosen and the rejected answers, their margin and
accuracy (the share of pairs whose chosen answer has the higher reward), on the training
steps and on the validation pairs.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file

from tlm.chat import END
from tlm.config import ModelConfig, TrainConfig
from tlm.data.answer_pairs import answer_pairs
from tlm.data.tokens import PreferenceData
from tlm.io import atomic_path, write_text_atomic
from tlm.model.loss import chosen_nll, dpo_loss, sequence_logprobs
from tlm.tokenizer import load_tokenizer
from tlm.train.loop import Batches
from tlm.train.order import PassOrder
from tlm.train.report import model_section
from tlm.train.run import RunError

if TYPE_CHECKING:
    from tlm.train.loop import Trainer

REFERENCE = "reference.safetensors"  # the reference's log-probabilities, [pairs, 2] a split
VAL_BATCH = 16  # pairs a validation forward pass


class PreferencePairs(Batches):
    """The pairs of a `PreferenceData` folder as a `Trainer`'s batches (`batch_size` pairs
    a micro-batch)."""

    def __init__(
        self, data: PreferenceData, model_config: ModelConfig, config: TrainConfig, world_size: int
    ) -> None:
        self.data, self.config, self.T = data, config, model_config.context_length
        tokenizer = load_tokenizer(data.folder)
        if tokenizer.special_id(END) is None:
            raise RunError(f"{data.folder}'s tokenizer has no chat template; prepare it again")
        self.train = answer_pairs(data, "train", self.T, tokenizer.eot_id)
        self.val = answer_pairs(data, "val", self.T, tokenizer.eot_id)
        if len(self.train) == 0:
            raise RunError(f"no training pair has both answers within {self.T} tokens")
        self.global_batch = config.batch_size * config.grad_accum  # pairs a step, all ranks
        self.share = self.global_batch // world_size
        self.order = PassOrder(len(self.train), self.global_batch, config.seed)
        self.tokens_per_step = 0  # the last step's tokens, padding included
        self.reference: dict[str, torch.Tensor] = {}
        self._seen: dict[str, list[float]] = {}  # train figures since the last log line
        self._val: dict[str, float] = {}

    def summary(self) -> str:
        return (
            f"dpo: {len(self.train):,} training pairs ({self.train.dropped:,} dropped: an answer "
            f"past {self.T} tokens), {len(self.val):,} held out; beta {self.config.beta}, "
            f"loss {self.config.dpo_loss}"
        )

    def hold_reference(
        self, model: torch.nn.Module, run: Path, resume: bool, precision: torch.dtype, main: bool
    ) -> None:
        """The reference's log-probabilities of every pair: read back from the run on a
        resume, else computed with `model` as it is now (the init run's weights, on its
        device, in the training `precision`) and written by the `main` process."""
        path = run / REFERENCE
        if resume:
            if not path.is_file():
                raise RunError(f"{path} is missing: this run's reference is lost")
            self.reference = load_file(str(path))
            return
        device, was_training = next(model.parameters()).device, model.training
        model.eval()
        autocast = torch.autocast(device.type, dtype=precision, enabled=precision != torch.float32)
        with torch.no_grad(), autocast:
            for split, pairs in (("train", self.train), ("val", self.val)):
                self.reference[split] = pair_logprobs(model, pairs, device)
        model.train(was_training)
        if main:
            with atomic_path(path) as tmp:
                save_file(self.reference, str(tmp))

    def step_loss(self, trainer: Trainer, step: int) -> float:
        """The backward passes of step `step`; returns its mean loss per pair over every
        process."""
        c, rt = self.config, trainer.runtime
        pairs = self.order.step(step)
        mine = pairs[rt.rank * self.share : (rt.rank + 1) * self.share]
        micros = [mine[i : i + c.batch_size] for i in range(0, self.share, c.batch_size)]
        batches = [self.train.batch(micro) for micro in micros]
        if c.sft_weight:  # the NLL is a mean over the chosen tokens of the whole step
            here = sum(float(b[2][: len(m)].sum()) for b, m in zip(batches, micros, strict=True))
            chosen_tokens = rt.all_reduce_mean(here) * rt.world_size
        total, chosen, rejected, tokens = 0.0, [], [], 0
        for i, (micro, batch) in enumerate(zip(micros, batches, strict=True)):
            x, y, learned = (t.to(trainer.device) for t in batch)
            reference = self.reference["train"][torch.from_numpy(micro)].to(trainer.device)
            with rt.sync(trainer.wrapped, last=i == len(micros) - 1):
                with trainer.autocast():
                    logits = trainer.forward(x)
                loss, r_w, r_l, logp_w = self._loss(logits, y, learned, reference)
                loss = loss.sum() * rt.world_size / self.global_batch
                if c.sft_weight:
                    loss = loss + c.sft_weight * chosen_nll(logp_w, chosen_tokens) * rt.world_size
                loss.backward()
            total += loss.item()
            chosen.append(r_w)
            rejected.append(r_l)
            tokens += x.numel() * rt.world_size
        self.tokens_per_step = tokens
        self._remember(torch.cat(chosen), torch.cat(rejected))
        return rt.all_reduce_mean(total)

    def _loss(self, logits, y, learned, reference) -> tuple[torch.Tensor, ...]:
        """Per-pair loss and rewards of a batch's logits [2B,L,V] (chosen rows first), and
        the chosen answers' log-probabilities [B]."""
        B = len(reference)
        logp = sequence_logprobs(logits, y, learned)
        lengths = learned.sum(dim=1)
        c = self.config
        loss, r_w, r_l = dpo_loss(
            logp[:B], logp[B:], reference[:, 0], reference[:, 1], c.beta, c.dpo_loss,
            c.label_smoothing, (lengths[:B], lengths[B:]),
        )  # fmt: skip
        return loss, r_w, r_l, logp[:B]

    def _remember(self, chosen: torch.Tensor, rejected: torch.Tensor) -> None:
        figures = _figures(chosen, rejected)
        for name, value in figures.items():
            self._seen.setdefault(name, []).append(value)

    @torch.no_grad()
    def validation_loss(self, trainer: Trainer) -> float | None:
        """The mean DPO loss of the validation pairs (every process scores them all), with
        the rewards' figures kept for the log."""
        if len(self.val) == 0:
            return None
        losses, chosen, rejected = [], [], []
        for first in range(0, len(self.val), VAL_BATCH):
            rows = list(range(first, min(first + VAL_BATCH, len(self.val))))
            x, y, learned = (t.to(trainer.device) for t in self.val.batch(rows))
            reference = self.reference["val"][rows].to(trainer.device)
            with trainer.autocast():
                logits = trainer.forward(x)
            loss, r_w, r_l, _ = self._loss(logits, y, learned, reference)
            losses.append(loss)
            chosen.append(r_w)
            rejected.append(r_l)
        self._val = _figures(torch.cat(chosen), torch.cat(rejected))
        return float(torch.cat(losses).mean())

    def logged(self, kind: str) -> dict[str, float]:
        """The rewards' figures to log beside the loss: of the training steps since the last
        log line (`kind` "train"), or of the last validation ("val", named val_*)."""
        if kind == "val":
            return {f"val_{name}": value for name, value in self._val.items()}
        seen, self._seen = self._seen, {}
        return {name: sum(values) / len(values) for name, values in seen.items()}

    def write_card(self, trainer: Trainer, results: dict[str, Any]) -> None:
        """MODEL_CARD.md: the reference, the pairs, the objective and the results."""
        meta, run, c = self.data.meta, trainer.run, self.config
        train, val = meta["splits"]["train"], meta["splits"]["val"]
        sources = ", ".join(
            f"`{s['name']}` (sha256 `{s['sha256'][:12]}…`)" for s in meta["sources"]
        )
        loss = results.get("val_loss")
        figures = " ".join(f"{k} {v:.4f}" for k, v in self._val.items()) or "none"
        epsilon = f", epsilon {c.label_smoothing}" if c.dpo_loss == "cdpo" else ""
        epsilon += f", sft weight {c.sft_weight} (RPO)" if c.sft_weight else ""
        card = f"""# Model card: `{run.name}`

An assistant aligned with preference pairs by direct preference optimization (Rafailov et
al. 2023; J&M ch. 12), from the run `{c.init_from}`, which is also its reference π_ref.
It answers in turns of tlm's chat template and ends each answer with `<|end|>`.

## Objective

dpo, loss `{c.dpo_loss}`, beta {c.beta}{epsilon};
reference: `{c.init_from}` (its log-probabilities of every pair in `{REFERENCE}`).

## Data

{sources}, prepared in `{self.data.folder}`: {train["pairs"]:,} training pairs
({len(self.train):,} within {self.T} tokens, {self.train.dropped:,} dropped),
{val["pairs"]:,} held out.

{model_section(trainer, results)}

## Results

| | |
|---|---|
| steps | {results["step"]:,} |
| wall time | {results["elapsed"]:.1f} s |
| final train loss (per pair) | {results["train_loss"]:.4f} |
| final validation loss (per pair) | {"n/a" if loss is None else f"{loss:.4f}"} |
| validation rewards | {figures} |

## How to use

```
tlm chat {run}
tlm eval --task preference {run} --data {self.data.folder}
```

## Limits

Preferences move a model towards the answers its pairs preferred and away from the others;
it learns what they reward, including their mistakes and biases.
"""
        write_text_atomic(run / "MODEL_CARD.md", card)


def _figures(chosen: torch.Tensor, rejected: torch.Tensor) -> dict[str, float]:
    """The implicit rewards' means, margin and accuracy over pairs."""
    return {
        "reward_chosen": float(chosen.mean()),
        "reward_rejected": float(rejected.mean()),
        "reward_margin": float((chosen - rejected).mean()),
        "reward_accuracy": float((chosen > rejected).float().mean()),
    }


def pair_logprobs(model: torch.nn.Module, pairs, device: torch.device) -> torch.Tensor:
    """log π(y | x) of each pair's chosen and rejected answer -> [P, 2] fp32."""
    out = torch.zeros(len(pairs), 2)
    for first in range(0, len(pairs), VAL_BATCH):
        rows = list(range(first, min(first + VAL_BATCH, len(pairs))))
        x, y, learned = (t.to(device) for t in pairs.batch(rows))
        logp = sequence_logprobs(model(x), y, learned).float().cpu()
        out[rows] = logp.view(2, -1).t()
    return out
