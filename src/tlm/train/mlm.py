"""Masked language modeling (J&M §11.2.1; Devlin et al. 2019): what a bidirectional encoder
pretrains on, windows of one token stream with some of their tokens hidden.

Each window of N - 2 tokens is read as `[CLS] w_1 ... w_{N-2} [SEP]` (a document's end
inside it, <|endoftext|>, becomes [SEP]). A fraction `mask_rate` of its tokens is selected
(never [CLS] or [SEP]); of the selected, 80% are replaced by [MASK], 10% by a random token
and 10% left as they are, so that the model cannot learn that only [MASK] needs predicting.
The loss is the cross-entropy of the original tokens at the selected positions only:

    L_MLM = -1/|M| Σ_{i ∈ M} log P(x_i | x̃)          M the selected positions, x̃ the input

and the head runs on those positions alone (the others' logits would be thrown away).
Validation masks its windows once, with a fixed seed, so each evaluation scores the same
positions: the loss and the share of them predicted exactly (masked-token accuracy).

With next-sentence prediction (a model with `nsp`, §11.2.2) each window of N - 3 tokens is
cut at a random point into A and B, read as `[CLS] A [SEP] B [SEP]` (segments 0 to the
first [SEP], then 1); half of the Bs are replaced by as many tokens from a random place of
the stream (NotNext: BERT's segment pairs, not sentences), and the loss adds the NSP head's

    L_NSP = -1/B Σ_b log P(y_b | h_CLS)                 y_b: IsNext (0) or NotNext (1)

to L_MLM, as BERT sums them. It is off by default: RoBERTa (Liu et al. 2019, §4.2) found
that leaving NSP out matches or improves what the encoder is fine-tuned to do, and it
spends a position a window and a head on a task no one fine-tunes for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from tlm.config import ModelConfig, TrainConfig
from tlm.data import TokenData, step_starts
from tlm.io import write_text_atomic
from tlm.tokenizer import Tokenizer, encoder_tokenizer, load_tokenizer
from tlm.train.loop import Batches
from tlm.train.report import model_section

if TYPE_CHECKING:
    from tlm.train.loop import Trainer

VAL_BATCH = 32  # validation windows per forward pass


class Specials:
    """The ids an encoder's inputs use, which tokens are text (every token but the special
    ones: <|endoftext|>, [CLS], ...), and which continue a word (for whole-word masking): a
    token continues the word before it when its first byte and the previous token's last
    byte is a word character (letters, digits, `_`, any non-ASCII byte) and the previous
    token's last byte one too, or whitespace: a word is its tokens with the space before it,
    as a byte-level tokenizer writes " word" (or a lone " " and then "word")."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.cls, self.sep, self.mask = (
            tokenizer.special_id(n) for n in ("[CLS]", "[SEP]", "[MASK]")
        )
        self.eot, self.vocab_size = tokenizer.eot_id, tokenizer.vocab_size
        self.text = torch.from_numpy(tokenizer.token_bytes() > 0)  # [V] bool: specials write none
        self.text_ids = self.text.nonzero()[:, 0]  # what a random replacement draws from
        pieces = tokenizer.pieces()
        self.first_word = torch.tensor([_word_byte(p[:1]) for p in pieces]) & self.text  # [V]
        joins = [_word_byte(p[-1:]) or p[-1:].isspace() for p in pieces]
        self.last_word = torch.tensor(joins) & self.text  # [V]: the next word token continues

    def wrap(self, windows: Tensor) -> Tensor:
        """[B,N-2] token windows -> [B,N]: [CLS] window [SEP], each <|endoftext|> a [SEP]."""
        inner = windows.masked_fill(windows == self.eot, self.sep)
        B = windows.shape[0]
        return torch.cat(
            [inner.new_full((B, 1), self.cls), inner, inner.new_full((B, 1), self.sep)], 1
        )

    def word_starts(self, ids: Tensor) -> Tensor:
        """[B,T] -> bool [B,T]: True where a word begins (every special token is one)."""
        starts = torch.ones_like(ids, dtype=torch.bool)
        starts[:, 1:] = ~(self.first_word[ids[:, 1:]] & self.last_word[ids[:, :-1]])
        return starts


def _word_byte(piece: bytes) -> bool:
    return bool(piece) and (piece.isalnum() or piece == b"_" or piece[0] >= 0x80)


def mask_tokens(
    ids: Tensor, specials: Specials, rate: float, generator: torch.Generator, whole_word: bool
) -> tuple[Tensor, Tensor]:
    """ids [B,T] (wrapped windows) -> (inputs [B,T], selected bool [B,T]).

    Each text position is selected with probability `rate` (with `whole_word`, each word's
    draw decides all its tokens); a row left with none selects one of its text positions, so
    that every window is scored. The selected become [MASK] (80%), a random text token (10%)
    or stay (10%)."""
    B, T = ids.shape
    text = specials.text[ids]  # [B,T]: [CLS], [SEP] and [PAD] are never selected
    draw = torch.rand(B, T, generator=generator)
    if whole_word:  # each position takes the draw of its word's first token
        starts = specials.word_starts(ids)
        first = torch.where(starts, torch.arange(T).expand(B, T), 0).cummax(1).values  # [B,T]
        draw = draw.gather(1, first)
    selected = text & (draw < rate)
    empty = ~selected.any(1) & text.any(1)  # rows with text but nothing selected
    if empty.any():
        pick = torch.rand(B, T, generator=generator).masked_fill(~text, -1.0).argmax(1)
        selected[empty, pick[empty]] = True
    kind = torch.rand(B, T, generator=generator)  # 80 / 10 / 10
    choices = specials.text_ids
    random = choices[torch.randint(0, len(choices), (B, T), generator=generator)]
    inputs = torch.where(selected & (kind < 0.8), specials.mask, ids)
    inputs = torch.where(selected & (kind >= 0.8) & (kind < 0.9), random, inputs)
    return inputs, selected


def sentence_pairs(
    tokens: np.ndarray, starts: np.ndarray, length: int, specials: Specials, generator
) -> tuple[Tensor, Tensor, Tensor]:
    """NSP's inputs: from each start, `length` tokens cut at a random point into A and B,
    half of the Bs (drawn) taken instead from a random place of `tokens` -> (ids [n,N]
    `[CLS] A [SEP] B [SEP]` with N = length + 3, segments [n,N], not_next bool [n]: the
    NSP head's class, 0 IsNext, 1 NotNext, as BERT's next_sentence_label)."""
    n, j = len(starts), torch.arange(length)
    cut = torch.randint(1, length, (n, 1), generator=generator)  # A's tokens: 1 .. length-1
    not_next = torch.rand(n, generator=generator) < 0.5
    elsewhere = torch.randint(0, len(tokens) - length, (n, 1), generator=generator)
    here = torch.from_numpy(np.asarray(starts, dtype=np.int64))[:, None] + j  # [n,length]
    take = torch.where((j >= cut) & not_next[:, None], elsewhere + j - cut, here)
    inner = torch.from_numpy(tokens[take.numpy()].astype(np.int64))
    inner = inner.masked_fill(inner == specials.eot, specials.sep)
    p = torch.arange(length + 3)  # p: [CLS] at 0, A at 1..cut, [SEP] at cut+1, B, [SEP]
    ids = inner.gather(1, torch.where(p <= cut, p - 1, p - 2).clamp(0, length - 1))
    ids[:, 0], ids[:, -1] = specials.cls, specials.sep
    ids = ids.masked_fill(p == cut + 1, specials.sep)
    return ids, (p > cut + 1).long(), not_next


def pretraining_loss(
    model, inputs: Tensor, targets: Tensor, selected: Tensor, segments=None, not_next=None
) -> Tensor:
    """L_MLM, plus L_NSP where `not_next` is given (then the inputs are sentence pairs)."""
    if not_next is None:
        return mlm_loss(model, inputs, targets, selected)
    logits, nsp = model(inputs, segments, only=selected, next_sentence=True)
    return F.cross_entropy(logits.float(), targets[selected]) + F.cross_entropy(
        nsp.float(), not_next.long()
    )


def mlm_loss(model, inputs: Tensor, targets: Tensor, selected: Tensor) -> Tensor:
    """L_MLM: the mean cross-entropy of `targets` at the `selected` positions of `inputs`,
    the head run on those positions only (`mlm_loss_reference` scores every position's
    logits and keeps the selected: the same number)."""
    logits = model(inputs, only=selected)  # [M,V]
    return F.cross_entropy(logits.float(), targets[selected])


def mlm_loss_reference(model, inputs: Tensor, targets: Tensor, selected: Tensor) -> Tensor:
    """L_MLM from the whole [B,T,V] logits, as BERT's reference implementation computes it."""
    logits = model(inputs)  # [B,T,V]
    nll = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")
    return nll[selected.flatten()].mean()


class MaskedWindows(Batches):
    """The training windows of a `TokenData` folder, masked afresh each step (from the
    generator of seed and step, so a resumed run masks as the first would have), and its
    validation windows, masked once."""

    def __init__(
        self, data: TokenData, model_config: ModelConfig, config: TrainConfig, world_size: int
    ) -> None:
        self.data, self.config, self.nsp = data, config, model_config.nsp
        self.inner = model_config.context_length - 2 - self.nsp  # [CLS] [SEP] (A [SEP] B)
        self.specials = Specials(encoder_tokenizer(load_tokenizer(data.folder)))
        self.global_batch = config.batch_size * config.grad_accum
        self.share = self.global_batch // world_size
        self.tokens_per_step = self.global_batch * model_config.context_length
        self.train_tokens = data.split("train")
        self.val = self._val_windows()
        self.val_scores: dict[str, float] = {}

    def windows(self, tokens: np.ndarray, starts: np.ndarray, generator) -> tuple:
        """(inputs, targets, selected, segments, not_next) of the windows at `starts`,
        masked (segments and not_next None without NSP)."""
        if self.nsp:
            targets, segments, not_next = sentence_pairs(
                tokens, starts, self.inner, self.specials, generator
            )
        else:
            index = np.asarray(starts)[:, None] + np.arange(self.inner)
            targets = self.specials.wrap(torch.from_numpy(tokens[index].astype(np.int64)))
            segments = not_next = None
        c = self.config
        inputs, selected = mask_tokens(targets, self.specials, c.mask_rate, generator, c.whole_word)
        return inputs, targets, selected, segments, not_next

    def _val_windows(self) -> tuple | None:
        """The windows of the validation split's first `eval_tokens` tokens (all with 0),
        one after the other, masked (and paired) with a generator of the run's seed."""
        val = self.data.split("val")
        n = len(val) // self.inner
        if self.config.eval_tokens:
            n = min(n, max(1, self.config.eval_tokens // self.inner))
        if n == 0:
            return None
        generator = torch.Generator().manual_seed(self.config.seed)
        return self.windows(val, np.arange(n) * self.inner, generator)

    def step_loss(self, trainer: Trainer, step: int) -> float:
        c, rt = self.config, trainer.runtime
        starts = step_starts(
            len(self.train_tokens), self.inner, c.seed, step, c.batch_size, c.grad_accum
        )
        mine = starts[rt.rank * self.share : (rt.rank + 1) * self.share]
        generator = torch.Generator().manual_seed(c.seed * 1_000_003 + step * 1_009 + rt.rank)
        total = 0.0
        micros = [mine[i : i + c.batch_size] for i in range(0, self.share, c.batch_size)]
        for i, micro in enumerate(micros):
            batch = self.windows(self.train_tokens, micro, generator)
            batch = [None if t is None else t.to(trainer.device) for t in batch]
            with rt.sync(trainer.wrapped, last=i == len(micros) - 1):
                with trainer.autocast():
                    loss = pretraining_loss(trainer.forward, *batch)
                (loss / (self.share / len(micro))).backward()
            total += loss.item() / (self.share / len(micro))
        return rt.all_reduce_mean(total)

    @torch.no_grad()
    def validation_loss(self, trainer: Trainer) -> float | None:
        """The mean loss over the validation windows' selected positions; the share of them
        whose most probable token is the original is kept as `val_accuracy` (with NSP, the
        share of pairs told right as `val_nsp_accuracy`, their loss `val_nsp_loss`)."""
        if self.val is None:
            return None
        nll = correct = count = nsp_nll = nsp_correct = 0.0
        with trainer.autocast():
            for i in range(0, len(self.val[0]), VAL_BATCH):
                x, y, m, segments, not_next = (
                    None if t is None else t[i : i + VAL_BATCH].to(trainer.device) for t in self.val
                )
                if self.nsp:
                    logits, nsp = trainer.forward(x, segments, only=m, next_sentence=True)
                    nsp, truth = nsp.float(), not_next.long()
                    nsp_nll += F.cross_entropy(nsp, truth, reduction="sum").item()
                    nsp_correct += (nsp.argmax(-1) == truth).sum().item()
                else:
                    logits = trainer.forward(x, only=m)  # [M,V]
                logits = logits.float()
                nll += F.cross_entropy(logits, y[m], reduction="sum").item()
                correct += (logits.argmax(-1) == y[m]).sum().item()
                count += m.sum().item()
        self.val_scores = {"val_accuracy": correct / count}
        if self.nsp:
            pairs = len(self.val[0])
            self.val_scores["val_nsp_loss"] = nsp_nll / pairs
            self.val_scores["val_nsp_accuracy"] = nsp_correct / pairs
        return nll / count

    def logged(self, kind: str) -> dict[str, float]:
        return self.val_scores if kind == "val" else {}

    def write_card(self, trainer: Trainer, results: dict[str, Any]) -> None:
        """MODEL_CARD.md: the data, the masking, the model and the results."""
        meta, c, run = self.data.meta, self.config, trainer.run
        sources = ", ".join(
            f"`{s['name']}` (sha256 `{s['sha256'][:12]}…`)" for s in meta["sources"]
        )
        loss, accuracy = results.get("val_loss"), self.val_scores.get("val_accuracy")
        nsp = self.val_scores.get("val_nsp_accuracy")
        card = f"""# Model card: `{run.name}`

A bidirectional transformer encoder (J&M ch. 11) pretrained with tlm by masked language
modeling: each position reads the whole window, left and right.

## Data

{sources}, prepared in `{self.data.folder}` ({meta["tokenizer"]} tokenizer, with [CLS],
[SEP], [MASK] and [PAD] added): {meta["splits"]["train"]["tokens"]:,} training tokens,
{meta["splits"]["val"]["tokens"]:,} validation tokens. Windows of {self.inner + 2 + self.nsp} \
tokens, {_window_kind(self.nsp)}. Masking: {c.mask_rate:.0%} of the tokens selected
({"whole words" if c.whole_word else "token by token"}); of those 80% [MASK], 10% a random
token, 10% unchanged.

{model_section(trainer, results)}

## Results

| | |
|---|---|
| steps | {results["step"]:,} |
| wall time | {results["elapsed"]:.1f} s |
| final train loss (nats per masked token) | {results["train_loss"]:.4f} |
| final validation loss (nats per masked token) | {"n/a" if loss is None else f"{loss:.4f}"} |
| validation masked-token accuracy | {"n/a" if accuracy is None else f"{accuracy:.1%}"} |
| validation next-sentence accuracy | {"n/a (no NSP)" if nsp is None else f"{nsp:.1%}"} |

## How to use

```
tlm fill-mask {run} "The [MASK] module reads JSON."
```

## Limits

A masked-LM encoder scores and represents text; it does not generate it. It knows only its
data, and reproduces that data's biases in what it predicts and how it represents words.
"""
        write_text_atomic(run / "MODEL_CARD.md", card)


def _window_kind(nsp: bool) -> str:
    if not nsp:
        return "`[CLS] ... [SEP]`"
    return (
        "`[CLS] A [SEP] B [SEP]`, cut at a random point, half of the Bs taken from elsewhere "
        "(next-sentence prediction, its loss added)"
    )
