"""95% intervals for every pooled number: a percentile bootstrap over prompts.

A unit is one prompt with all its turns and repeats (repeats of a prompt share its length and difficulty, so
they are resampled together). Each resample pools counters exactly as the point estimate does (sums, then
ratios; never means of means). Paired statistics (speedup, the study's ratios) draw the method's and plain
decoding's sums from the same resampled prompts.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from draftsmith.serve.engine.metrics import Metrics

RESAMPLES = 2000
LEVEL = 0.95
FIELDS = ("new_tokens", "total_s", "ttft_s", "requests", "drafts", "draft_tokens", "accepted_tokens")

Interval = list[float] | None  # [low, high]; None where fewer than two prompts or nothing to measure
Sums = dict[str, np.ndarray]  # field -> [resamples] pooled sums


@dataclass
class Bootstrap:
    """Resampling weights over prompt ids: row b says how often each prompt is drawn in resample b."""

    ids: list[str]
    weights: np.ndarray  # [RESAMPLES, len(ids)]

    @classmethod
    def over(cls, ids: Iterable[str], seed: int) -> Bootstrap:
        ids = list(dict.fromkeys(ids))
        n = len(ids)
        rng = np.random.default_rng(seed)
        weights = rng.multinomial(n, [1 / n] * n, size=RESAMPLES) if n else np.zeros((RESAMPLES, 0))
        return cls(ids, weights.astype(np.float64))

    def sums(self, records: Iterable, positions: int = 0) -> Sums:
        """Pooled counters of `records` (anything with .id and .metrics) in every resample, plus the first
        `positions` entries of accepted_per_position as pos1, pos2, ..."""
        where = {pid: i for i, pid in enumerate(self.ids)}
        names = [*FIELDS, *(f"pos{i + 1}" for i in range(positions))]
        per_unit = np.zeros((len(self.ids), len(names)))
        for r in records:
            per_unit[where[r.id]] += counters(r.metrics, positions)
        pooled = self.weights @ per_unit
        return {name: pooled[:, j] for j, name in enumerate(names)}

    @property
    def enough(self) -> bool:
        return len(self.ids) >= 2


def counters(m: Metrics, positions: int) -> list[float]:
    pos = m.accepted_per_position[:positions]
    return [float(getattr(m, f)) for f in FIELDS] + pos + [0.0] * (positions - len(pos))


def interval(samples: np.ndarray) -> Interval:
    """The central LEVEL share of the finite resampled values."""
    ok = samples[np.isfinite(samples)]
    if ok.size < RESAMPLES // 2:  # most resamples undefined (e.g. no drafts): no interval
        return None
    tail = 100 * (1 - LEVEL) / 2
    low, high = np.percentile(ok, [tail, 100 - tail])
    return [float(low), float(high)]


def ratio(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b != 0, a / np.where(b != 0, b, 1), np.nan)


def tokens_per_s(s: Sums) -> np.ndarray:
    return ratio(s["new_tokens"], s["total_s"])


def summary_samples(s: Sums) -> dict[str, np.ndarray]:
    """The resampled counterpart of aggregate.method_summary's numbers."""
    return {
        "tokens_per_s": tokens_per_s(s),
        "ttft_ms": 1000 * ratio(s["ttft_s"], s["requests"]),
        "tpot_ms": 1000 * ratio(s["total_s"] - s["ttft_s"], s["new_tokens"] - s["requests"]),
        "total_ms": 1000 * ratio(s["total_s"], s["requests"]),
        "mean_acceptance_length": np.where(s["drafts"] > 0, 1 + ratio(s["accepted_tokens"], s["drafts"]), np.nan),
        "draft_acceptance_rate": ratio(s["accepted_tokens"], s["draft_tokens"]),
    }


def intervals(boot: Bootstrap, records: list, positions: int = 0) -> dict[str, Interval | list[Interval]]:
    """Intervals of a method's summary numbers, and of its per-position acceptance when positions > 0."""
    if not boot.enough:
        return {}
    s = boot.sums(records, positions)
    out: dict[str, Interval | list[Interval]] = {k: interval(v) for k, v in summary_samples(s).items()}
    if positions:
        out["acceptance_rate_per_position"] = [interval(ratio(s[f"pos{i + 1}"], s["drafts"])) for i in range(positions)]
    return out


def position_intervals(method) -> list:
    """A method result's (results.Summary) per-position acceptance intervals, one per reported rate (None where it
    has none: a lookup paired with a head drafts deeper than the head's depth the intervals were taken over)."""
    rates = method.acceptance_rate_per_position
    ivs = method.interval("acceptance_rate_per_position") or []
    return (list(ivs) + [None] * len(rates))[: len(rates)]


def speedup_interval(boot: Bootstrap, records: list, base: list) -> Interval:
    """tokens/s of the method over tokens/s of plain decoding, both pooled over the same resampled prompts."""
    if not boot.enough:
        return None
    return interval(ratio(tokens_per_s(boot.sums(records)), tokens_per_s(boot.sums(base))))


def significant(iv: Interval, null: float = 1.0) -> bool | None:
    """True when the interval excludes `null` (no effect); None when there is no interval."""
    return None if iv is None else not (iv[0] <= null <= iv[1])


def spread(values: list[float]) -> float:
    """(max - min) / median of one prompt's repeated measurements."""
    mid = float(np.median(values))
    return (max(values) - min(values)) / mid if mid else 0.0
