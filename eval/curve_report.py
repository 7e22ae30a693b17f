"""The learning curve's report (draftsmith-curve): OUT/curve.json, curve.md (a table per suite and the fit) and
curve.png (τ against answer tokens and against CPU-hours, with 95% intervals).

CPU-hours of a point: its regeneration, its features and its training steps, times the machine's cores. The
points share one answers file and one pace, so regeneration and features are charged at the rate pooled over every
point that measured them (seconds per conversation, per answer token): a point that found its answers or features
cached still pays for them, and a larger point is not charged for answers a smaller one made.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from draftsmith.files import write_text_atomic

from .plots import errors, save
from .report import ci


@dataclass
class SuitePoint:
    tau: float
    tau_interval: list[float] | None
    acceptance: list[float]  # per draft position
    acceptance_intervals: list
    speedup: float
    speedup_interval: list[float] | None
    prompts: int
    identical: str  # "n/m" outputs equal to plain decoding's


@dataclass
class Point:
    conversations: int  # asked for (data.max_conversations)
    examples: int  # trained on: a draw of a conversation is one; fewer where the data or max_length ran out
    answer_tokens: int  # the assistant tokens of the examples (one epoch); loss_on=all trains the prompts' too
    trained_tokens: int  # tokens through the head over every epoch
    stages: dict  # what its training run measured (train/dataset.py make_dataset, steps)
    suites: dict[str, SuitePoint]
    cpu_hours: float = 0.0  # filled by charge()


@dataclass
class Fit:
    """tau = a + b * log10(answer tokens), least squares over the points."""

    suite: str
    a: float
    b: float
    per_doubling: float
    predictions: dict[str, float] = field(default_factory=dict)  # "10x" -> tau at 10x the largest point's tokens


def rate(points: list[Point], stage: str, per: str) -> float:
    """A stage's seconds per unit (`per`: a count the stage records, or a Point field), pooled over the points that
    measured the stage; 0 where none did."""
    measured = [
        (p.stages[stage]["seconds"], p.stages[stage].get(per, getattr(p, per, 0)))
        for p in points
        if p.stages.get(stage)
    ]
    measured = [(seconds, units) for seconds, units in measured if units]
    total = sum(units for _, units in measured)
    return sum(seconds for seconds, _ in measured) / total if total else 0.0


def charge(points: list[Point], cores: int) -> list[str]:
    """Each point's CPU-hours; the stages no point measured (charged nothing), named."""
    regen, features = rate(points, "regenerate", "rows"), rate(points, "features", "answer_tokens")
    for p in points:
        steps = p.stages.get("steps", {}).get("seconds", 0.0)
        p.cpu_hours = (regen * p.examples + features * p.answer_tokens + steps) * cores / 3600
    return [stage for stage, r in (("regeneration", regen), ("features", features)) if not r]


def fit(points: list[Point], suite: str, predict: list[float]) -> Fit | None:
    xs = [math.log10(p.answer_tokens) for p in points if p.answer_tokens > 0]
    ys = [p.suites[suite].tau for p in points if p.answer_tokens > 0]
    if len(set(xs)) < 2:
        return None
    b, a = np.polyfit(xs, ys, 1)
    largest = max(xs)
    preds = {f"{m:g}x": float(a + b * (largest + math.log10(m))) for m in predict}
    return Fit(suite, float(a), float(b), float(b * math.log10(2)), preds)


def table(points: list[Point], suite: str) -> list[str]:
    lines = [
        f"### {suite}",
        "",
        "| conversations (trained on) | answer tokens | CPU-hours | τ | acceptance by position | speedup | identical |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in points:
        s = p.suites[suite]
        acc = ", ".join(f"{a:.2f}" for a in s.acceptance)
        lines.append(
            f"| {p.conversations} ({p.examples}) | {p.answer_tokens} | {p.cpu_hours:.2f} | "
            f"{ci(s.tau, s.tau_interval)} | {acc} | {ci(s.speedup, s.speedup_interval, unit='x')} | {s.identical} |"
        )
    return lines + [""]


def fit_lines(fits: list[Fit]) -> list[str]:
    if not fits:
        return ["No fit: it takes two points with different answer tokens.", ""]
    lines = [
        "## The fit, and what it predicts",
        "",
        "τ = a + b · log10(answer tokens), least squares over the points. A prediction assumes the same recipe, the",
        "same kind of data and the same slope past the largest point; the anchors' curves bend (a head saturates), so",
        "read it as an upper estimate at 100x.",
        "",
        "| suite | a | b | τ per doubling | " + " | ".join(f"τ at {k}" for k in fits[0].predictions) + " |",
        "|---|---|---|---|" + "---|" * len(fits[0].predictions),
    ]
    for f in fits:
        preds = " | ".join(f"{v:.2f}" for v in f.predictions.values())
        lines.append(f"| {f.suite} | {f.a:.3f} | {f.b:.3f} | {f.per_doubling:+.3f} | {preds} |")
    return lines + [""]


def curve_plot(points: list[Point], suites: list[str], path: Path) -> Path:
    fig = Figure(figsize=(10, 3.8))
    by_tokens, by_hours = fig.subplots(1, 2, sharey=True)
    for suite in suites:
        taus = [p.suites[suite].tau for p in points]
        yerr = errors(taus, [p.suites[suite].tau_interval for p in points])
        by_tokens.errorbar([p.answer_tokens for p in points], taus, yerr=yerr, marker="o", capsize=3, label=suite)
        by_hours.errorbar([p.cpu_hours for p in points], taus, yerr=yerr, marker="o", capsize=3, label=suite)
    for ax, label in ((by_tokens, "answer tokens trained on"), (by_hours, "CPU-hours (regeneration, features, steps)")):
        ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    by_tokens.set_ylabel("τ (95% interval)")
    by_tokens.legend()
    return save(fig, path)


def write_curve(out: Path, points: list[Point], settings: dict, predict: list[float], cores: int) -> None:
    unmeasured = charge(points, cores)
    suites = list(points[0].suites)
    fits = [f for s in suites if (f := fit(points, s, predict))]
    data = {"settings": settings, "cores": cores, "points": [asdict(p) for p in points]}
    write_text_atomic(out / "curve.json", json.dumps(data | {"fits": [asdict(f) for f in fits]}, indent=2) + "\n")
    head = [
        "# Learning curve",
        "",
        f"`{settings['head']}` with {' '.join(['`train=' + settings['recipe'] + '`', *settings['train_args']])} on "
        f"{' '.join(['`target=' + settings['target'] + '`', *settings['target_args']])}; each head evaluated on "
        f"{settings['limit']} prompts per suite, {settings['max_new_tokens']} new tokens, in the shape its folder "
        f"records; 95% intervals over prompts. CPU-hours on {cores} cores"
        + (f" ({' and '.join(unmeasured)} not measured by any point: not charged)." if unmeasured else "."),
        "",
    ]
    body = [line for s in suites for line in table(points, s)]
    write_text_atomic(out / "curve.md", "\n".join(head + body + fit_lines(fits)))
    curve_plot(points, suites, out / "curve.png")
