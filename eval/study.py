"""The composition study: prefix cache off/on x speculation off/on on the same prompts (the rag suite).

The cache can only shorten prefill (TTFT); speculation can only shorten decode (TPOT). The question is whether
they stack: is the relative decode win the same with and without a cache hit?

The four cells run prompt by prompt in a rotating order (eval/runner.py), so a slow spell of the machine hits
them alike. Plain decoding with and without the cache is the built-in control: the cache cannot change what a
decode step costs, so when their TPOTs differ significantly the machine was too noisy and no finding is drawn.
"""

from __future__ import annotations

import numpy as np

from .aggregate import Record, of, summary
from .results import Control, Effect, Identical, StudyCell, StudyResult
from .stats import Bootstrap, interval, ratio, significant, summary_samples

STUDIES = ("prefix_x_spec",)
CONTROL_TOLERANCE = 0.03  # a control TPOT ratio within 3% of 1.0 passes even when its interval excludes 1.0


def study_arms(method: str) -> list[tuple[str, bool]]:
    """(method, prefix cache) of the four cells: spec off/on x cache off/on."""
    return [("ar", False), ("ar", True), (method, False), (method, True)]


def study_cells(records: list[Record], method: str, greedy: bool, seed: int = 0) -> StudyResult:
    boot = Bootstrap.over([r.id for r in records], seed)
    groups = [of(records, name, prefix_cache=cache) for name, cache in study_arms(method)]
    cells = [cell(name, cache, rows, boot) for (name, cache), rows in zip(study_arms(method), groups, strict=True)]
    fx = effects(cells, [summary_samples(boot.sums(rows)) for rows in groups] if boot.enough else None)
    noisy = control_failed(fx["control"])
    undefined = NO_DECODE if any(c.tpot_ms is None for c in cells) else None
    return StudyResult(
        study="prefix_x_spec",
        method=method,
        cells=cells,
        effects=fx,
        control=Control(fx["control"].ratio, fx["control"].interval, noisy=noisy, undefined=undefined),
        identical=identical(records, method) if greedy else None,
        finding=f"Finding withheld: {undefined}" if undefined else study_finding(cells, fx, method, noisy),
    )


def study_finding(cells: list[StudyCell], fx: dict[str, Effect], method: str, noisy: bool) -> str:
    return withheld(cells, fx["control"]) if noisy else finding(fx, method)


NO_DECODE = (
    "a cell made no decode step (every answer was at most one token), so its TPOT and every TPOT ratio, the "
    "control's included, are undefined. Raise max_new_tokens."
)


def cell(name: str, cache: bool, rows: list[Record], boot: Bootstrap) -> StudyCell:
    s = summary(name, rows, boot)
    iv = {k: v for k, v in s.intervals.items() if k in ("ttft_ms", "tpot_ms", "total_ms", "tokens_per_s")}
    return StudyCell(
        prefix_cache=cache,
        speculation=name if name != "ar" else None,
        ttft_ms=s.ttft_ms,
        # no token after the first: time per output token is 0/0
        tpot_ms=None if s.new_tokens <= s.requests else s.tpot_ms,
        total_ms=s.total_ms,
        tokens_per_s=s.tokens_per_s,
        new_tokens=s.new_tokens,
        requests=s.requests,
        prefix_cache_hit_rate=s.prefix_cache_hit_rate,
        intervals=iv,
    )


RATIOS = {  # name: (key, numerator cell, denominator cell); cells: plain, cached, spec, both
    "control": ("tpot_ms", 1, 0),
    "prefill": ("ttft_ms", 0, 1),
    "decode_cold": ("tpot_ms", 0, 2),
    "decode_hit": ("tpot_ms", 1, 3),
    "total": ("total_ms", 0, 3),
}


def effects(cells: list[StudyCell], samples: list[dict] | None) -> dict[str, Effect]:
    """Each ratio the finding states, with its paired interval. control: plain TPOT with the cache over without
    (should be 1.0); prefill: the cache's TTFT cut; decode_cold/decode_hit: speculation's TPOT cut without and
    with the cache; stacking: decode_cold over decode_hit (1.0: the wins stack); total: plain uncached total
    latency over speculation with the cache."""
    out: dict[str, Effect] = {}
    draws: dict[str, np.ndarray] = {}  # none without samples
    for name, (k, a, b) in RATIOS.items():
        if samples:
            draws[name] = ratio(samples[a][k], samples[b][k])
        out[name] = effect(safe_ratio(getattr(cells[a], k), getattr(cells[b], k)), draws.get(name))
    stack = ratio(draws["decode_cold"], draws["decode_hit"]) if samples else None
    out["stacking"] = effect(safe_ratio(out["decode_cold"].ratio, out["decode_hit"].ratio), stack)
    return out


def effect(point: float | None, draws) -> Effect:
    return Effect(ratio=point, interval=interval(draws) if draws is not None else None)


def safe_ratio(a: float | None, b: float | None) -> float | None:
    """a / b; None (undefined) when either is undefined or b is 0."""
    return a / b if a is not None and b else None


def control_failed(control: Effect) -> bool:
    """Plain TPOT with and without the cache differ significantly, and by more than CONTROL_TOLERANCE."""
    return (
        control.ratio is not None and bool(significant(control.interval)) and abs(control.ratio - 1) > CONTROL_TOLERANCE
    )


def identical(records: list[Record], method: str) -> Identical:
    """Greedy outputs of every cell vs the plain, uncached cell: neither the cache nor speculation may change them."""
    ref = {(r.id, r.turn, r.repeat): r.output_ids for r in of(records, "ar", prefix_cache=False)}
    rest = [r for name, cache in study_arms(method)[1:] for r in of(records, name, prefix_cache=cache)]
    pairs = [(ref[(r.id, r.turn, r.repeat)], r.output_ids) for r in rest if (r.id, r.turn, r.repeat) in ref]
    return Identical(checked=len(pairs), identical=sum(a == b for a, b in pairs))


def fmt(e: Effect) -> str:
    """1.23x [1.10, 1.31]"""
    iv = e.interval
    if e.ratio is None:
        return "undefined"
    return f"{e.ratio:.2f}x" + (f" [{iv[0]:.2f}, {iv[1]:.2f}]" if iv else "")


def withheld(cells: list[StudyCell], control: Effect) -> str:
    plain, cached = cells[0].tpot_ms, cells[1].tpot_ms
    return (
        f"Finding withheld: the machine was too noisy for this study. Plain decoding's TPOT was {plain:.1f} ms "
        f"without the prefix cache and {cached:.1f} ms with it ({fmt(control)}), though the cache cannot change "
        "what a decode step costs. Rerun on an idle machine (or with more repeats)."
    )


def cut(e: Effect, what: str, name: str) -> str:
    """'X cut TPOT 1.20x [...]', or says it did not, from the interval (the point estimate alone when None).
    e's ratio is the time without X over the time with it."""
    if e.interval:
        low, high = e.interval
    else:
        assert e.ratio is not None, "a defined effect: a point estimate where there is no interval"
        low = high = e.ratio
    if low > 1:
        return f"{name} cut {what} {fmt(e)}"
    if high < 1:
        return f"{name} made {what} longer (without / with it: {fmt(e)})"
    return f"{name} did not significantly change {what} ({fmt(e)})"


def finding(fx: dict[str, Effect], method: str) -> str:
    """One sentence from the ratios and their intervals: what the cache saves, what speculation saves, and
    whether they stack."""
    stack = fx["stacking"]
    if stack.interval:
        differs = significant(stack.interval)
    else:
        assert stack.ratio is not None, "a defined effect: a point estimate where there is no interval"
        differs = abs(stack.ratio - 1) > 0.15
    stacks = (
        "the relative decode effect differs with and without a cache hit"
        if differs
        else "the relative decode effect does not differ significantly with and without a cache hit"
    )
    return (
        f"{cut(fx['prefill'], 'TTFT', 'The prefix cache')}; {cut(fx['decode_cold'], 'TPOT', method)} without the "
        f"cache and {fmt(fx['decode_hit'])} with it: {stacks} "
        f"(ratio {fmt(stack)}); {cut(fx['total'], 'total latency', 'together they')}."
    )
