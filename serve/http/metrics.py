"""GET /metrics: the server's counters in the Prometheus text format (prometheus_client, a registry of its own).

Names follow vLLM's (vllm:prompt_tokens_total, vllm:spec_decode_num_drafts_total, ...) under `draftsmith_`. Counters
are totals since the start: a scraper derives rates (throughput = rate of generation tokens). The pooled tau and
tokens per engine-second are gauges, computed when scraped.
"""

from __future__ import annotations

import threading

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    disable_created_metrics,
    generate_latest,
)

from draftsmith.serve.engine.generation import Generation
from draftsmith.serve.engine.metrics import Metrics

CONTENT_TYPE = CONTENT_TYPE_LATEST
LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, float("inf"))
PER_TOKEN = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, float("inf"))
TAU = (1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 8, float("inf"))
FINISH_REASONS = ("stop", "length", "abort", "error")


class ServeMetrics:
    def __init__(self, model: str, spec: str) -> None:
        disable_created_metrics()  # no *_created series: totals since the start are what a scraper reads
        r = self.registry = CollectorRegistry()
        self.pooled = Metrics(requests=0)  # every finished request's engine metrics, for the pooled gauges
        self.lock = threading.Lock()
        Info("draftsmith_server", "What this server runs", registry=r).info({"model": model, "spec": spec})
        self.requests = Counter(
            "draftsmith_requests",
            "Requests ended, by finish_reason (stop, length, abort, error)",
            ["finish_reason"],
            registry=r,
        )
        for reason in FINISH_REASONS:
            self.requests.labels(reason)
        self.prompt_tokens = Counter("draftsmith_prompt_tokens", "Prompt tokens of requests run", registry=r)
        self.generation_tokens = Counter("draftsmith_generation_tokens", "Tokens generated", registry=r)
        self.prefix_queried = Counter(
            "draftsmith_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache", registry=r
        )
        self.prefix_hit = Counter(
            "draftsmith_prefix_cache_hit_tokens", "Prompt tokens whose KV came from the prefix cache", registry=r
        )
        self.drafts = Counter("draftsmith_spec_decode_drafts", "Steps that verified a non-empty draft", registry=r)
        self.draft_tokens = Counter("draftsmith_spec_decode_draft_tokens", "Draft tokens verified", registry=r)
        self.accepted = Counter("draftsmith_spec_decode_accepted_tokens", "Draft tokens accepted", registry=r)
        self.passes = Counter("draftsmith_target_forward_passes", "Target forward passes after the prefill", registry=r)
        self.busy = Counter("draftsmith_engine_busy_seconds", "Seconds the engine spent on requests", registry=r)
        tau = Gauge(
            "draftsmith_spec_decode_mean_acceptance_length",
            "tau over every draft so far: 1 + accepted / drafts (the bonus token included); 1 before any draft",
            registry=r,
        )
        tau.set_function(lambda: self.read(lambda m: m.mean_acceptance_length))
        speed = Gauge(
            "draftsmith_generation_tokens_per_second",
            "Throughput: tokens generated per second the engine was busy, pooled over requests",
            registry=r,
        )
        speed.set_function(lambda: self.read(lambda m: m.tokens_per_s))
        self.waiting = Gauge("draftsmith_requests_waiting", "Requests queued for the engine", registry=r)
        self.running = Gauge("draftsmith_requests_running", "Requests the engine is running (0 or 1)", registry=r)
        self.queue_time = Histogram(
            "draftsmith_request_queue_time_seconds",
            "From arrival to the engine taking the request",
            buckets=LATENCY,
            registry=r,
        )
        self.ttft = Histogram(
            "draftsmith_time_to_first_token_seconds",
            "TTFT: from arrival to the first token (queueing included)",
            buckets=LATENCY,
            registry=r,
        )
        self.tpot = Histogram(
            "draftsmith_time_per_output_token_seconds",
            "TPOT: a request's decode time per token after its first",
            buckets=PER_TOKEN,
            registry=r,
        )
        self.e2e = Histogram(
            "draftsmith_e2e_request_latency_seconds", "From arrival to the last token", buckets=LATENCY, registry=r
        )
        self.request_tau = Histogram(
            "draftsmith_request_acceptance_length", "tau of each request that drafted", buckets=TAU, registry=r
        )

    def read(self, value) -> float:
        with self.lock:
            return value(self.pooled)

    def finished(self, g: Generation, reason: str, queued_s: float, ttft_s: float, e2e_s: float) -> None:
        """A request the engine ran (to its end, a stop string, or a client that left: reason abort)."""
        m = g.metrics
        with self.lock:
            self.pooled.merge(m)
        self.requests.labels(reason).inc()
        self.prompt_tokens.inc(m.prompt_tokens)
        self.generation_tokens.inc(m.new_tokens)
        self.prefix_queried.inc(m.prefix_queried_tokens)
        self.prefix_hit.inc(m.prefix_hit_tokens)
        self.drafts.inc(m.drafts)
        self.draft_tokens.inc(m.draft_tokens)
        self.accepted.inc(m.accepted_tokens)
        self.passes.inc(m.target_forward_passes)
        self.busy.inc(m.total_s)
        self.queue_time.observe(queued_s)
        self.ttft.observe(ttft_s)
        self.e2e.observe(e2e_s)
        if m.new_tokens > 1:
            self.tpot.observe(m.tpot_s)
        if m.drafts:
            self.request_tau.observe(m.mean_acceptance_length)

    def ended_early(self, reason: str) -> None:
        """A request the engine did not run to a Generation: its client left while it waited (abort), or the
        engine failed on it (error)."""
        self.requests.labels(reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
