"""Per-request records -> summaries: overall, per category, per prompt; counters pooled, never means of means,
each pooled number with its 95% interval (eval/stats.py)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from draftsmith.serve.engine.metrics import Metrics

from .results import CategoryResult, Compared, Lossless, RepeatSpread, Summary
from .stats import Bootstrap, intervals, significant, speedup_interval, spread


@dataclass
class Record:
    """One answered turn of one prompt by one method (in one repeat, with or without the prefix cache)."""

    id: str
    category: str
    turn: int
    repeat: int
    method: str  # "ar" or a method label
    prefix_cache: bool
    output_ids: list[int]
    text: str
    metrics: Metrics


def pool(records: Iterable[Record]) -> Metrics:
    total = Metrics(requests=0)
    for r in records:
        total.merge(r.metrics)
    return total


def method_summary(name: str, m: Metrics) -> dict:
    return {
        "method": name,
        "tokens_per_s": m.tokens_per_s,
        "ttft_ms": 1000 * m.mean_ttft_s,
        "tpot_ms": 1000 * m.tpot_s,
        "total_ms": 1000 * m.total_s / m.requests if m.requests else 0.0,
        "new_tokens": m.new_tokens,
        "mean_acceptance_length": m.mean_acceptance_length,
        "acceptance_rate_per_position": m.acceptance_rate_per_position,
        "draft_acceptance_rate": m.draft_acceptance_rate,
        "drafts": m.drafts,
        "draft_tokens": m.draft_tokens,
        "accepted_tokens": m.accepted_tokens,
        "target_forward_passes": m.target_forward_passes,
        "mean_verify_rows": m.mean_verify_rows,
        "verify_rows": m.verify_rows,
        "draft_ms_per_step": m.draft_ms_per_step,
        "requests": m.requests,
        "prefix_cache_hit_rate": m.prefix_hit_tokens / m.prefix_queried_tokens if m.prefix_queried_tokens else 0.0,
        "steps": {"plain": m.plain_steps, "probe": m.probe_steps, "whole": m.whole_steps, "cut": m.cut_steps},
        "calibration": m.calibration,
    }


def speedup(m: Metrics, base: Metrics) -> float:
    return m.tokens_per_s / base.tokens_per_s if base.tokens_per_s else 0.0


def summary(name: str, records: list[Record], boot: Bootstrap, positions: int = 0) -> Summary:
    """method_summary with its intervals (none with fewer than two prompts)."""
    return Summary(**method_summary(name, pool(records)), intervals=intervals(boot, records, positions))


def compared(name: str, records: list[Record], base: list[Record], seed: int = 0, positions: int = 0) -> Compared:
    """A method's summary with its speedup over plain decoding on the same turns (a turn one of them skipped
    counts for neither), each with its interval; `significant`: the speedup's interval excludes 1.0."""
    records, base = paired(records, base)
    boot = Bootstrap.over([r.id for r in base + records], seed)
    out = summary(name, records, boot, positions)
    out.intervals["speedup"] = speedup_interval(boot, records, base)
    return Compared(
        **vars(out), speedup=speedup(pool(records), pool(base)), significant=significant(out.intervals["speedup"])
    )


def paired(records: list[Record], base: list[Record]) -> tuple[list[Record], list[Record]]:
    """Both sides restricted to the (prompt, turn, repeat) both answered."""
    both = {key(r) for r in records} & {key(r) for r in base}
    return [r for r in records if key(r) in both], [r for r in base if key(r) in both]


def key(r: Record) -> tuple[str, int, int]:
    return r.id, r.turn, r.repeat


def of(records: list[Record], method: str, **where) -> list[Record]:
    return [r for r in records if r.method == method and all(getattr(r, k) == v for k, v in where.items())]


def lossless(base: list[Record], records: list[Record], greedy: bool) -> Lossless:
    """Greedy outputs compared token for token with plain decoding's, turn by turn."""
    if not greedy:
        return Lossless(0, 0, "sampling: equality not expected (see distribution_check)")
    ar = {(r.id, r.turn, r.repeat): r.output_ids for r in base}
    pairs = [(ar[(r.id, r.turn, r.repeat)], r.output_ids) for r in records if (r.id, r.turn, r.repeat) in ar]
    return Lossless(len(pairs), sum(a == b for a, b in pairs), "greedy: token-for-token vs plain decoding")


def speedup_per_repeat(records: list[Record], base: list[Record], repeats: int) -> list[float]:
    """One method's speedup in each repeat alone: the spread shows how steady the machine was."""
    return [
        speedup(pool(r for r in records if r.repeat == i), pool(r for r in base if r.repeat == i))
        for i in range(repeats)
    ]


def by_category(records: list[Record], labels: list[str], seed: int = 0) -> dict[str, CategoryResult]:
    out = {}
    for cat in sorted({r.category for r in records}):
        rows = [r for r in records if r.category == cat]
        base = of(rows, "ar")
        out[cat] = CategoryResult(
            prompts=len({r.id for r in rows}),
            baseline=summary("ar", base, Bootstrap.over([r.id for r in base], seed)),
            methods={label: compared(label, of(rows, label), base, seed) for label in labels},
        )
    return out


def repeat_spread(records: list[Record]) -> RepeatSpread | None:
    """How much the time per new token of the same prompt varied between repeats: with identical work (greedy)
    this is the machine's own noise. None with a single repeat."""
    times: dict[str, dict[int, list[Metrics]]] = {}
    for r in records:
        times.setdefault(r.id, {}).setdefault(r.repeat, []).append(r.metrics)
    per_token = [
        [sum(m.total_s for m in ms) / max(1, sum(m.new_tokens for m in ms)) for ms in reps.values()]
        for reps in times.values()
        if len(reps) > 1
    ]
    if not per_token:
        return None
    spreads = sorted(spread(t) for t in per_token)
    return RepeatSpread(prompts=len(spreads), median=spreads[len(spreads) // 2], max=spreads[-1])


SHORT = ("tokens_per_s", "ttft_ms", "tpot_ms", "new_tokens", "mean_acceptance_length")


def by_prompt(records: list[Record], labels: list[str], greedy: bool) -> list[dict]:
    """One row per prompt: pooled over its turns and repeats."""
    rows = []
    for pid in dict.fromkeys(r.id for r in records):
        mine = [r for r in records if r.id == pid]
        base = of(mine, "ar")
        methods = {}
        for label in labels:
            s = compared(label, of(mine, label), base)
            check = lossless(base, of(mine, label), greedy)
            methods[label] = {k: getattr(s, k) for k in (*SHORT, "speedup")}
            methods[label] |= {"identical": check.identical, "checked": check.checked}
        ar = method_summary("ar", pool(base))
        rows.append({"id": pid, "category": mine[0].category, "ar": {k: ar[k] for k in SHORT}, "methods": methods})
    return rows
