"""`TrainConfig`: how to train, frozen and validated; a TOML file's keys sorted into the
model's and training's configs (`split_fields`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from tlm.config.fields import ConfigError, check_choice, check_positive, from_dict
from tlm.config.model import ModelConfig

DEVICES = ("auto", "cpu", "cuda", "mps")
PRECISIONS = ("auto", "float32", "bfloat16")  # the training precision (autocast)
BAD_GRADIENT = ("skip", "stop")
SCHEDULES = ("cosine", "inverse-sqrt")
OPTIMIZERS = ("adamw", "muon")
WINDOWS = ("random", "documents")  # where a training window starts (`data/batches.py`)
OBJECTIVES = (
    "lm",
    "dpo",
    "grpo",
    "mlm",
)  # what a step minimises (`train/dpo.py`, `grpo.py`, `mlm.py`)
ADVANTAGES = ("mean", "zscore")  # GRPO's advantage: r - mean, or (r - mean) / std
DPO_LOSSES = ("sigmoid", "ipo", "cdpo")  # `model/loss.py: dpo_loss`


@dataclass(frozen=True)
class TrainConfig:
    """How to train (§10.9): data, optimizer, schedule, evaluation and checkpoints.

    The learning rate warms up linearly for `warmup_steps`, then follows a cosine from
    `lr` down to `min_lr` (lr/10 unless given) at `max_steps`. One optimizer step sees
    `batch_size * grad_accum` windows of `context_length` tokens.

    `nonfinite_grad`: what a step whose gradient norm is NaN or infinite does, although its
    loss was finite: "skip" (no update; counted in metrics.jsonl) or "stop" (end the run,
    keeping the last checkpoint).

    Validation scores the first `eval_tokens` tokens of the validation split, or all of it
    with `eval_tokens=0`: a large split scored whole makes each evaluation slower, but the
    loss then measures the whole split, as `tlm eval` does.

    `optimizer`: "adamw" (the book's) or "muon": Muon for the blocks' weight matrices and
    AdamW for the rest, one learning rate for both (`train/optim.py`); a departure from the
    book for small budgets. Muon runs on one process or under DDP, not FSDP.

    `keep_best`: each evaluation whose validation loss is lower than every earlier one writes
    the weights to RUN/best.safetensors (`--weights best` reads them); model.safetensors
    stays the latest weights, which a resumed run continues from.

    `windows`: where a training window of a token stream starts: "random", any offset of
    the packed stream (each token as likely as any other to be in a window, wherever its
    document is cut); or "documents", the first token of a document (its <|endoftext|>),
    so that a document shorter than the window is seen whole, from its start, and what it
    asks at its end is read with all it said before (the window then runs on into the
    next documents). Long-context work wants the second (docs/long-context.md).

    Translation (an encoder-decoder on sentence pairs) batches by token count: each
    micro-batch holds at most `batch_tokens` tokens a side, padding included, and a step
    `grad_accum` of them. `schedule="inverse-sqrt"` is the paper's rate,
    lr · d_model^-0.5 · min(step^-0.5, step · warmup_steps^-1.5) (Vaswani et al. §5.3;
    `lr` 1 is the paper's exactly). `label_smoothing` ε spreads ε of each target's
    probability over the vocabulary (§5.4).

    `objective="dpo"` aligns a chat run with preference pairs (`tlm prepare --task
    preference`, J&M ch. 12): direct preference optimization against the frozen
    `init_from` run, with `beta` β, the strength of the pull towards that reference, and
    `dpo_loss` "sigmoid" (DPO), "ipo" or "cdpo" (whose ε is `label_smoothing`), and
    `sft_weight` w: w × the chosen answers' mean negative log-likelihood per token added to
    it (RPO, Pang et al. 2024: keeps the chosen answers likely, as DPO alone need not);
    `batch_size` then counts pairs. `objective="grpo"` is RL on verifiable rewards
    (`tlm prepare --task prompts`): each step samples `group_size` replies to each of
    `batch_size` prompts (at most `max_new_tokens` tokens, at `temperature`), rewards them
    with `reward`, and follows the policy gradient of their advantages (`advantage`), with a
    KL pull of weight `beta` towards `init_from` (0: none) and PPO's clip at `clip` when a
    batch of samples serves `updates_per_batch` updates. `beta` defaults to 0.1 for dpo and
    0 for grpo.

    `objective="mlm"` pretrains a bidirectional encoder (`model_type="encoder"`, J&M
    §11.2) on a token stream: each window's positions are selected at `mask_rate` (with
    `whole_word`, each word's tokens together), and of those 80% become [MASK], 10% a random
    token, 10% stay; the loss scores the selected positions only. Fine-tuning an encoder
    run for a task (the model's `task`, classify or tag) trains on labeled examples from
    `init_from`'s weights, or with `reinit` from random ones (its shape and tokenizer only:
    the baseline that shows what pretraining gave); with `group_by_length` each step's
    examples are of similar length (drawn from runs of 50 steps' examples sorted by length,
    as transformers' Trainer does): 3x fewer padded positions on the demo's docstrings.
    """

    data: str = ""
    out: str = ""
    batch_size: int = 32
    grad_accum: int = 1
    max_steps: int = 1000
    lr: float = 1e-3
    min_lr: float | None = None
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0
    nonfinite_grad: str = "skip"
    eval_interval: int = 250
    eval_tokens: int = 1 << 15  # 0: the whole validation split
    log_interval: int = 10
    checkpoint_interval: int | None = None
    seed: int = 1337
    device: str = "auto"
    precision: str = "auto"  # --precision: float32, or bf16 autocast
    compile: bool = False
    init_from: str | None = None
    schedule: str = "cosine"
    optimizer: str = "adamw"
    label_smoothing: float = 0.0
    batch_tokens: int | None = None
    keep_best: bool = False
    windows: str = "random"
    objective: str = "lm"
    beta: float | None = None
    dpo_loss: str = "sigmoid"
    sft_weight: float = 0.0
    reward: str | None = None
    group_size: int = 8
    advantage: str = "mean"
    updates_per_batch: int = 1
    clip: float = 0.2
    max_new_tokens: int = 64
    temperature: float = 1.0
    mask_rate: float = 0.15
    whole_word: bool = False
    reinit: bool = False
    group_by_length: bool = True

    def __post_init__(self) -> None:
        for name in ("batch_size", "grad_accum", "max_steps", "eval_interval"):
            check_positive(name, getattr(self, name))
        if not isinstance(self.eval_tokens, int) or self.eval_tokens < 0:
            raise ConfigError(
                f"eval_tokens must be an integer >= 0 (0 = the whole validation split), "
                f"got {self.eval_tokens!r}"
            )
        check_positive("log_interval", self.log_interval)
        if self.checkpoint_interval is None:
            object.__setattr__(self, "checkpoint_interval", self.eval_interval)
        check_positive("checkpoint_interval", self.checkpoint_interval)
        if not self.lr > 0:
            raise ConfigError(f"lr must be > 0, got {self.lr!r}")
        if self.min_lr is None:
            object.__setattr__(self, "min_lr", self.lr / 10)
        if not 0 <= self.min_lr <= self.lr:
            raise ConfigError(f"min_lr must be in [0, lr={self.lr}], got {self.min_lr!r}")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ConfigError(f"warmup_steps must be an integer >= 0, got {self.warmup_steps!r}")
        if self.weight_decay < 0:
            raise ConfigError(f"weight_decay must be >= 0, got {self.weight_decay!r}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"{name} must be in [0, 1), got {getattr(self, name)!r}")
        if self.grad_clip < 0:
            raise ConfigError(f"grad_clip must be >= 0 (0 = off), got {self.grad_clip!r}")
        check_choice("nonfinite_grad", self.nonfinite_grad, BAD_GRADIENT)
        check_choice("schedule", self.schedule, SCHEDULES)
        check_choice("optimizer", self.optimizer, OPTIMIZERS)
        if not 0 <= self.label_smoothing < 1:
            raise ConfigError(f"label_smoothing must be in [0, 1), got {self.label_smoothing!r}")
        if self.batch_tokens is not None:
            check_positive("batch_tokens", self.batch_tokens)
        if not self.device.removeprefix("cuda:").isdigit():  # cuda:N names one GPU
            check_choice("device", self.device, DEVICES)
        check_choice("precision", self.precision, PRECISIONS)
        check_choice("windows", self.windows, WINDOWS)
        check_choice("objective", self.objective, OBJECTIVES)
        check_choice("dpo_loss", self.dpo_loss, DPO_LOSSES)
        if self.sft_weight < 0 or (self.sft_weight and self.objective != "dpo"):
            raise ConfigError(f"sft_weight weighs DPO's added NLL: >= 0 with objective dpo, "
                              f"got {self.sft_weight!r}")  # fmt: skip
        check_choice("advantage", self.advantage, ADVANTAGES)
        if self.beta is None:
            object.__setattr__(self, "beta", 0.1 if self.objective == "dpo" else 0.0)
        if not (self.beta > 0 if self.objective == "dpo" else self.beta >= 0):
            raise ConfigError(f"beta must be {'> 0' if self.objective == 'dpo' else '>= 0'}, "
                              f"got {self.beta!r}")  # fmt: skip
        if self.objective in ("dpo", "grpo") and not self.init_from:
            raise ConfigError(f"objective {self.objective} starts from a run (and holds it as "
                              "its reference): give --init-from RUN")  # fmt: skip
        if self.objective == "grpo" and not self.reward:
            raise ConfigError("objective grpo rewards its samples: give --reward NAME")
        for name in ("group_size", "updates_per_batch", "max_new_tokens"):
            check_positive(name, getattr(self, name))
        if self.objective == "grpo" and self.group_size < 2:
            raise ConfigError("group_size must be >= 2: an advantage is against the group")
        if self.reinit and not self.init_from:
            raise ConfigError("reinit takes --init-from's shape and tokenizer: give --init-from")
        if not 0 < self.mask_rate < 1:
            raise ConfigError(f"mask_rate must be in (0, 1), got {self.mask_rate!r}")
        if not 0 < self.clip < 1 or not self.temperature > 0:
            raise ConfigError(f"clip must be in (0, 1) and temperature > 0, got "
                              f"{self.clip!r}, {self.temperature!r}")  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        return from_dict(cls, renamed(values))


RENAMED = {"dtype": "precision"}  # TrainConfig keys of older runs and TOML files


def renamed(values: dict[str, Any]) -> dict[str, Any]:
    """`values` with the older names of TrainConfig keys replaced by today's."""
    return {RENAMED.get(key, key): value for key, value in values.items()}


def split_fields(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Sort flat keys (or [model] / [train] tables, as in a TOML file) into the two configs."""
    values = dict(values)
    model = dict(values.pop("model", {}) or {})
    train = renamed(dict(values.pop("train", {}) or {}))
    values = renamed(values)
    model_names = {f.name for f in dataclasses.fields(ModelConfig)}
    train_names = {f.name for f in dataclasses.fields(TrainConfig)}
    for key, value in values.items():
        if key in model_names:
            model[key] = value
        elif key in train_names:
            train[key] = value
        else:
            raise ConfigError(f"unknown config key {key!r}")
    return model, train


def load_toml(path: str) -> dict[str, Any]:
    import tomllib

    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
