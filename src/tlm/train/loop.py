"""The training loop (J&M §10.9): self-supervised next-token prediction with teacher forcing.

Each step: for every micro-batch, cross-entropy (eq. 10.51) averaged over the windows and
backpropagated; then gradient clipping, one AdamW step at the scheduled learning rate.
Periodically: validation loss, metrics, plot and an atomic checkpoint; with --keep-best,
the weights of the lowest validation loss so far in RUN/best.safetensors. Ctrl-C saves
and stops; a loss that becomes NaN or inf stops without saving over the last good state. A
gradient whose norm is NaN or inf (the loss finite) never reaches the weights: the step is
skipped and counted, or the run stops (`TrainConfig.nonfinite_grad`).
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.nn.utils import clip_grad_norm_

from tlm.checkpoint import (
    BEST,
    NonFiniteWeights,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    save_weights,
    write_config,
)
from tlm.config import ModelConfig, TrainConfig
from tlm.data import TokenData, eval_windows, step_starts, windows_at
from tlm.io import write_text_atomic
from tlm.load import load_model
from tlm.model import build_model
from tlm.model.loss import cross_entropy, window_nll
from tlm.train.distributed import Runtime
from tlm.train.optim import build_optimizer, learning_rate
from tlm.train.report import Metrics, ProgressReport, plot_losses, write_model_card
from tlm.train.run import RunError, pick_dtype

VAL_BATCH = 32  # validation windows per forward pass (and per rank's share of the split)


class Diverged(RuntimeError):
    """The loss became NaN or infinite."""


class Interrupted(RuntimeError):
    """Ctrl-C: the run was saved at `step` and can be resumed."""

    def __init__(self, step: int) -> None:
        super().__init__(f"interrupted; saved at step {step}")
        self.step = step


@dataclass
class Progress:
    step: int = 0  # optimizer steps completed
    tokens: int = 0
    elapsed: float = 0.0  # seconds of training, summed over resumes
    window: list[float] = field(default_factory=list)  # train losses since the last log line
    norms: list[float] = field(default_factory=list)  # gradient norms since the last log line
    skipped: int = 0  # steps whose gradient was not finite, so no update was made
    best_step: int | None = None  # --keep-best: the step of best.safetensors
    best_loss: float | None = None  # and its validation loss, which a new best must beat


class DeferredInterrupt:
    """While active, the first Ctrl-C only sets `requested`; a second one interrupts at once."""

    def __enter__(self) -> DeferredInterrupt:
        self.requested, self.previous = False, None
        if threading.current_thread() is threading.main_thread():  # signals go to main only
            self.previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


class Trainer:
    def __init__(
        self,
        model_config: ModelConfig,
        config: TrainConfig,
        data: TokenData,
        tokenizer_json: str,
        resume: bool = False,
        progress_bar: bool = True,
        runtime: Runtime | None = None,
    ) -> None:
        self.config, self.model_config, self.data = config, model_config, data
        self.runtime = rt = runtime or Runtime.from_env(config.device)
        self.run = Path(config.out)
        self.device = rt.device
        self.dtype = pick_dtype(config.dtype, self.device)
        self.global_batch = config.batch_size * config.grad_accum  # windows per step, all ranks
        if self.global_batch % rt.world_size:
            raise RunError(
                f"the global batch of {self.global_batch} windows (--batch-size x --grad-accum) "
                f"does not split evenly over {rt.world_size} processes"
            )
        if rt.fsdp and config.optimizer == "muon":  # Newton-Schulz needs a whole matrix
            raise RunError("--optimizer muon needs whole weight matrices: use DDP, not --fsdp")
        torch.manual_seed(config.seed)
        self.model = build_model(model_config, init=False)
        self.model.reset_parameters(seed=config.seed)  # resume / init_from overwrite it below
        self.model.to(self.device)
        self.progress_bar = progress_bar and rt.is_main
        self.state = Progress()
        self._load_data()
        saved = None
        if resume:  # the weights now, whole; the optimizer once it is built (maybe sharded)
            saved = load_checkpoint(latest_checkpoint(self.run), self.model, None)
            fields = Progress.__dataclass_fields__  # runs saved before a field existed lack it
            self.state = Progress(**{k: saved[k] for k in fields if k in saved})
        elif config.init_from:  # fine-tuning: start from a trained model's weights
            self.model.load_state_dict(_initial_weights(config.init_from, model_config))
        if not resume and rt.is_main:
            self.run.mkdir(parents=True, exist_ok=True)
            write_config(self.run, model_config, config.to_dict(), data.fingerprint())
            write_text_atomic(self.run / "tokenizer.json", tokenizer_json)
        if rt.rank:  # rank 0 keeps the seeded (or resumed) stream; the others differ from it
            torch.manual_seed(config.seed + rt.rank)  # (dropout masks)
        self.wrapped = rt.wrap(self.model)  # DDP, or FSDP2 sharding in place
        self.optimizer = build_optimizer(self.model, config)
        if saved is not None:
            rt.load_optimizer(self.model, self.optimizer, saved["optimizer"])
        self.forward = torch.compile(self.wrapped) if config.compile else self.wrapped
        self.metrics = None  # written by the main rank only
        if rt.is_main:
            self.metrics = Metrics(self.run / "metrics.jsonl", self.state.step if resume else None)

    def _load_data(self) -> None:
        """The training split and the validation batches (`TranslationTrainer`: pairs)."""
        self.tokens_per_step = self.global_batch * self.model_config.context_length  # all ranks'
        self.train_tokens = self.data.split("train")  # memory-mapped once
        self.val_batches = self._val_batches()

    def _val_batches(self) -> list[torch.Tensor]:
        """The validation windows in batches of VAL_BATCH, the unit a rank scores: the first
        `eval_tokens` targets of the split, or every one with `eval_tokens` 0."""
        val = self.data.split("val")
        if len(val) < 2:
            return []
        limit = self.config.eval_tokens or None  # None: eval_windows takes the whole split
        chunks = eval_windows(val, self.model_config.context_length, limit)
        return [w[i : i + VAL_BATCH] for w in chunks for i in range(0, len(w), VAL_BATCH)]

    def autocast(self):
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def train_step(self, step: int) -> tuple[float, float]:
        """One optimizer step; returns the mean training loss of its windows and the
        gradient norm (before clipping). A non-finite norm makes no update.

        The step's global batch (`step_starts`) is the same on any number of processes;
        each rank takes its slice and runs it in micro-batches of at most --batch-size
        windows. Each micro-batch's mean loss is weighted by its share of the rank's slice,
        and DDP averages the ranks' gradients: the gradient of the global batch's mean loss.
        """
        c, T, rt = self.config, self.model_config.context_length, self.runtime
        tokens = self.train_tokens
        starts = step_starts(len(tokens), T, c.seed, step, c.batch_size, c.grad_accum)
        share = self.global_batch // rt.world_size
        mine = starts[rt.rank * share : (rt.rank + 1) * share]
        micros = [mine[i : i + c.batch_size] for i in range(0, share, c.batch_size)]
        total = 0.0
        for i, micro in enumerate(micros):
            x, y = windows_at(tokens, micro, T)
            with rt.sync(self.wrapped, last=i == len(micros) - 1):
                with self.autocast():
                    loss = cross_entropy(self.forward(x.to(self.device)), y.to(self.device))
                (loss / (share / len(micro))).backward()
            total += loss.item() / (share / len(micro))
        return self.update(step, rt.all_reduce_mean(total))  # every rank judges one loss

    def update(self, step: int, loss: float) -> tuple[float, float]:
        """After the step's backward passes: stop on a non-finite loss, clip the gradient,
        and take the optimizer step (at the step's learning rate) unless its norm is
        non-finite. Returns (loss, norm)."""
        c = self.config
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(step, c, self.model_config.d_model)
        if not math.isfinite(loss):
            raise Diverged(f"loss became {loss} at step {step + 1}")
        limit = c.grad_clip if c.grad_clip > 0 else math.inf  # inf: measure, never scale
        norm = self.runtime.grad_norm(clip_grad_norm_(self.model.parameters(), limit, foreach=True))
        if math.isfinite(norm):
            self.optimizer.step()
        elif c.nonfinite_grad == "stop":
            raise Diverged(f"gradient norm became {norm} at step {step + 1} (loss {loss:.4f})")
        self.optimizer.zero_grad(set_to_none=True)  # a non-finite gradient is dropped here
        return loss, norm

    @torch.no_grad()
    def validation_loss(self) -> float | None:
        """The mean loss of every validation target. Under torchrun rank r scores batches
        r, r + K, ... and the sums are all-reduced; a rank whose batches ran out scores the
        first again and drops it, so every rank runs as many forward passes (FSDP gathers
        each block's shards in step across the ranks)."""
        batches, rt = self.val_batches, self.runtime
        if not batches:
            return None
        rounds = -(-len(batches) // rt.world_size)  # forward passes on every rank
        total = count = 0.0
        self.model.eval()
        with self.autocast():
            for i in range(rt.rank, rounds * rt.world_size, rt.world_size):
                mine = i < len(batches)
                nll = window_nll(self.forward, batches[i if mine else 0], VAL_BATCH)
                if mine:
                    total, count = total + nll.double().sum().item(), count + nll.numel()
        self.model.train()
        return rt.all_reduce_mean(total) / rt.all_reduce_mean(count)

    def fit(self) -> dict[str, Any]:
        """Train to `max_steps`; returns the final results (also in MODEL_CARD.md).

        Ctrl-C is honoured between steps: the step in flight completes, the run is saved,
        and `Interrupted` is raised. A second Ctrl-C stops at once, keeping the last save.
        """
        c, s = self.config, self.state
        self.model.train()
        bar = ProgressReport(c.max_steps, s.step, self.progress_bar)
        started, base = time.perf_counter(), s.elapsed
        with DeferredInterrupt() as interrupt:
            while s.step < c.max_steps:
                loss, norm = self.train_step(s.step)
                s.window.append(loss)
                if math.isfinite(norm):
                    s.norms.append(norm)
                else:
                    s.skipped += 1
                s.step, s.tokens = s.step + 1, s.tokens + self.tokens_per_step
                s.elapsed = base + time.perf_counter() - started
                last = s.step == c.max_steps
                if s.step % c.log_interval == 0 or last:
                    self._log(bar)
                bar.step()
                if s.step % c.eval_interval == 0 or last:
                    self._evaluate()
                    started, base = time.perf_counter(), s.elapsed  # eval time is not training
                stop = self.runtime.any(interrupt.requested)  # Ctrl-C on any rank stops all
                if s.step % c.checkpoint_interval == 0 or last or stop:
                    self.save()
                if stop:
                    bar.close()
                    raise Interrupted(s.step)
        bar.close()
        return self.finish()

    def _log(self, bar: ProgressReport) -> None:
        s = self.state
        mean = sum(s.window) / len(s.window)
        norm = sum(s.norms) / len(s.norms) if s.norms else None
        s.window, s.norms = [], []
        row = {"step": s.step, "tokens": s.tokens, "time": round(s.elapsed, 3)}
        lr = learning_rate(s.step - 1, self.config, self.model_config.d_model)
        row |= {"lr": lr, "train_loss": mean}
        row |= {"grad_norm": norm, "skipped_steps": s.skipped}
        row["tokens_per_s"] = round(s.tokens / max(s.elapsed, 1e-9))
        if self.metrics is not None:
            self.metrics.log(row)
        bar.log(s.step, mean, row["tokens_per_s"])

    def _evaluate(self) -> None:
        val = self.validation_loss()  # every rank takes part (FSDP gathers its shards)
        if val is None:
            return
        s = self.state
        better = s.best_loss is None or val < s.best_loss  # (every rank has the same `val`)
        kept = self.config.keep_best and math.isfinite(val) and better
        if kept:
            self.save_best(val)
        if self.metrics is None:
            return
        row = {"step": s.step, "tokens": s.tokens, "time": round(s.elapsed, 3), "val_loss": val}
        self.metrics.log(row | ({"best": True} if kept else {}))  # best.safetensors: this step
        plot_losses(self.metrics.rows, self.run / "plots" / "loss.png")

    def save_best(self, loss: float) -> None:
        """Write the weights now to RUN/best.safetensors (their step and loss in its header),
        then record them in the state that checkpoints save, so that a resumed run compares
        against the best it had reached at its checkpoint."""
        s = self.state
        weights = self.runtime.full_weights(self.model)  # every rank (FSDP gathers)
        header = {"step": str(s.step), "val_loss": repr(loss)}
        self._main_writes(lambda: save_weights(self.run / BEST, weights, header))
        s.best_step, s.best_loss = s.step, loss

    def save(self) -> None:
        """The main rank writes the checkpoint."""
        weights, optimizer = self.runtime.full_state(self.model, self.optimizer)
        self._main_writes(lambda: save_checkpoint(self.run, weights, optimizer, asdict(self.state)))

    def _main_writes(self, write) -> None:
        """The main rank calls `write`; if it refuses (non-finite weights), every rank stops."""
        refused = None
        if self.runtime.is_main:
            try:
                write()
            except NonFiniteWeights as exc:
                refused = exc
        if self.runtime.any(refused is not None):
            raise Diverged(f"at step {self.state.step}: {refused or 'weights not finite'}")

    def finish(self) -> dict[str, Any]:
        rows = self.metrics.rows if self.metrics is not None else []
        train = [r["train_loss"] for r in rows if "train_loss" in r]
        val = [r["val_loss"] for r in rows if "val_loss" in r]
        results = {
            "step": self.state.step,
            "tokens": self.state.tokens,
            "elapsed": self.state.elapsed,
            "train_loss": train[-1] if train else float("nan"),
            "val_loss": val[-1] if val else None,
        }
        if self.config.keep_best:
            results |= {"best_step": self.state.best_step, "best_val_loss": self.state.best_loss}
        if self.runtime.is_main:
            plot_losses(rows, self.run / "plots" / "loss.png")
            self.write_card(results)
        self.runtime.barrier()  # the files exist when any rank returns
        return results

    def write_card(self, results: dict[str, Any]) -> None:
        write_model_card(self.run, self.model_config, self.config, self.data.meta, results)


def _initial_weights(source: str, config: ModelConfig) -> dict[str, torch.Tensor]:
    """The weights of `--init-from`, learned positions cut to this run's context length."""
    state = load_model(source).state_dict()
    if "embedding.P" in state:
        state["embedding.P"] = state["embedding.P"][: config.context_length]  # [N, d] -> [T, d]
    return state
