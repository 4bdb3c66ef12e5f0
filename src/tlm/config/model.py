"""`ModelConfig`: the shape and the choices of a transformer, frozen and validated."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from tlm.config.fields import ConfigError, check_choice, check_positive, from_dict

MODEL_TYPES = ("decoder", "encoder-decoder", "encoder")
NORMS = ("pre", "post")
POSITIONS = ("learned", "sinusoidal", "rope", "none")
ROPE_SCALINGS = ("linear", "ntk", "dynamic", "yarn")  # model/positions.py: rotary_frequencies
ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "relu2")
TASKS = ("classify", "tag")  # an encoder's fine-tuned head (`model/encoder.py`)
DROPOUTS = ("dropout", "attn_dropout", "resid_dropout", "embd_dropout")
RETIRED = {"attention_impl"}  # read from old config files and ignored


@dataclass(frozen=True)
class ModelConfig:
    """The shape and the choices of a transformer: a decoder-only LM (J&M ch. 9), or the
    encoder-decoder of Vaswani et al. 2017 (`model_type="encoder-decoder"`), or a
    bidirectional encoder with a masked-LM head (J&M ch. 11, `model_type="encoder"`).

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

    An encoder's head is the masked-LM head, or after fine-tuning (`task`) a classifier of
    the whole input ("classify", from [CLS]) or of each token ("tag"), whose outputs are
    `labels` in order. With `nsp` a pretraining encoder has a second head, next-sentence
    prediction's, on [CLS] through BERT's pooler (§11.2.2).

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
    task: str | None = None  # an encoder's head: None (masked LM), classify or tag
    labels: tuple[str, ...] | None = None  # the head's classes, in the order of its outputs
    nsp: bool = False  # a pretraining encoder's next-sentence head beside its MLM head

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "context_length"):
            check_positive(name, getattr(self, name))
        if self.d_head is None:
            if self.d_model % self.n_heads != 0:
                raise ConfigError(
                    f"n_heads ({self.n_heads}) must divide d_model ({self.d_model}) "
                    "unless d_head is given"
                )
            object.__setattr__(self, "d_head", self.d_model // self.n_heads)
        check_positive("d_head", self.d_head)
        if self.d_ff is None:
            object.__setattr__(self, "d_ff", 4 * self.d_model)
        check_positive("d_ff", self.d_ff)
        check_choice("model_type", self.model_type, MODEL_TYPES)
        if self.model_type != "encoder-decoder" and self.n_encoder_layers is not None:
            raise ConfigError("n_encoder_layers applies to model_type='encoder-decoder'")
        if self.model_type == "encoder" and self.attention_window is not None:
            raise ConfigError("an attention window is causal; an encoder's queries see every key")
        if self.task is not None:
            check_choice("task", self.task, TASKS)
            if self.model_type != "encoder":
                raise ConfigError(f"task {self.task} is an encoder's head (model_type='encoder')")
            if not self.labels or len(set(self.labels)) != len(self.labels):
                raise ConfigError(
                    f"task {self.task} needs its labels, each once; got {self.labels!r}"
                )
        elif self.labels is not None:
            raise ConfigError("labels name the classes of an encoder's task head (task=...)")
        if self.nsp and (self.model_type != "encoder" or self.task is not None):
            raise ConfigError("nsp is a pretraining encoder's head (model_type='encoder', no task)")
        if self.model_type == "encoder-decoder":
            if self.n_encoder_layers is None:
                object.__setattr__(self, "n_encoder_layers", self.n_layers)
            check_positive("n_encoder_layers", self.n_encoder_layers)
            if self.position == "rope":
                raise ConfigError(
                    "an encoder-decoder takes absolute positions (sinusoidal or learned), "
                    "not rope: a target and a source position have no distance"
                )
        check_choice("norm", self.norm, NORMS)
        check_choice("position", self.position, POSITIONS)
        check_choice("activation", self.activation, ACTIVATIONS)
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
            check_choice("rope_scaling", self.rope_scaling, ROPE_SCALINGS)
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
            check_positive("rope_original_context", self.rope_original_context)
        if self.attention_window is not None:
            check_positive("attention_window", self.attention_window)
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
