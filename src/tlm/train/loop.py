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
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn.utils import clip_grad_norm_

from tlm.checkpoint import (
    BEST,
    NonFiniteWeights,
    save_checkpoint,
    save_weights,
)
from tlm.config import ModelConfig, TrainConfig
from tlm.train.distributed import Runtime
from tlm.train.optim import learning_rate
from tlm.train.precision import Precision, pick_precision
from tlm.train.report import Metrics, ProgressReport, plot_losses


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
    """The training loop over a built model, its optimizer and a batch source.

    Construction only stores what it is given: `opening.open_run` builds the parts (the
    seeded model, a resumed checkpoint, the run's files, DDP or FSDP, the optimizer) and
    the batch source, the language model's `windows.TokenWindows` or translation's
    `translate.PairBatches`, which gives each step's loss, the validation loss and the
    model card.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        config: TrainConfig,
        batches: Batches,
        model: nn.Module,
        wrapped: nn.Module,
        optimizer: torch.optim.Optimizer,
        runtime: Runtime,
        state: Progress | None = None,
        metrics: Metrics | None = None,
        progress_bar: bool = True,
        precision: Precision | None = None,
    ) -> None:
        self.config, self.model_config, self.batches = config, model_config, batches
        self.model, self.optimizer, self.runtime = model, optimizer, runtime
        self.wrapped = wrapped  # what a step calls: DDP, FSDP2's sharded model, or the model
        # static shapes: validation's batches (32 windows, a shorter last one) each get a
        # graph of their own; made dynamic, SDPA's is_causal became symbolic, the forward
        # broke into pieces, and from the first validation on training ran them instead
        self.forward = (
            torch.compile(self.wrapped, dynamic=False) if config.compile else self.wrapped
        )
        self.state = state or Progress()
        self.metrics = metrics  # written by the main rank only
        self.run, self.device = Path(config.out), runtime.device
        self.precision = precision or pick_precision(config.precision, self.device)
        self.progress_bar = progress_bar and runtime.is_main

    def autocast(self):
        """The training precision's autocast (fp32: none)."""
        if self.precision.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.precision.dtype)

    def train_step(self, step: int) -> tuple[float, float]:
        """One optimizer step; returns the mean training loss of its batch and the gradient
        norm (before clipping). A non-finite norm makes no update."""
        return self.update(step, self.batches.step_loss(self, step))

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
        """The batch source's validation loss, with the model in eval mode."""
        self.model.eval()
        try:
            return self.batches.validation_loss(self)
        finally:
            self.model.train()

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
                s.step, s.tokens = s.step + 1, s.tokens + self.batches.tokens_per_step
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
        row |= {"grad_norm": norm, "skipped_steps": s.skipped} | self.batches.logged("train")
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
        row |= self.batches.logged("val")
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
        """The main rank writes the checkpoint: with the progress, the batch source's state
        (`open_run` hands it back on --resume)."""
        weights, optimizer = self.runtime.full_state(self.model, self.optimizer)
        state = {**asdict(self.state), "batches": self.batches.state_dict()}
        self._main_writes(lambda: save_checkpoint(self.run, weights, optimizer, state))

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
            "precision": str(self.precision),
        }
        if self.config.keep_best:
            results |= {"best_step": self.state.best_step, "best_val_loss": self.state.best_loss}
        if self.runtime.is_main:
            plot_losses(rows, self.run / "plots" / "loss.png")
            self.write_card(results)
        self.runtime.barrier()  # the files exist when any rank returns
        return results

    def write_card(self, results: dict[str, Any]) -> None:
        self.batches.write_card(self, results)


class Batches(Protocol):
    """What a step trains on (`windows.TokenWindows`, `translate.PairBatches`,
    `chat.ChatWindows`, `dpo.PreferencePairs`, `grpo.PromptGroups`, each a subclass): the
    last three methods' bodies here are the defaults of a source with nothing more to log
    and nothing to keep between steps."""

    tokens_per_step: int  # tokens the last step trained on, for the counts and tok/s

    def step_loss(self, trainer: Trainer, step: int) -> float:
        """Run the step's forward and backward passes; its mean loss."""
        ...

    def validation_loss(self, trainer: Trainer) -> float | None: ...

    def write_card(self, trainer: Trainer, results: dict[str, Any]) -> None: ...

    def logged(self, kind: str) -> dict[str, float]:
        """Figures to log beside the loss: of the training steps since the last log line
        (`kind` "train") or of the last validation ("val")."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """What the source counts across steps, as JSON, saved with each checkpoint."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back a checkpoint's `state_dict` (`{}` from one saved before it existed)."""
