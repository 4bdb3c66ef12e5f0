"""tlm models inside EleutherAI's lm-evaluation-harness (`pip install "tlm[eval]"`).

`TlmLM` is an `lm_eval.api.model.LM`, registered as "tlm", so `lm_eval --model tlm
--model_args pretrained=RUN` and `lm_eval.simple_evaluate(model=TlmLM(RUN))` both score a
run (or a Hugging Face GPT-2 / GPT-NeoX directory) directly, on any decoder tlm trains. It
conditions as lm-eval's `hf` backend does, so that its figures compare with published ones:
a non-empty context is read as it is (no <|endoftext|> before it), an empty one as
<|endoftext|>; a continuation's tokens are those of context + continuation after the
context's; rolling log-likelihoods use lm-eval's own windows (each the model's context long,
the first after <|endoftext|>).

A character model cannot spell a character its corpus never held: a continuation with one
has probability 0 (log-likelihood -inf, never greedy), a document with one likewise, and a
context or prompt is read without them (the model has no way to see them).
"""

from __future__ import annotations

import copy
import json
import math

import lm_eval.models  # noqa: F401  lm-eval's own models first: its registry fills lazily when empty
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from tlm.errors import UserError
from tlm.generate import GenerationConfig
from tlm.generate.text import complete_tokens
from tlm.load import load_language_model, load_tokenizer, source_of
from tlm.tasks.score import score_tokens, split_at_context
from tlm.tokenizer import CharTokenizer


@register_model("tlm")
class TlmLM(LM):
    def __init__(
        self,
        pretrained: str,
        weights: str = "latest",
        batch_size: int | str = 16,
        device: str | None = None,
        **_: object,  # lm-eval's own settings (max_batch_size, ...) that tlm does not need
    ) -> None:
        super().__init__()
        source = source_of(pretrained)  # its kind decided once
        self.model = load_language_model(source, device or "cpu", weights=weights)
        self.tokenizer = load_tokenizer(source)
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 16
        self.context = self.model.config.context_length
        chars = isinstance(self.tokenizer, CharTokenizer)
        self.alphabet = set(self.tokenizer.chars) if chars else None

    def _readable(self, text: str) -> str:
        """`text` without the characters a character vocabulary lacks (BPE spells any text)."""
        if self.alphabet is None or set(text) <= self.alphabet:
            return text
        return "".join(c for c in text if c in self.alphabet)

    def _pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """lm-eval's split: the context's trailing spaces go with the continuation; the
        context is its own tokens and the continuation the whole's tokens after as many (so
        a token that merges across the seam is split as lm-eval's hf backend splits it); an
        empty context is <|endoftext|>. Longer than the model's context: the oldest go."""
        context, continuation = split_at_context(context, continuation)
        if context:  # the context's own tokens, even where the whole merges across the seam
            ctx = self.tokenizer.encode(context)
            cont = self.tokenizer.encode(context + continuation)[len(ctx) :]
        else:
            ctx, cont = [self.tokenizer.eot_id], self.tokenizer.encode(continuation)
        keep = self.context + 1 - len(cont)  # tokens the window holds before the continuation
        return ctx[-max(keep, 1) :], cont[-self.context :]

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        out: list[tuple[float, bool]] = [(-math.inf, False)] * len(requests)  # unspellable
        scored = [i for i, r in enumerate(requests) if self._readable(r.args[1]) == r.args[1]]
        pairs = [
            self._pair(self._readable(requests[i].args[0]), requests[i].args[1]) for i in scored
        ]
        for i, (logprobs, greedy) in zip(scored, score_tokens(self.model, pairs), strict=True):
            out[i] = (sum(logprobs), greedy)
        return out

    def loglikelihood_rolling(self, requests) -> list[float]:
        out = []
        for request in requests:
            if self._readable(request.args[0]) != request.args[0]:
                out.append(-math.inf)  # a character the model cannot spell
                continue
            tokens = self.tokenizer.encode(request.args[0])
            windows = get_rolling_token_windows(
                token_list=tokens, prefix_token=self.tokenizer.eot_id,
                max_seq_len=self.context, context_len=1,
            )  # fmt: skip
            pairs = [make_disjoint_window(w) for w in windows]
            out.append(sum(sum(lp) for lp, _ in score_tokens(self.model, pairs)))
        return out

    def generate_until(self, requests) -> list[str]:
        """Greedy (or sampled, as gen_kwargs say) up to a stop string or max_gen_toks, in
        batches of requests with the same settings, through tlm's one decoding core."""
        groups: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            key = json.dumps(request.args[1], sort_keys=True, default=str)
            groups.setdefault(key, []).append(i)
        out: list[str] = [""] * len(requests)
        for indices in groups.values():
            settings = requests[indices[0]].args[1]
            until = settings.get("until") or []
            until = (until,) if isinstance(until, str) else tuple(until)
            config = GenerationConfig.of(
                max_new_tokens=int(settings.get("max_gen_toks", 256)),
                do_sample=bool(settings.get("do_sample", False)),
                temperature=float(settings.get("temperature") or 0.0),
                eos_token_id=self.tokenizer.eot_id,
            )
            room = self.context - config.max_new_tokens  # the prompt's share of the window
            for start in range(0, len(indices), self.batch_size):
                batch = indices[start : start + self.batch_size]
                rows = [self._prompt(requests[i].args[0], room) for i in batch]
                done = complete_tokens(self.model, self.tokenizer, rows, config, until)
                for i, completion in zip(batch, done, strict=True):
                    out[i] = completion.text
        return out

    def _prompt(self, context: str, room: int) -> list[int]:
        context = self._readable(context)
        ids = self.tokenizer.encode(context) if context else [self.tokenizer.eot_id]
        return ids[-max(room, 1) :]


def harness_evaluate(
    run: str,
    tasks: list[str],
    include_path: str | None = None,
    limit: float | None = None,
    num_fewshot: int | None = None,
    batch_size: int = 16,
    output_path: str | None = None,
    weights: str = "latest",
    device: str | None = None,
) -> dict:
    """lm-eval's `simple_evaluate` on a tlm model (on `device`: a torch device name, None
    the CPU), its results as lm-eval returns them; with
    `output_path`, written there as `lm_eval --output_path P --log_samples` writes them
    (the aggregated results and one samples file per task)."""
    from lm_eval import simple_evaluate
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=include_path)
    unknown = [task for task in tasks if task not in manager.all_tasks]
    if unknown:
        raise HarnessError(
            f"lm-eval has no task {unknown[0]!r}" + ("" if include_path else " (--include-path?)")
        )
    tracker = EvaluationTracker(output_path=output_path) if output_path else None
    results = simple_evaluate(
        model=TlmLM(run, weights=weights, batch_size=batch_size, device=device),
        tasks=tasks,
        num_fewshot=num_fewshot,
        limit=limit,
        log_samples=output_path is not None,
        evaluation_tracker=tracker,
        task_manager=manager,
    )
    if tracker is not None:  # it rewrites what it saves: a copy, so the results stay as they are
        samples = results.pop("samples")
        tracker.save_results_aggregated(results=copy.deepcopy(results), samples=samples)
        for task in results["configs"]:
            tracker.save_results_samples(task_name=task, samples=copy.deepcopy(samples[task]))
        results["samples"] = samples
    return results


class HarnessError(UserError):
    """A task lm-eval does not know, or a model it cannot score."""
