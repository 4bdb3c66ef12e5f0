"""The serving engine: one thread steps a `Slots` batch; requests join and leave between steps.

A `Job` is one prompt with its n samples. `Engine.submit` queues it (or refuses with
`QueueFull` when the queue is at its bound); the engine thread adds its sequences to the
batch at the next step, turns each chosen token into text as it arrives (`StopText`,
holding back text that could still become a stop string), and hands every piece to the
job's `deliver` callback, from the engine thread. A job that ends early (a stop string,
`cancel` when its client goes away) gives its rows back before the next step. The batch
keeps a prefix cache (`inference/prefix_cache.py`): a prompt that begins as an earlier
text did (the conversation so far, a shared system prompt) prefills only the rest.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

from torch import nn

from tlm.device import placement
from tlm.generate import GenerationConfig, StopText
from tlm.generate.slots import Sequence, Slots
from tlm.inference.prefix_cache import PrefixCache, host_budget
from tlm.tokenizer import Tokenizer

PREFILL_CHUNK = 32  # tokens: docs/serve.md, "Chunked prefill", says how it was chosen


class QueueFull(Exception):
    """The queue of waiting requests is at its bound."""


@dataclass
class Event:
    """What a job's stream receives: one token of choice `index`, and the text it made final."""

    index: int
    text: str
    token: int | None = None
    logprob: float | None = None
    top: list[tuple[int, float]] = field(default_factory=list)
    finish_reason: str | None = None  # on the last event of a choice: "stop" or "length"
    error: str | None = None  # the engine could not run the job: what went wrong


@dataclass(eq=False)
class Job:
    prompt: list[int]
    config: GenerationConfig  # num_return_sequences is the job's n
    deliver: Callable[[Event | None], None]  # None: every choice has ended
    stop: tuple[str, ...] = ()
    seed: int | None = None
    top_logprobs: int = 0
    created: float = field(default_factory=time.perf_counter)
    choices: list[_Choice] = field(default_factory=list)


@dataclass(eq=False)
class _Choice:
    job: Job
    index: int
    sequence: Sequence
    text: StopText  # the choice's text so far, ended at a stop string
    last: float | None = None  # when its previous token came


class Engine:
    """Runs the batch in a daemon thread; `submit` and `cancel` are safe from any thread.

    `model` is the model, or a function that loads it, called in the engine thread. The
    thread makes its `Slots` (the KV cache) too, so that a server that loads its model this
    way runs every parallel torch operation on one thread: OpenMP keeps a pool of workers
    per thread that has run one, and with two pools on two cores its workers sleep between
    a step's parallel regions instead of spinning, a quarter to a third of a quiet
    machine's batch-1 speed (docs/benchmarks-history.md, "Goal 5"). A load's error is
    raised here."""

    def __init__(
        self,
        model: nn.Module | Callable[[], nn.Module],
        tokenizer: Tokenizer | None,  # None: set `tokenizer` before the first job
        slots: int = 4,
        max_queue: int = 64,
        on_token: Callable[[float | None, float | None], None] | None = None,
        speculate: dict | None = None,
        prefix_cache: int | None = None,
        prefill_chunk: int | None = PREFILL_CHUNK,
    ) -> None:
        self.tokenizer, self.max_queue = tokenizer, max_queue
        self.prefill_chunk = prefill_chunk  # while rows decode, a prefill's tokens a step
        self.prefix_budget = prefix_cache  # bytes; None: sized to the device once loaded
        self.speculate = speculate or {}  # GenerationConfig's draft settings, for every job
        self.on_token = on_token  # (time to first token, inter-token latency), for metrics
        self.lock = threading.Condition()
        self.incoming: list[Job] = []
        self.cancelled: list[Job] = []
        self.calls: list[tuple[Callable, Future]] = []
        self.choices: dict[Sequence, _Choice] = {}
        self.running = True
        self.slots: Slots
        ready: Future = Future()  # set once the engine thread has made self.slots
        work = (model, slots, ready)
        self.thread = threading.Thread(target=self._run, args=work, name="tlm-engine", daemon=True)
        self.thread.start()
        ready.result()  # the load's error, raised here

    @property
    def queued(self) -> int:
        """Sequences waiting for a row."""
        return len(self.slots.waiting) + sum(j.config.num_return_sequences for j in self.incoming)

    @property
    def busy(self) -> int:
        return self.slots.busy

    def submit(self, job: Job) -> None:
        with self.lock:
            if self.queued + job.config.num_return_sequences > self.max_queue:
                raise QueueFull(
                    f"{self.queued} sequences are waiting (the bound is {self.max_queue})"
                )
            self.incoming.append(job)
            self.lock.notify()

    def cancel(self, job: Job) -> None:
        with self.lock:
            self.cancelled.append(job)
            self.lock.notify()

    def call(self, fn: Callable) -> Future:
        """Run fn() in the engine thread between two steps (e.g. an inspection, which listens
        to the model's hook points and must not meet a decoding step); its result or error
        arrives in the future."""
        future: Future = Future()
        with self.lock:
            self.calls.append((fn, future))
            self.lock.notify()
        return future

    def close(self) -> None:
        with self.lock:
            self.running = False
            self.lock.notify()
        self.thread.join(timeout=5)

    def _run(self, model, slots: int, ready: Future) -> None:
        try:
            model = model if isinstance(model, nn.Module) else model()
            prefix = self._prefix_cache(model)
            self.slots = Slots(model, slots, prefix=prefix, prefill_chunk=self.prefill_chunk)
        except BaseException as error:  # noqa: BLE001 - raised in the constructor's thread
            ready.set_exception(error)
            return
        ready.set_result(None)
        while True:
            with self.lock:
                while self.running and not (self.incoming or self.cancelled or self.calls):
                    if not self.slots.idle():
                        break
                    self.lock.wait()
                if not self.running:
                    return
                incoming, self.incoming = self.incoming, []
                cancelled, self.cancelled = self.cancelled, []
                calls, self.calls = self.calls, []
            for fn, future in calls:
                try:
                    future.set_result(fn())
                except Exception as error:  # noqa: BLE001 - handed to the caller
                    future.set_exception(error)
            for job in incoming:
                try:
                    self._start(job)
                except Exception as error:  # noqa: BLE001 - the job fails, the engine goes on
                    self._fail([job], error)
            for job in cancelled:
                for choice in job.choices:
                    self._end(choice, None)
            if not self.slots.idle():
                try:
                    emitted_all = self.slots.step()
                except Exception as error:  # noqa: BLE001 - every running job fails, not the engine
                    running = {c.job for c in self.choices.values()}
                    self._fail(list(running), error)
                    continue
                for emitted in emitted_all:
                    choice = self.choices.get(emitted.sequence)
                    if choice is not None:
                        self._token(choice, emitted)

    def _prefix_cache(self, model: nn.Module) -> PrefixCache | None:
        """The cache of prompts' keys and values that requests share (none for a budget of
        0), sized to what the device has free once the model is loaded unless given."""
        budget = self.prefix_budget
        if budget is None:
            budget = host_budget(placement(model)[0])
        return PrefixCache(budget) if budget > 0 else None

    def _fail(self, jobs: list[Job], error: Exception) -> None:
        """Tell each job what went wrong and give its rows back; the engine thread goes on."""
        for job in jobs:
            for choice in job.choices:
                self.choices.pop(choice.sequence, None)
                self.slots.cancel(choice.sequence)
            job.deliver(Event(0, "", error=f"{type(error).__name__}: {error}"))
            job.deliver(None)

    def _start(self, job: Job) -> None:
        n = job.config.num_return_sequences
        config = replace(job.config, **self.speculate)  # a row drafts when it decodes alone
        for j in range(n):
            sequence = self.slots.add(job.prompt, config, j, job.seed, job.top_logprobs)
            choice = _Choice(job, j, sequence, StopText(self.tokenizer, job.stop))
            job.choices.append(choice)
            self.choices[sequence] = choice

    def _token(self, choice: _Choice, emitted) -> None:
        now = time.perf_counter()
        if self.on_token is not None:
            first = now - choice.job.created if choice.last is None else None
            gap = None if choice.last is None else now - choice.last
            self.on_token(first, gap)
        choice.last = now
        # this token's own end: a step that kept a draft emits several tokens of one row
        end = emitted.sequence.finish_reason if emitted.finished else None
        piece = "" if end == "eos" else choice.text.push(emitted.token)
        if choice.text.stopped:
            end = "stop"
        if end is not None:
            piece += choice.text.finish()
        event = Event(choice.index, piece, emitted.token, emitted.logprob, emitted.top)
        if end is not None:
            event.finish_reason = "stop" if end in ("eos", "stop") else "length"
        choice.job.deliver(event)
        if end is not None:
            self._end(choice, end)

    def _end(self, choice: _Choice, reason: str | None) -> None:
        """Give the choice's row back; once every choice of its job has ended, say so."""
        if self.choices.pop(choice.sequence, None) is None:
            return
        self.slots.cancel(choice.sequence)  # frees the row unless it has ended already
        if not any(c.sequence in self.choices for c in choice.job.choices):
            choice.job.deliver(None)
