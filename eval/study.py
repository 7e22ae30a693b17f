"""The composition study: prefix cache off/on x speculation off/on on the same prompts (the rag suite).

The cache can only shorten prefill (TTFT); speculation can only shorten decode (TPOT). The question is whether
they stack: is the relative decode win the same with and without a cache hit?
"""

from __future__ import annotations

from .aggregate import Record, method_summary, of, pool

STUDIES = ("prefix_x_spec",)
SAME = 0.15  # relative decode wins within 15% of each other count as "the same" on a shared CPU


def study_arms(method: str) -> list[tuple[str, bool]]:
    """(method, prefix cache) of the four cells: spec off/on x cache off/on."""
    return [("ar", False), ("ar", True), (method, False), (method, True)]


def study_cells(records: list[Record], method: str, greedy: bool) -> dict:
    cells = []
    for name, cache in study_arms(method):
        s = method_summary(name, pool(of(records, name, prefix_cache=cache)))
        keep = ("ttft_ms", "tpot_ms", "total_ms", "tokens_per_s", "new_tokens", "requests", "prefix_cache_hit_rate")
        cells.append({"prefix_cache": cache, "speculation": name if name != "ar" else None, **{k: s[k] for k in keep}})
    return {
        "study": "prefix_x_spec",
        "method": method,
        "cells": cells,
        "identical": identical(records, method) if greedy else None,
        "finding": finding(cells, method),
    }


def identical(records: list[Record], method: str) -> dict:
    """Greedy outputs of every cell vs the plain, uncached cell: neither the cache nor speculation may change them."""
    ref = {(r.id, r.turn, r.repeat): r.output_ids for r in of(records, "ar", prefix_cache=False)}
    rest = [r for name, cache in study_arms(method)[1:] for r in of(records, name, prefix_cache=cache)]
    pairs = [(ref[(r.id, r.turn, r.repeat)], r.output_ids) for r in rest if (r.id, r.turn, r.repeat) in ref]
    return {"checked": len(pairs), "identical": sum(a == b for a, b in pairs)}


def ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def finding(cells: list[dict], method: str) -> str:
    """One sentence from the numbers: what the cache saves, what speculation saves, and whether they stack."""
    plain, cached, spec, both = cells
    prefill = ratio(plain["ttft_ms"], cached["ttft_ms"])
    win_cold, win_hit = ratio(plain["tpot_ms"], spec["tpot_ms"]), ratio(cached["tpot_ms"], both["tpot_ms"])
    cache_says = (
        f"the prefix cache cut TTFT {prefill:.1f}x ({plain['ttft_ms']:.0f} -> {cached['ttft_ms']:.0f} ms)"
        if prefill >= 1.1
        else f"the prefix cache did not shorten TTFT ({plain['ttft_ms']:.0f} vs {cached['ttft_ms']:.0f} ms)"
    )
    spec_says = (
        f"{method} cut TPOT {win_cold:.2f}x without the cache and {win_hit:.2f}x with it"
        if min(win_cold, win_hit) >= 1.05
        else f"{method} did not reliably cut TPOT (plain/{method} TPOT {win_cold:.2f}x without the cache, "
        f"{win_hit:.2f}x with it)"
    )
    same = abs(win_cold - win_hit) <= SAME * max(win_cold, win_hit)
    effect = "decode win" if min(win_cold, win_hit) >= 1.05 else "decode effect"
    stack = f"the relative {effect} is the same with and without a cache hit" if same else f"the {effect} differs"
    total = ratio(plain["total_ms"], both["total_ms"])
    return (
        f"{cache_says[0].upper()}{cache_says[1:]}, {spec_says}: {stack}, and together they take total latency "
        f"from {plain['total_ms']:.0f} to {both['total_ms']:.0f} ms ({total:.2f}x)."
    )
