"""`GET /metrics`: Prometheus text from `prometheus_client`, in a registry of the server's own."""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

PREFIX_SERIES = {  # the prefix cache's series: since the server started, and now
    "lookups": "prompts that looked for a cached prefix",
    "hits": "prompts that reused at least one cached block",
    "tokens_reused": "prompt tokens taken from the cache, not prefilled",
    "stored": "blocks of keys and values kept",
    "evicted": "blocks evicted for room (least recently used first)",
    "blocks": "blocks held now",
    "bytes": "bytes held now",
}
LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "tlm_requests", "HTTP requests by path and status", ["path", "status"], registry=r
        )
        self.prompt_tokens = Counter("tlm_prompt_tokens", "prompt tokens received", registry=r)
        self.generated_tokens = Counter("tlm_generated_tokens", "tokens generated", registry=r)
        self.queue_depth = Gauge("tlm_queue_depth", "sequences waiting for a slot", registry=r)
        self.busy_slots = Gauge("tlm_busy_slots", "slots decoding a sequence", registry=r)
        self.time_to_first_token = Histogram(
            "tlm_time_to_first_token_seconds",
            "from request to its first token",
            buckets=LATENCY,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "tlm_inter_token_latency_seconds",
            "between consecutive tokens of a sequence",
            buckets=LATENCY,
            registry=r,
        )
        self.drafted = Gauge("tlm_draft_tokens", "tokens drafted (speculative)", registry=r)
        self.kept = Gauge("tlm_draft_kept_tokens", "drafted tokens the model kept", registry=r)
        self.checks = Gauge("tlm_draft_checks", "steps that checked a draft", registry=r)
        self.acceptance = Gauge(
            "tlm_draft_acceptance", "share of drafted tokens kept (0 before any)", registry=r
        )
        self.per_check = Gauge(
            "tlm_draft_tokens_per_step",
            "tokens a step that checked a draft gave, on average (kept + 1; 0 before any)",
            registry=r,
        )

        self.prefilled = Gauge(
            "tlm_prefill_tokens", "prompt tokens computed (not taken from the prefix cache)",
            registry=r,
        )  # fmt: skip
        self.prefix = {
            name: Gauge(f"tlm_prefix_cache_{name}", about, registry=r)
            for name, about in PREFIX_SERIES.items()
        }

    def watch(self, engine) -> None:
        self.queue_depth.set_function(lambda: engine.queued)
        self.busy_slots.set_function(lambda: engine.busy)
        self.drafted.set_function(lambda: engine.slots.drafted)
        self.kept.set_function(lambda: engine.slots.accepted)
        self.checks.set_function(lambda: engine.slots.checks)
        slots = engine.slots
        self.acceptance.set_function(lambda: slots.accepted / slots.drafted if slots.drafted else 0)
        self.per_check.set_function(
            lambda: (slots.accepted + slots.checks) / slots.checks if slots.checks else 0
        )
        self.prefilled.set_function(lambda: slots.prefilled)
        cache = slots.prefix
        held = {"blocks": lambda: len(cache), "bytes": lambda: cache.bytes}
        for name, gauge in self.prefix.items():
            if cache is None:
                gauge.set(0)
            else:
                gauge.set_function(held.get(name, lambda name=name: getattr(cache.counts, name)))

    def on_token(self, first: float | None, gap: float | None) -> None:
        if first is not None:
            self.time_to_first_token.observe(first)
        if gap is not None:
            self.inter_token_latency.observe(gap)

    def render(self) -> bytes:
        return generate_latest(self.registry)
