"""The typed results of draftsmith-eval replay=LOG (DIR/replay_results.json): each log's summary and windows, and
for two logs their window-by-window ratios. Intervals are 95% bootstrap intervals over requests ([low, high] or
None where too few)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from .results import to_json
from .stats import Interval

REPLAY_SCHEMA = 1


@dataclass
class Percentiles:
    n: int  # the requests measured
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None


@dataclass
class Window:
    """Requests first .. first + requests - 1 of a log, in the order they were sent."""

    index: int
    first: int
    requests: int
    ok: int
    tau: float | None  # 1 + accepted / drafts, pooled over the window's requests
    tau_interval: Interval
    tokens_per_s: float | None  # completion tokens over the requests' latencies, pooled
    tokens_per_s_interval: Interval


@dataclass
class LogSummary:
    label: str
    path: str
    runs: list[dict]  # each run's header: base_url, model, rate, seed, start time, ...
    requests: int
    ok: int
    failed: int
    failures: dict[str, int]  # status -> requests ("http 503", "connection error")
    duration_s: float  # the runs' wall time
    completion_tokens: int
    throughput_tokens_per_s: float | None  # completion tokens over the runs' wall time
    latency_s: Percentiles
    ttft_s: Percentiles
    ttft_source: str  # client (streamed, first text chunk) | server (draftsmith.ttft_ms) | none
    overall: Window  # every request as one window
    windows: list[Window]


@dataclass
class WindowRatio:
    """B over A on the same requests of the stream (matched by id, turn and repeat), both resampled together."""

    index: int
    paired: int  # requests ok in both logs
    tau: list[float | None]  # [A, B]
    tau_ratio: float | None
    tau_ratio_interval: Interval
    tokens_per_s: list[float | None]
    tokens_per_s_ratio: float | None
    tokens_per_s_ratio_interval: Interval


@dataclass
class Comparison:
    labels: list[str]  # [A, B]: ratios are B / A
    overall: WindowRatio
    windows: list[WindowRatio]


@dataclass
class ReplayResult:
    window: int  # requests per window
    logs: list[LogSummary]
    comparison: Comparison | None = None
    schema_version: int = REPLAY_SCHEMA
    kind: str = field(default="replay")


def dump_replay(result: ReplayResult) -> str:
    return json.dumps(to_json(result), indent=2) + "\n"
