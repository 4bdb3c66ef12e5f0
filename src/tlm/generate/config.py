"""How to decode: one `GenerationConfig`, built the same way from every entry point.

The names are the ones the Hugging Face ecosystem uses. `GenerationConfig.of(...)` is the
one conversion from a request (the command line, `TransformerLM.generate`, the HTTP API):
a setting left out (None) takes the default here, so every entry point has one set of
defaults, and temperature 0 means greedy wherever it is given (`greedy`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from tlm.generate.constrain import Grammar
from tlm.generate.errors import GenerationError


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 100
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float = 1.0
    num_beams: int = 1
    length_penalty: float = 1.0
    num_return_sequences: int = 1
    eos_token_id: int | tuple[int, ...] | None = None
    seed: int | None = None
    use_cache: bool = True
    cuda_graph: bool = True  # on a GPU, each cached step one replay of a recorded CUDA graph
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias); a dict is accepted
    best_of: int | None = None
    grammar: Grammar | None = None  # structured outputs: a JSON schema, regex or Lark grammar
    prompt_lookup: int | None = None  # speculative: drafts from the text's n-grams, n <= this
    draft_tokens: int = 5  # speculative: the most tokens a draft proposes for one check
    draft: object = None  # speculative: a draft model, or "int8" (the target's own weights)

    def __post_init__(self) -> None:
        if isinstance(self.logit_bias, dict):  # frozen: the one normal form, sorted pairs
            pairs = tuple(sorted((int(t), float(b)) for t, b in self.logit_bias.items()))
            object.__setattr__(self, "logit_bias", pairs)
        rules = {
            "max_new_tokens": (self.max_new_tokens >= 0, ">= 0"),
            "temperature": (self.temperature >= 0, ">= 0"),
            "top_k": (self.top_k is None or self.top_k >= 1, ">= 1"),
            "top_p": (self.top_p is None or 0 < self.top_p <= 1, "in (0, 1]"),
            "repetition_penalty": (self.repetition_penalty > 0, "> 0"),
            "num_beams": (self.num_beams >= 1, ">= 1"),
            "num_return_sequences": (self.num_return_sequences >= 1, ">= 1"),
            "frequency_penalty": (-2 <= self.frequency_penalty <= 2, "in [-2, 2]"),
            "presence_penalty": (-2 <= self.presence_penalty <= 2, "in [-2, 2]"),
            "logit_bias": (
                all(t >= 0 and -100 <= b <= 100 for t, b in self.logit_bias),
                "token ids >= 0 with biases in [-100, 100]",
            ),
            "prompt_lookup": (self.prompt_lookup is None or self.prompt_lookup >= 1, ">= 1"),
            "draft_tokens": (self.draft_tokens >= 1, ">= 1"),
            "best_of": (
                self.best_of is None or self.best_of >= self.num_return_sequences,
                ">= num_return_sequences (the best of that many candidates are returned)",
            ),
        }
        for name, (ok, allowed) in rules.items():
            if not ok:
                raise GenerationError(f"{name} must be {allowed}, got {getattr(self, name)}")
        if self.num_beams > 1 and self.do_sample:
            raise GenerationError("beam search is deterministic: use num_beams=1 to sample")
        if self.num_beams > 1 and self.grammar is not None:
            raise GenerationError(
                "a grammar constrains greedy decoding and sampling: use num_beams=1"
            )
        if self.num_beams > 1 and self.adjusts_logits:
            raise GenerationError(
                "repetition_penalty, frequency_penalty, presence_penalty and logit_bias apply "
                "to greedy decoding and sampling"
            )
        if self.num_beams > 1 and (self.best_of or 1) > 1:
            raise GenerationError("best_of chooses among samples: use num_beams=1")
        if self.num_beams > 1 and self.num_return_sequences > 1:
            raise GenerationError("beam search returns one sequence per prompt")
        if self.num_beams > 1 and (self.prompt_lookup or self.draft is not None):
            raise GenerationError("drafts speed up greedy decoding and sampling: num_beams=1")
        if self.prompt_lookup and self.draft is not None:
            raise GenerationError("one draft at a time: prompt_lookup or draft")
        if isinstance(self.draft, str) and self.draft != "int8":
            raise GenerationError(f"draft must be a model or 'int8', got {self.draft!r}")

    @classmethod
    def of(cls, **settings) -> GenerationConfig:
        """The config of a request: a setting given as None takes its default."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise GenerationError(f"no generation setting {unknown[0]!r}")
        return cls(**{name: value for name, value in settings.items() if value is not None})

    def candidates(self) -> tuple[GenerationConfig, int]:
        """(the config that decodes every candidate, how many of each prompt's to keep):
        with `best_of` m, m samples of each prompt are drawn, of which the
        num_return_sequences of highest total log-probability are kept (`best_rows`). The one
        place `best_of` becomes candidates (`model.generate`, `complete`, the server)."""
        keep = self.num_return_sequences
        drawn = max(keep, self.best_of or keep)
        return replace(self, num_return_sequences=drawn, best_of=None), keep

    @property
    def adjusts_logits(self) -> bool:
        """Whether the model's logits change before the choice (`sampling.adjust_logits`)."""
        return bool(
            self.grammar is not None
            or self.repetition_penalty != 1.0
            or self.frequency_penalty
            or self.presence_penalty
            or self.logit_bias
        )

    @property
    def counts_output(self) -> bool:
        """Whether the choice needs each token's count in the output so far."""
        return bool(self.frequency_penalty or self.presence_penalty)

    @property
    def greedy(self) -> bool:
        """Argmax decoding: without sampling, or sampling at temperature 0 (its limit)."""
        return not self.do_sample or self.temperature == 0

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """The end tokens; with a grammar, its tokenizer's `<|endoftext|>` among them (the
        one token a complete output allows)."""
        given = self.eos_token_id
        ids = () if given is None else (given,) if isinstance(given, int) else tuple(given)
        if self.grammar is not None and self.grammar.eos_id not in ids:
            ids = (*ids, self.grammar.eos_id)
        return ids
