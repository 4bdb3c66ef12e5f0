"""RL on verifiable rewards (J&M ch. 12): group-relative policy optimization.

`PromptGroups` is the `Trainer`'s batch source for a `PromptData` folder (`tlm prepare
--task prompts`) under `--objective grpo`. Every `updates_per_batch` steps it samples a
batch: G = `group_size` replies to each of the step's prompts, with tlm's own batched
decoding (`Slots`: every reply a row of one KV cache, at `temperature`, each prompt's G
rows drawing from generators of (seed, round, prompt), so a reply is the same on any number
of processes), and rewards each with the verifier (`train/rewards.py`). A reply's advantage
is its reward against its group's: A = r − mean (`--advantage zscore`: divided by the
group's standard deviation too), so a group whose replies all score alike teaches nothing.

The loss (Shao et al. 2024, with DAPO's token-level normalisation, Yu et al. 2025) over the
batch's reply tokens o_{i,t}, N of them in all the step's replies:

    L = −(1/N) Σ_i Σ_t [ min(ρ_{i,t} A_i, clip(ρ_{i,t}, 1 − ε, 1 + ε) A_i) − β KL_{i,t} ]

with ρ = π(o_t | ·) / π_old(o_t | ·), π_old the policy that sampled the batch (its
log-probabilities taken at the batch's first update: ρ = 1 there, and the clip acts only on
the later updates of the same batch), and KL_{i,t} = exp(q − p) − (q − p) − 1 (the k3
estimator, q the frozen init run's log-probability, p the policy's), when β > 0. Logged:
the mean reward, the pass rate (rewards ≥ 1), the replies' mean length, the KL, and the
share of the time spent sampling. With β = 0 a reply whose advantage is 0 (all its group
scored alike) adds nothing to L's gradient, so a step passes only the others forward and
back (N still counts its tokens: the gradient is the whole batch's). The validation
"loss" is 1 − the greedy pass rate on the held-out prompts (lower is better, so
--keep-best keeps the best), logged with the mean greedy reward.
"""

from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor, nn

from tlm.chat import END
from tlm.config import ModelConfig, TrainConfig
from tlm.data.tokens import PromptData
from tlm.generate import GenerationConfig
from tlm.generate.slots import Slots
from tlm.inference import Decoder
from tlm.io import write_text_atomic
from tlm.model.loss import IGNORE, grpo_loss, token_logprobs
from tlm.tokenizer import load_tokenizer
from tlm.train.loop import Batches
from tlm.train.order import PassOrder
from tlm.train.report import model_section
from tlm.train.rewards import PASS, reward_of
from tlm.train.run import RunError

if TYPE_CHECKING:
    from tlm.train.loop import Trainer


@dataclass
class Rollouts:
    """One sampled batch: each reply's prompt (an index into the split), its tokens, its
    reward and advantage, and (after the batch's first update) its tokens' log-probabilities
    under the policy that sampled it. JSON, saved with checkpoints."""

    round: int
    prompts: list[int]
    replies: list[list[int]]
    rewards: list[float]
    advantages: list[float]
    old: list[list[float]] | None = None
    seconds: float = 0.0  # spent sampling and rewarding
    finished: list[bool] = field(default_factory=list)


class PromptGroups(Batches):
    """The prompts of a `PromptData` folder as a `Trainer`'s batches (`batch_size` prompts
    a micro-batch, each with `group_size` replies)."""

    def __init__(
        self, data: PromptData, model_config: ModelConfig, config: TrainConfig, world_size: int
    ) -> None:
        self.data, self.config, self.T = data, config, model_config.context_length
        self.tokenizer = load_tokenizer(data.folder)
        self.end_id = self.tokenizer.special_id(END)
        if self.end_id is None:
            raise RunError(f"{data.folder}'s tokenizer has no chat template; prepare it again")
        self.reward = reward_of(config.reward)
        self.answers = {split: data.answers(split) for split in ("train", "val")}
        self.prompts = {split: data.prompts(split) for split in ("train", "val")}
        room = self.T - config.max_new_tokens
        if any(len(p) > room for p in self.prompts["train"]):
            raise RunError(
                f"a training prompt leaves fewer than --max-new-tokens {config.max_new_tokens} "
                f"of the context's {self.T} positions for its reply"
            )
        self.global_batch = config.batch_size * config.grad_accum  # prompts a step, all ranks
        if self.global_batch % world_size:
            raise RunError("the prompts of a step do not split evenly over the processes")
        self.share = self.global_batch // world_size
        self.order = PassOrder(len(self.prompts["train"]), self.global_batch, config.seed)
        self.tokens_per_step = 0
        self.batch: Rollouts | None = None
        self.reference: nn.Module | None = None  # the frozen init run, when beta > 0
        self._seen: dict[str, list[float]] = {}
        self._val: dict[str, float] = {}
        self._trained = 0.0  # seconds of forward and backward passes since the last log

    def summary(self) -> str:
        c = self.config
        return (
            f"grpo: {len(self.prompts['train']):,} prompts ({len(self.prompts['val']):,} held "
            f"out), {c.group_size} replies each of at most {c.max_new_tokens} tokens, reward "
            f"{c.reward}, advantage {c.advantage}, beta {c.beta}, {c.updates_per_batch} "
            f"update(s) a batch"
        )

    def hold_reference(self, model: nn.Module) -> None:
        """A frozen copy of the init run's weights, for the KL term (beta > 0 only)."""
        if self.config.beta > 0:
            self.reference = copy.deepcopy(model).eval().requires_grad_(False)

    def step_loss(self, trainer: Trainer, step: int) -> float:
        """Sample a batch every `updates_per_batch` steps; then this step's backward passes
        over its replies. Returns the step's loss over every process."""
        c, rt = self.config, trainer.runtime
        round_ = step // c.updates_per_batch
        if self.batch is None or self.batch.round != round_:
            prompts = self.order.step(round_)[rt.rank * self.share : (rt.rank + 1) * self.share]
            self.batch = self.sample(trainer.model, round_, prompts.tolist())
            self._remember_batch(self.batch)
        started = time.perf_counter()
        batch, G = self.batch, c.group_size
        count = sum(len(r) for r in batch.replies)
        total_tokens = rt.all_reduce_mean(float(count)) * rt.world_size
        first = batch.old is None
        old: list[list[float]] = [[] for _ in batch.replies]  # [] where never needed
        total, kls, per_micro = 0.0, [], c.batch_size * G
        active = self._with_gradient(batch)
        for start in range(0, len(active), per_micro):
            rows = active[start : start + per_micro]
            x, y, learned = self._tensors(batch, rows, trainer.device)
            last = start + per_micro >= len(active)
            with rt.sync(trainer.wrapped, last=last):
                with trainer.autocast():
                    logits = trainer.forward(x)
                logp = token_logprobs(logits, y)  # [b, L]: log π(o_t | ·), 0 off the replies
                if first:
                    before = logp.detach()
                    for r, i in enumerate(rows):
                        old[i] = before[r, learned[r]].tolist()
                else:
                    before = self._old(batch, rows, learned)
                advantage = torch.tensor([batch.advantages[i] for i in rows], device=x.device)
                loss, kl = self._objective(logp, before, advantage[:, None], x, y)
                (loss * rt.world_size / total_tokens).backward()
            total += loss.item() * rt.world_size / total_tokens
            kls.append(kl)
        if first:
            batch.old = old
        self.tokens_per_step = int(total_tokens) + len(batch.prompts) * rt.world_size
        self._trained += time.perf_counter() - started
        self._seen.setdefault("kl", []).append(sum(kls) / max(1, len(kls)))
        return rt.all_reduce_mean(total)

    def _with_gradient(self, batch: Rollouts) -> list[int]:
        """The replies this step passes forward and back: with beta 0, a reply whose advantage
        is 0 (its group all scored alike) adds 0 to the loss and to every gradient, so it is
        skipped (its tokens still count in N); at least one reply, so that every process
        takes part in the gradients' all-reduce."""
        if self.config.beta > 0:
            return list(range(len(batch.replies)))
        return [i for i, a in enumerate(batch.advantages) if a != 0] or [0]

    def _objective(self, logp, before, advantage, x, y) -> tuple[Tensor, float]:
        """`model/loss.py: grpo_loss` of these rows (y != IGNORE on their replies' tokens),
        with the frozen reference's log-probabilities when beta > 0; and the mean KL."""
        c, learned, q = self.config, y != IGNORE, None
        if self.reference is not None:
            with torch.no_grad():
                q = token_logprobs(self.reference(x), y)
        loss, kl = grpo_loss(logp, before, advantage, learned, c.clip, c.beta, q)
        return loss, float((kl * learned).sum() / learned.sum().clamp(min=1))

    def _old(self, batch: Rollouts, rows, learned: Tensor) -> Tensor:
        """The batch's saved log-probabilities of `rows`' reply tokens, laid out as learned."""
        out = torch.zeros(learned.shape, device=learned.device)
        for r, i in enumerate(rows):
            out[r, learned[r]] = torch.tensor(batch.old[i], device=learned.device)
        return out

    def _tensors(self, batch: Rollouts, rows, device) -> tuple[Tensor, Tensor, Tensor]:
        """Prompt + reply of each row as inputs [b,L], targets [b,L] (IGNORE off the reply)
        and learned [b,L] (the reply's tokens), right-padded."""
        G = self.config.group_size
        texts = [self.prompts["train"][batch.prompts[i // G]] + batch.replies[i] for i in rows]
        L = max(len(t) for t in texts) - 1
        x = torch.full((len(texts), L), self.tokenizer.eot_id, dtype=torch.long)
        y = torch.full((len(texts), L), IGNORE, dtype=torch.long)
        for r, (i, text) in enumerate(zip(rows, texts, strict=True)):
            n, reply = len(text), len(batch.replies[i])
            x[r, : n - 1] = torch.tensor(text[:-1])
            y[r, n - 1 - reply : n - 1] = torch.tensor(text[n - reply :])
        return x.to(device), y.to(device), (y != IGNORE).to(device)

    @torch.no_grad()
    def sample(self, model: nn.Module, round_: int, prompts: list[int]) -> Rollouts:
        """G replies to each training prompt of `prompts` (indices), rewarded, with their
        advantages: sampling round `round_` of `model`."""
        started, c = time.perf_counter(), self.config
        was_training = model.training
        model.eval()
        ends = (self.end_id, self.tokenizer.eot_id)
        config = GenerationConfig(
            max_new_tokens=c.max_new_tokens, do_sample=True, temperature=c.temperature,
            eos_token_id=ends,
        )  # fmt: skip
        G = c.group_size
        longest = max(len(self.prompts["train"][p]) for p in prompts)  # the cache: no longer
        # than the round's rows can grow (zeroing the context's length cost as much as 4 steps)
        slots = Slots(model, len(prompts) * G, longest + c.max_new_tokens, Decoder(model))
        seqs = [
            slots.add(self.prompts["train"][p], config, j, seed=_seed(c.seed, round_, p))
            for p in prompts
            for j in range(G)
        ]
        while not slots.idle():
            slots.step()
        model.train(was_training)
        replies = [s.tokens for s in seqs]
        texts = [self._text(reply) for reply in replies]
        answers = [self.answers["train"][p] for p in prompts for _ in range(G)]
        rewards = [float(self.reward(t, a)) for t, a in zip(texts, answers, strict=True)]
        r = np.asarray(rewards).reshape(len(prompts), G)
        advantages = r - r.mean(axis=1, keepdims=True)
        if c.advantage == "zscore":
            advantages = advantages / (r.std(axis=1, ddof=1, keepdims=True) + 1e-4)
        finished = [s.finish_reason == "eos" for s in seqs]
        seconds = time.perf_counter() - started
        return Rollouts(
            round_, prompts, replies, rewards, advantages.flatten().tolist(), None, seconds,
            finished,
        )  # fmt: skip

    def _text(self, reply: list[int]) -> str:
        """A reply's text, without its end token."""
        ends = (self.end_id, self.tokenizer.eot_id)
        return self.tokenizer.decode([t for t in reply if t not in ends])

    def _remember_batch(self, batch: Rollouts) -> None:
        seen = self._seen
        seen.setdefault("reward", []).append(float(np.mean(batch.rewards)))
        seen.setdefault("pass_rate", []).append(float(np.mean([r >= PASS for r in batch.rewards])))
        seen.setdefault("length", []).append(float(np.mean([len(r) for r in batch.replies])))
        seen.setdefault("sampling_seconds", []).append(batch.seconds)

    @torch.no_grad()
    def validation_loss(self, trainer: Trainer) -> float | None:
        """1 − the greedy pass rate on the held-out prompts (the mean greedy reward logged)."""
        prompts = self.prompts["val"]
        if not prompts:
            return None
        ends = (self.end_id, self.tokenizer.eot_id)
        config = GenerationConfig(max_new_tokens=self.config.max_new_tokens, eos_token_id=ends)
        slots = Slots(trainer.model, len(prompts), self.T, Decoder(trainer.model))
        seqs = [slots.add(p[-(self.T - 1) :], config) for p in prompts]
        while not slots.idle():
            slots.step()
        rewards = [
            float(self.reward(self._text(s.tokens), a))
            for s, a in zip(seqs, self.answers["val"], strict=True)
        ]
        passed = float(np.mean([r >= PASS for r in rewards]))
        self._val = {"val_pass1": passed, "val_reward": float(np.mean(rewards))}
        return 1.0 - passed

    def logged(self, kind: str) -> dict[str, float]:
        if kind == "val":
            return dict(self._val)
        seen, self._seen = self._seen, {}
        out = {k: sum(v) / len(v) for k, v in seen.items() if v and k != "sampling_seconds"}
        sampling = sum(seen.get("sampling_seconds", []))
        if sampling + self._trained > 0:
            out["sampling_share"] = sampling / (sampling + self._trained)
        self._trained = 0.0
        return out

    def state_dict(self) -> dict[str, Any]:
        """The batch in use (its replies and their old log-probabilities), so a run resumed
        between two updates of one batch goes on with the same samples."""
        return {"batch": None if self.batch is None else asdict(self.batch)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        batch = state.get("batch")
        self.batch = None if batch is None else Rollouts(**batch)

    def write_card(self, trainer: Trainer, results: dict[str, Any]) -> None:
        """MODEL_CARD.md: the objective, the reward, the prompts and the results."""
        meta, run, c = self.data.meta, trainer.run, self.config
        sources = ", ".join(f"`{s['name']}`" for s in meta["sources"])
        figures = " ".join(f"{k} {v:.4f}" for k, v in self._val.items()) or "none"
        card = f"""# Model card: `{run.name}`

An assistant trained by reinforcement learning on verifiable rewards (GRPO, J&M ch. 12)
from the run `{c.init_from}`. It answers in turns of tlm's chat template.

## Objective

grpo: reward `{c.reward}`, {c.group_size} replies a prompt (at most {c.max_new_tokens}
tokens, temperature {c.temperature}), advantage `{c.advantage}`, clip {c.clip},
{c.updates_per_batch} update(s) a batch;
beta {c.beta}, reference: `{c.init_from}` (the KL's, when beta > 0).

## Data

{sources}, prepared in `{self.data.folder}`: {len(self.prompts["train"]):,} training
prompts, {len(self.prompts["val"]):,} held out.

{model_section(trainer, results)}

## Results

| | |
|---|---|
| steps | {results["step"]:,} |
| wall time | {results["elapsed"]:.1f} s |
| validation (greedy) | {figures} |

## Limits

A policy trained on a reward learns what the reward checks, including its loopholes.
"""
        write_text_atomic(run / "MODEL_CARD.md", card)


def _seed(seed: int, round_: int, prompt: int) -> int:
    """The seed of one prompt's group of replies in one sampling round."""
    return int(np.random.SeedSequence([seed, round_, prompt]).generate_state(1, np.uint64)[0] >> 1)
