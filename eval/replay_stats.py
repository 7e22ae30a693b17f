"""A replay log (eval/replay_log.py) -> its summary: requests ok and failed, throughput, latency and TTFT percentiles,
and τ and tokens/s overall and per window of W requests with 95% bootstrap intervals over the window's requests.
Two logs of the same stream (a frozen and an adapting drafter, say) -> B / A per window, paired on the same requests.

Counters are pooled as eval/stats.py pools them (sums, then ratios): τ = 1 + accepted / drafts (the `draftsmith`
field's definition, the bonus token included), tokens/s = completion tokens / the requests' latencies.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .replay_log import ReplayLog
from .replay_results import Comparison, LogSummary, Percentiles, ReplayResult, Window, WindowRatio
from .stats import Bootstrap, interval, ratio

SEED = 0  # resample seed of the whole log (window -1); window k draws with SEED + k + 1
Key = tuple  # (repeat, id, turn, occurrence): the same request of the stream in another log


def counters(r: dict) -> list[float]:
    d = r.get("draftsmith") or {}
    return [d.get("drafts") or 0, d.get("accepted_tokens") or 0, r["completion_tokens"] or 0, r["latency_s"] or 0]


def tau_and_rate(sums: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """τ and tokens/s of pooled counters ([..., 4]); NaN where undefined (no drafts, no time)."""
    drafts, accepted, tokens, latency = (sums[..., i] for i in range(4))
    return np.where(drafts > 0, 1 + ratio(accepted, drafts), np.nan), ratio(tokens, latency)


def resampled(table: np.ndarray, seed: int) -> np.ndarray | None:
    """Pooled counters of each bootstrap resample of the rows; None under two rows."""
    boot = Bootstrap.over(map(str, range(len(table))), seed)
    return boot.weights @ table if boot.enough else None


def number(x: float | np.ndarray) -> float | None:
    return float(x) if np.isfinite(x) else None


def window(index: int, first: int, rows: list[dict]) -> Window:
    ok = [r for r in rows if r["status"] == "ok"]
    table = np.array([counters(r) for r in ok], dtype=float).reshape(-1, 4)
    tau, rate = tau_and_rate(table.sum(0))
    samples = resampled(table, SEED + index + 1)
    taus, rates = tau_and_rate(samples) if samples is not None else (None, None)
    return Window(
        index,
        first,
        len(rows),
        len(ok),
        number(tau),
        None if taus is None else interval(taus),
        number(rate),
        None if rates is None else interval(rates),
    )


def percentiles(values: list[float]) -> Percentiles:
    if not values:
        return Percentiles(0, None, None, None, None)
    p50, p90, p99 = (float(v) for v in np.percentile(values, [50, 90, 99]))
    return Percentiles(len(values), float(np.mean(values)), p50, p90, p99)


def ttft(ok: list[dict]) -> tuple[Percentiles, str]:
    """The client's TTFT where the requests were streamed, else the server's (queueing included) where it says."""
    client = [r["ttft_s"] for r in ok if r.get("ttft_s") is not None]
    if client:
        return percentiles(client), "client (streamed: first text chunk)"
    server = [r["draftsmith"]["ttft_ms"] / 1000 for r in ok if (r.get("draftsmith") or {}).get("ttft_ms") is not None]
    return percentiles(server), "server (draftsmith.ttft_ms)" if server else "none"


def summarize(log: ReplayLog, label: str, size: int) -> LogSummary:
    rows = log.requests
    ok = [r for r in rows if r["status"] == "ok"]
    failures: dict[str, int] = {}
    for r in rows:
        if r["status"] != "ok":
            failures[r["status"]] = failures.get(r["status"], 0) + 1
    tokens = sum(r["completion_tokens"] or 0 for r in ok)
    duration = log.duration_s()
    ttft_s, source = ttft(ok)
    windows = [window(k, start, rows[start : start + size]) for k, start in enumerate(range(0, len(rows), size))]
    return LogSummary(
        label,
        log.path,
        log.runs,
        len(rows),
        len(ok),
        len(rows) - len(ok),
        failures,
        round(duration, 6),
        tokens,
        tokens / duration if duration > 0 else None,
        percentiles([r["latency_s"] for r in ok]),
        ttft_s,
        source,
        window(-1, 0, rows),
        windows,
    )


def keyed(rows: list[dict]) -> dict[Key, dict]:
    seen: dict[tuple, int] = {}
    out = {}
    for r in rows:
        base = (r.get("repeat", 0), r["id"], r.get("turn", 0))
        seen[base] = seen.get(base, -1) + 1
        out[base + (seen[base],)] = r
    return out


def paired(index: int, a: dict[Key, dict], b: dict[Key, dict]) -> WindowRatio:
    """B / A over the requests ok in both, each resample drawing the same requests from both logs."""
    keys = [k for k in a if k in b and a[k]["status"] == "ok" and b[k]["status"] == "ok"]
    ta, tb = (np.array([counters(x[k]) for k in keys], dtype=float).reshape(-1, 4) for x in (a, b))
    (tau_a, rate_a), (tau_b, rate_b) = tau_and_rate(ta.sum(0)), tau_and_rate(tb.sum(0))
    boot = Bootstrap.over(map(str, range(len(keys))), SEED + index + 1)
    tau_iv = rate_iv = None
    if boot.enough:
        (sa_tau, sa_rate), (sb_tau, sb_rate) = tau_and_rate(boot.weights @ ta), tau_and_rate(boot.weights @ tb)
        tau_iv, rate_iv = interval(ratio(sb_tau, sa_tau)), interval(ratio(sb_rate, sa_rate))
    return WindowRatio(
        index,
        len(keys),
        [number(tau_a), number(tau_b)],
        number(ratio(tau_b, tau_a)),
        tau_iv,
        [number(rate_a), number(rate_b)],
        number(ratio(rate_b, rate_a)),
        rate_iv,
    )


def compare(a: ReplayLog, b: ReplayLog, labels: list[str], size: int) -> Comparison:
    """Windows are A's (W requests in the order A sent them); B's requests are matched to them by key."""
    in_b = keyed(b.requests)
    rows = list(keyed(a.requests).items())
    windows = []
    for k, start in enumerate(range(0, len(rows), size)):
        windows.append(paired(k, dict(rows[start : start + size]), in_b))
    return Comparison(labels, paired(-1, dict(rows), in_b), windows)


def default_labels(paths: list[str]) -> list[str]:
    stems = [Path(p).stem for p in paths]
    return stems if len(set(stems)) == len(stems) else [f"{s}-{i}" for i, s in enumerate(stems)]


def replay_result(logs: list[ReplayLog], labels: list[str] | None, size: int) -> ReplayResult:
    if size < 1:
        raise ValueError(f"window must be >= 1 request, got {size}")
    if not 1 <= len(logs) <= 2:
        raise ValueError(f"replay= takes one log, or two to compare ([a.jsonl,b.jsonl]); got {len(logs)}")
    labels = list(labels) if labels else default_labels([log.path for log in logs])
    if len(labels) != len(logs):
        raise ValueError(f"replay_labels names {len(labels)} logs but replay= gives {len(logs)}: one label each")
    summaries = [summarize(log, label, size) for log, label in zip(logs, labels, strict=True)]
    comparison = compare(logs[0], logs[1], labels, size) if len(logs) == 2 else None
    return ReplayResult(size, summaries, comparison)
