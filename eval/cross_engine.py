"""One acceptance report across engines (peers/engines_crosscheck.py): the same prompts through draftsmith's
engine, vLLM and llama.cpp, every engine's verification steps recounted the one way draftsmith counts them, then
τ, acceptance by position and speedup with bootstrap intervals over prompts (eval/stats.py), output identity, and
the paired τ differences that fail the report where their interval excludes zero.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from draftsmith.eval.stats import Bootstrap, Interval, interval, intervals, ratio, speedup_interval
from draftsmith.serve.engine.metrics import Metrics

COUNTING = (
    "a draft is a verification step that checked at least one drafted token inside the output; drafted and "
    "accepted tokens past max_new_tokens or an EOS are not counted; tau = 1 + accepted / drafts; position i's "
    "rate = drafts that accepted i or more tokens / drafts"
)
ENGINE_COUNTING = {  # how each engine counts on its own, before the recount
    "draftsmith": "counts this way itself (serve/engine/metrics.py)",
    "vLLM": "counts a step per request whose drafts it verified, all k drafts and every accepted one, also past "
    "max_tokens; recounted from its counters read after each engine step",
    "llama.cpp": "drafts at most the tokens left (n_predict), counts every step with a draft and its accepted "
    "tokens; recounted from its LLAMA_TRACE lines, one per step",
}


def recount(steps: Sequence[tuple[int, int]], tokens: int, prompt_s: float, total_s: float) -> Metrics:
    """An engine's (accepted, drafted) for every step after the prefill, in order ((0, 0): a step without a
    draft), counted as draftsmith's engine counts (Engine.step): the prefill emits the first of the output's
    `tokens`; a step with b tokens left to emit counts min(drafted, b) drafted and min(accepted, b) accepted, and
    emits min(accepted + 1, b); steps past the output count nothing."""
    m = Metrics(new_tokens=tokens, ttft_s=prompt_s, total_s=total_s)
    emitted = 1
    for accepted, drafted in steps:
        left = tokens - emitted
        if left <= 0:
            break
        m.record_step(min(drafted, left), min(accepted, left))
        emitted += min(accepted + 1, left)
    return m


@dataclass
class Record:
    """One prompt through one arm."""

    id: str
    metrics: Metrics
    tokens: list[int]


@dataclass
class Arm:
    """One engine, one precision, one method (plain or a drafter) over the prompts."""

    engine: str
    precision: str
    method: str
    records: list[Record] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.engine} {self.precision} {self.method}"

    @property
    def plain(self) -> bool:
        return self.method == "plain"

    def pooled(self) -> Metrics:
        total = Metrics(requests=0)
        for r in self.records:
            total.merge(r.metrics)
        return total

    def outputs(self) -> dict[str, list[int]]:
        return {r.id: r.tokens for r in self.records}


def identical(a: Arm, b: Arm) -> tuple[int, int]:
    """(prompts whose outputs are equal token for token, prompts both ran)."""
    x, y = a.outputs(), b.outputs()
    both = x.keys() & y.keys()
    return sum(x[i] == y[i] for i in both), len(both)


def tau_samples(boot: Bootstrap, arm: Arm, positions: int) -> tuple[np.ndarray, list[np.ndarray]]:
    s = boot.sums(arm.records, positions)
    tau = np.where(s["drafts"] > 0, 1 + ratio(s["accepted_tokens"], s["drafts"]), np.nan)
    return tau, [ratio(s[f"pos{i + 1}"], s["drafts"]) for i in range(positions)]


@dataclass
class TauDifference:
    """Two arms' τ and per-position rates compared on the same resampled prompts."""

    a: str
    b: str
    tau_diff: float
    interval: Interval
    positions: list[int]  # 1-based positions whose rate difference excludes zero

    @property
    def parts(self) -> bool:
        return self.interval is not None and not (self.interval[0] <= 0.0 <= self.interval[1])


def tau_difference(boot: Bootstrap, a: Arm, b: Arm, positions: int) -> TauDifference:
    """Paired: both arms must have run the bootstrap's prompts, all of them (an unpaired difference would mix
    prompt difficulty into the engines' difference)."""
    for arm in (a, b):
        if sorted(r.id for r in arm.records) != sorted(boot.ids):
            raise ValueError(f"{arm.label} ran other prompts than the bootstrap's {len(boot.ids)}: not paired")
    ta, pa = tau_samples(boot, a, positions)
    tb, pb = tau_samples(boot, b, positions)
    diff = a.pooled().mean_acceptance_length - b.pooled().mean_acceptance_length
    apart = []
    for i in range(positions):
        iv = interval(pa[i] - pb[i])
        if iv is not None and not (iv[0] <= 0.0 <= iv[1]):
            apart.append(i + 1)
    return TauDifference(a.label, b.label, diff, interval(ta - tb), apart)


def arm_row(boot: Bootstrap, arm: Arm, plain: Arm | None, reference: Arm, positions: int) -> dict:
    """An arm's numbers with their intervals; speedup against its engine's plain arm at the same precision."""
    m = arm.pooled()
    ivs = intervals(boot, arm.records, positions)
    row = {
        "engine": arm.engine,
        "precision": arm.precision,
        "method": arm.method,
        "prompts": len(arm.records),
        "tokens_per_s": m.tokens_per_s,
        "tokens_per_s_interval": ivs.get("tokens_per_s"),
        "identical_to_plain": identical(arm, plain) if plain is not None and not arm.plain else None,
        "identical_to_reference": identical(arm, reference),
    }
    if not arm.plain:
        rates = (m.acceptance_rate_per_position + [0.0] * positions)[:positions]
        row |= {
            "mean_acceptance_length": m.mean_acceptance_length,
            "mean_acceptance_length_interval": ivs.get("mean_acceptance_length"),
            "acceptance_rate_per_position": rates,
            "acceptance_rate_per_position_intervals": ivs.get("acceptance_rate_per_position"),
            "drafts": m.drafts,
            "accepted_tokens": m.accepted_tokens,
        }
    if plain is not None and not arm.plain:
        base = plain.pooled().tokens_per_s
        row["speedup"] = m.tokens_per_s / base if base else None
        row["speedup_interval"] = speedup_interval(boot, arm.records, plain.records)
    return row


def fmt(x: float | None, iv: Interval = None, digits: int = 2) -> str:
    if x is None:
        return "-"
    text = f"{x:.{digits}f}"
    return text + (f" [{iv[0]:.{digits}f}, {iv[1]:.{digits}f}]" if iv else "")


def cells(r: dict, positions: int) -> list[str]:
    rates = r.get("acceptance_rate_per_position") or []
    ivs = r.get("acceptance_rate_per_position_intervals") or [None] * len(rates)
    pos = [fmt(x, iv) for x, iv in zip(rates, ivs, strict=False)] or ["-"] * positions
    same, ref = r["identical_to_plain"], r["identical_to_reference"]
    return [
        r["engine"],
        r["precision"],
        r["method"],
        fmt(r["tokens_per_s"], r["tokens_per_s_interval"], 1),
        fmt(r.get("speedup"), r.get("speedup_interval")),
        fmt(r.get("mean_acceptance_length"), r.get("mean_acceptance_length_interval"), 3),
        *pos,
        "-" if same is None else f"{same[0]}/{same[1]}",
        f"{ref[0]}/{ref[1]}",
    ]


def markdown(rows: list[dict], differences: list[TauDifference], info: list[TauDifference], positions: int) -> str:
    head = ["engine", "precision", "method", "tokens/s", "speedup", "τ", *(f"pos {i + 1}" for i in range(positions))]
    head += ["= its plain", "= draftsmith fp32 plain"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cells(r, positions)) + " |" for r in rows]
    lines += ["", "Paired τ differences (same resampled prompts; a pair fails when its interval excludes 0):", ""]
    for p in differences + info:
        verdict = "PARTS" if p.parts else "agrees"
        where = f", positions {p.positions}" if p.positions else ""
        tag = "" if p in differences else " (informational: another precision)"
        lines.append(f"- {p.a} − {p.b}: {fmt(p.tau_diff, p.interval, 3)} → {verdict}{where}{tag}")
    return "\n".join(lines) + "\n"
