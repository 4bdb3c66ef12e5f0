"""Configuration: frozen, validated dataclasses, and their conversion to and from dicts.

Every error names the field and what it accepts, so a typo in a TOML file or a `--flag`
is a one-line message rather than a stack trace deep inside the model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, get_type_hints

from tlm.errors import UserError

MODEL_TYPES = ("decoder", "encoder-decoder")
NORMS = ("pre", "post")
POSITIONS = ("learned", "sinusoidal", "rope", "none")
ROPE_SCALINGS = ("linear", "ntk", "dynamic", "yarn")  # model/positions.py: rotary_frequencies
ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "relu2")
DROPOUTS = ("dropout", "attn_dropout", "resid_dropout", "embd_dropout")
RETIRED = {"attention_impl"}  # read from old config files and ignored


class ConfigError(UserError):
    """A configuration value that cannot be used; the message names the field."""


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    """The shape and the choices of a transformer: a decoder-only LM (J&M ch. 9), or the
    encoder-decoder of Vaswani et al. 2017 (`model_type="encoder-decoder"`).

    `d_head` defaults to `d_model // n_heads` (and then `n_heads` must divide `d_model`);
    `d_ff` defaults to `4 * d_model`. Both are resolved in `__post_init__`, so after
    construction they are always integers.

    `activation`: "relu" (eq. 9.21), "gelu" (exact, x·Φ(x)) or "gelu_tanh" (the tanh
    approximation GPT-2 was trained with; 5x slower than exact GELU on CPU in torch 2.13)
    or "relu2", ReLU(x)² (So et al. 2021, "Primer"), a departure from the book that trains
    faster at small budgets.

    `qk_norm` (off in the book) scales each head's query and key to unit RMS before their
    dot product (RMSNorm without a gain, as Dehghani et al. 2023 and OLMo 2 do), so the
    attention logits stay bounded and a higher learning rate stays stable.

    An encoder-decoder has `n_encoder_layers` encoder blocks (default `n_layers`) and
    `n_layers` decoder blocks; `context_length` bounds the source and the target each.
    Its positions are absolute (sinusoidal, as the paper, or learned): rotary positions
    have no meaning between a target and a source position.

    `dropout` is the textbook's one rate, applied at three places. GPT-2's config names
    them apart (attn_pdrop, resid_pdrop, embd_pdrop), and so may we: `attn_dropout` on the
    attention weights α, `resid_dropout` on each sublayer's output before its residual add,
    `embd_dropout` on the embedding X. Each left None means "as `dropout`"; it stays None
    (not resolved here) so that changing `dropout` later, as fine-tuning may, moves it too.
    With attention dropout 0 the fused kernel runs without dropout even while training.
    """

    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int | None = None
    context_length: int = 256
    d_head: int | None = None
    norm: str = "pre"
    position: str = "learned"
    activation: str = "gelu"
    tie_embeddings: bool = True
    bias: bool = True
    dropout: float = 0.0
    layer_norm_eps: float = 1e-5
    rope_base: float = 10000.0
    model_type: str = "decoder"
    n_encoder_layers: int | None = None
    attn_dropout: float | None = None  # None: `dropout` (kept last: positional order stays)
    resid_dropout: float | None = None
    embd_dropout: float | None = None
    qk_norm: bool = False
    rope_scaling: str | None = None  # positions past the trained context (`positions.py`)
    rope_factor: float = 1.0
    rope_original_context: int | None = None  # the context trained at (None: context_length)
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    attention_window: int | None = None  # each query sees at most W keys (`model/window.py`)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "context_length"):
            _check_positive(name, getattr(self, name))
        if self.d_head is None:
            if self.d_model % self.n_heads != 0:
                raise ConfigError(
                    f"n_heads ({self.n_heads}) must divide d_model ({self.d_model}) "
                    "unless d_head is given"
                )
            object.__setattr__(self, "d_head", self.d_model // self.n_heads)
        _check_positive("d_head", self.d_head)
        if self.d_ff is None:
            object.__setattr__(self, "d_ff", 4 * self.d_model)
        _check_positive("d_ff", self.d_ff)
        _check_choice("model_type", self.model_type, MODEL_TYPES)
        if self.model_type == "decoder" and self.n_encoder_layers is not None:
            raise ConfigError("n_encoder_layers applies to model_type='encoder-decoder'")
        if self.model_type == "encoder-decoder":
            if self.n_encoder_layers is None:
                object.__setattr__(self, "n_encoder_layers", self.n_layers)
            _check_positive("n_encoder_layers", self.n_encoder_layers)
            if self.position == "rope":
                raise ConfigError(
                    "an encoder-decoder takes absolute positions (sinusoidal or learned), "
                    "not rope: a target and a source position have no distance"
                )
        _check_choice("norm", self.norm, NORMS)
        _check_choice("position", self.position, POSITIONS)
        _check_choice("activation", self.activation, ACTIVATIONS)
        if self.position == "rope" and self.d_head % 2 != 0:
            raise ConfigError(f"d_head must be even for position='rope', got {self.d_head}")
        for name in DROPOUTS:
            value = getattr(self, name)
            if value is not None and not 0.0 <= value < 1.0:
                raise ConfigError(f"{name} must be in [0, 1), got {value!r}")
        if not self.layer_norm_eps > 0:
            raise ConfigError(f"layer_norm_eps must be > 0, got {self.layer_norm_eps!r}")
        if not self.rope_base > 1:
            raise ConfigError(f"rope_base must be > 1, got {self.rope_base!r}")
        if self.rope_scaling is not None:
            _check_choice("rope_scaling", self.rope_scaling, ROPE_SCALINGS)
            if self.position != "rope":
                raise ConfigError(
                    f"rope_scaling applies to rotary positions; this model's are {self.position}"
                )
        if not self.rope_factor >= 1:
            raise ConfigError(f"rope_factor must be >= 1, got {self.rope_factor!r}")
        if self.rope_scaling is not None and self.rope_original_context is None:  # s·T given
            trained = max(1, round(self.context_length / self.rope_factor))
            object.__setattr__(self, "rope_original_context", trained)
        if self.rope_original_context is not None:
            _check_positive("rope_original_context", self.rope_original_context)
        if self.attention_window is not None:
            _check_positive("attention_window", self.attention_window)
            if self.position not in ("rope", "none"):
                raise ConfigError(
                    "an attention window reads past the context, which needs positions "
                    f"without a table (rope or none); this model's are {self.position}"
                )
        if not self.yarn_beta_fast > self.yarn_beta_slow > 0:
            raise ConfigError(
                f"yarn_beta_fast ({self.yarn_beta_fast}) must exceed yarn_beta_slow "
                f"({self.yarn_beta_slow}), and both be > 0"
            )

    @property
    def trained_context(self) -> int:
        """The context the rotary positions were trained at: `rope_original_context`, or
        `context_length` when no scaling stretches them."""
        return self.rope_original_context or self.context_length

    @property
    def reads(self) -> int | None:
        """The most tokens a text given to the model may hold: its context, or any number
        for a model with an attention window (each query sees W keys; positions count on)."""
        return self.context_length if self.attention_window is None else None

    @property
    def d_attn(self) -> int:
        """Width of the concatenated heads, A * d_head (eq. 9.19)."""
        return self.n_heads * self.d_head

    @property
    def attn_dropout_p(self) -> float:
        """The dropout rate on the attention weights α: `attn_dropout`, else `dropout`."""
        return self.dropout if self.attn_dropout is None else self.attn_dropout

    @property
    def resid_dropout_p(self) -> float:
        """The dropout rate on a sublayer's output before the residual add."""
        return self.dropout if self.resid_dropout is None else self.resid_dropout

    @property
    def embd_dropout_p(self) -> float:
        """The dropout rate on the embedding X = E[w] + P[pos]."""
        return self.dropout if self.embd_dropout is None else self.embd_dropout

    def stretched(self, method: str | None, factor: float = 1.0) -> ModelConfig:
        """This rotary model read at `factor` times the context it was trained at, with
        `method` (ROPE_SCALINGS; None: as trained), its weights unchanged: what a command
        that reads a model does with `--rope-scaling yarn --rope-factor 4`."""
        if self.position != "rope":
            raise ConfigError(
                f"rope scaling applies to rotary positions; these are {self.position}"
            )
        trained = self.trained_context
        if method is None:
            unscaled = {"rope_scaling": None, "rope_factor": 1.0, "rope_original_context": None}
            return self.replace(context_length=trained, **unscaled)
        return self.replace(
            context_length=int(trained * factor),
            rope_scaling=method,
            rope_factor=float(factor),
            rope_original_context=trained,
        )

    def with_context(self, n: int) -> ModelConfig:
        """This model read with windows of `n` positions: past the trained context, a
        rotary or sinusoidal model computes its angles on, scaled or not (`stretched`);
        learned positions end where training left them."""
        if self.position == "learned" and n > self.context_length:
            raise ConfigError(
                f"a context of {n}: this model's learned positions end at {self.context_length}"
            )
        return self.replace(context_length=n)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ModelConfig:
        """Unknown keys are errors; keys of older versions (`attention_impl`) are dropped."""
        return from_dict(cls, {k: v for k, v in values.items() if k not in RETIRED})

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)


def from_dict(cls: type, values: dict[str, Any]) -> Any:
    """Build dataclass `cls` from `values`; unknown keys and wrong types are errors."""
    hints = get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ConfigError(
            f"unknown {cls.__name__} key(s): {', '.join(unknown)} "
            f"(known: {', '.join(sorted(names))})"
        )
    return cls(**{k: coerce(k, v, hints[k]) for k, v in values.items()})


def coerce(name: str, value: Any, hint: Any) -> Any:
    """Convert `value` (from TOML, JSON or a command-line string) to the field's type."""
    kinds = _kinds(hint)
    if value is None:
        if type(None) in kinds:
            return None
        raise ConfigError(f"{name} must not be empty")
    if isinstance(value, str) and str not in kinds:
        return _parse_string(name, value, kinds)
    for kind in kinds:
        if kind is bool and isinstance(value, bool):
            return value
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if kind is float and isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if kind is str and isinstance(value, str):
            return value
    expected = " or ".join(k.__name__ for k in kinds if k is not type(None))
    raise ConfigError(f"{name} must be {expected}, got {value!r}")


def _kinds(hint: Any) -> tuple[type, ...]:
    args = getattr(hint, "__args__", None)
    return tuple(args) if args else (hint,)


def _parse_string(name: str, text: str, kinds: tuple[type, ...]) -> Any:
    lowered = text.strip().lower()
    if type(None) in kinds and lowered in ("none", "null", ""):
        return None
    if bool in kinds:
        if lowered in ("true", "1", "yes", "on"):
            return True
        if lowered in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{name} must be true or false, got {text!r}")
    for kind in (int, float):
        if kind in kinds:
            try:
                return kind(text)
            except ValueError:
                continue
    expected = " or ".join(k.__name__ for k in kinds if k is not type(None))
    raise ConfigError(f"{name} must be {expected}, got {text!r}")


DEVICES = ("auto", "cpu", "cuda", "mps")
PRECISIONS = ("auto", "float32", "bfloat16")  # the training precision (autocast)
BAD_GRADIENT = ("skip", "stop")
SCHEDULES = ("cosine", "inverse-sqrt")
OPTIMIZERS = ("adamw", "muon")
WINDOWS = ("random", "documents")  # where a training window starts (`data/batches.py`)


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

    def __post_init__(self) -> None:
        for name in ("batch_size", "grad_accum", "max_steps", "eval_interval"):
            _check_positive(name, getattr(self, name))
        if not isinstance(self.eval_tokens, int) or self.eval_tokens < 0:
            raise ConfigError(
                f"eval_tokens must be an integer >= 0 (0 = the whole validation split), "
                f"got {self.eval_tokens!r}"
            )
        _check_positive("log_interval", self.log_interval)
        if self.checkpoint_interval is None:
            object.__setattr__(self, "checkpoint_interval", self.eval_interval)
        _check_positive("checkpoint_interval", self.checkpoint_interval)
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
        _check_choice("nonfinite_grad", self.nonfinite_grad, BAD_GRADIENT)
        _check_choice("schedule", self.schedule, SCHEDULES)
        _check_choice("optimizer", self.optimizer, OPTIMIZERS)
        if not 0 <= self.label_smoothing < 1:
            raise ConfigError(f"label_smoothing must be in [0, 1), got {self.label_smoothing!r}")
        if self.batch_tokens is not None:
            _check_positive("batch_tokens", self.batch_tokens)
        _check_choice("device", self.device, DEVICES)
        _check_choice("precision", self.precision, PRECISIONS)
        _check_choice("windows", self.windows, WINDOWS)

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
