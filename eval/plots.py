"""PNG plots with matplotlib's object API (a Figure per plot, rendered by Agg, no pyplot global state)."""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

from .calibration_report import reliability_plot
from .results import Compared, MethodResult, RunResult, StudyResult
from .stats import position_intervals


def save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def errors(values: list[float], intervals: list) -> list[list[float]] | None:
    """matplotlib's yerr ([below], [above]) from 95% intervals; 0 where a value has none."""
    if not any(intervals):
        return None
    below = [v - iv[0] if iv else 0.0 for v, iv in zip(values, intervals, strict=True)]
    above = [iv[1] - v if iv else 0.0 for v, iv in zip(values, intervals, strict=True)]
    return [[max(0.0, b) for b in below], [max(0.0, a) for a in above]]


def acceptance_plot(methods: dict[str, MethodResult], path: Path) -> Path | None:
    """Per-position acceptance rate: the share of drafts whose token at depth i was accepted."""
    rates = {k: m.acceptance_rate_per_position for k, m in methods.items() if m.acceptance_rate_per_position}
    if not rates:
        return None
    fig = Figure(figsize=(6, 3.6))
    ax = fig.subplots()
    for label, r in rates.items():
        tau = methods[label].mean_acceptance_length
        ivs = position_intervals(methods[label])
        ax.errorbar(
            range(1, len(r) + 1),
            r,
            yerr=errors(r, ivs),
            marker="o",
            capsize=3,
            label=f"{label} (tau {tau:.2f})",
        )
    ax.set(xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1.02), title="Per-position acceptance")
    ax.set_xticks(range(1, max(len(r) for r in rates.values()) + 1))
    ax.grid(alpha=0.3)
    ax.legend()
    return save(fig, path)


def category_plot(by_category: dict[str, dict[str, Compared]], path: Path) -> Path:
    """Speedup over plain decoding per category (category -> method label -> its result), one bar per method,
    with its 95% interval."""
    cats = list(by_category)
    labels = list(next(iter(by_category.values())))
    width = 0.8 / len(labels)
    fig = Figure(figsize=(max(6, 0.9 * len(cats) * len(labels) + 2), 3.6))
    ax = fig.subplots()
    for j, label in enumerate(labels):
        xs = [i + (j - (len(labels) - 1) / 2) * width for i in range(len(cats))]
        rows = [by_category[c][label] for c in cats]
        ys = [m.speedup for m in rows]
        yerr = errors(ys, [m.interval("speedup") for m in rows])
        ax.bar(xs, ys, width, yerr=yerr, capsize=3, label=label)
    ax.axhline(1.0, color="gray", lw=1, ls="--")
    ax.set_xticks(range(len(cats)), cats, rotation=20)
    ax.set(ylabel="speedup vs plain decoding", title="Speedup by category")
    ax.legend()
    return save(fig, path)


def study_plot(study: StudyResult, path: Path) -> Path:
    """Mean latency per request of the 2x2 cells, split into prefill (TTFT) and decode; the bar's whisker is the
    total's 95% interval."""
    cells = study.cells
    names = [f"{'cache' if c.prefix_cache else 'no cache'}\n{c.speculation or 'plain'}" for c in cells]
    ttft = [c.ttft_ms for c in cells]
    decode = [c.total_ms - c.ttft_ms for c in cells]
    fig = Figure(figsize=(6, 3.8))
    ax = fig.subplots()
    ax.bar(names, ttft, label="prefill (TTFT)")
    totals = [c.total_ms for c in cells]
    yerr = errors(totals, [c.intervals.get("total_ms") for c in cells])
    ax.bar(names, decode, bottom=ttft, yerr=yerr, capsize=4, label="decode")
    ax.set(ylabel="ms per request", title="Prefix cache x speculation")
    ax.set_ylim(0, 1.25 * max(totals) or 1)
    ax.legend(ncol=2, loc="upper right")
    return save(fig, path)


def pareto(points: list[tuple[float, float]]) -> list[int]:
    """Indices of points no other point beats (fewer or equal params and higher or equal speedup, one strictly)."""
    return [
        i
        for i, (x, y) in enumerate(points)
        if not any((x2 <= x and y2 >= y) and (x2, y2) != (x, y) for x2, y2 in points)
    ]


def params_plot(rows: list, path: Path) -> Path | None:
    """Speedup and tau against drafter parameters (compare.Row), the Pareto front of speedup marked."""
    rows = [r for r in rows if r.drafter_params is not None]
    if not rows:
        return None
    xs = [r.drafter_params / 1e6 for r in rows]
    fig = Figure(figsize=(10, 3.8))
    left, right = fig.subplots(1, 2)
    for ax, key, name in ((left, "speedup", "speedup"), (right, "mean_acceptance_length", "tau")):
        ys = [getattr(r, key) for r in rows]
        ax.errorbar(xs, ys, yerr=errors(ys, [r.intervals.get(key) for r in rows]), fmt="o", capsize=3)
        for x, y, r in zip(xs, ys, rows, strict=True):
            ax.annotate(r.label, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set(xlabel="drafter parameters (M)", ylabel=name)
        ax.grid(alpha=0.3)
    front = sorted(pareto(list(zip(xs, [r.speedup for r in rows], strict=True))), key=lambda i: xs[i])
    fx, fy = [xs[i] for i in front], [rows[i].speedup for i in front]
    left.plot(fx, fy, "r--", marker="o", mfc="none", ms=10, label="Pareto front")
    left.legend()
    left.set_title("Speedup vs drafter size")
    right.set_title("tau vs drafter size")
    return save(fig, path)


def write_plots(results: RunResult, out: Path) -> list[Path]:
    by_category = {c: v.methods for c, v in results.by_category.items()}
    paths = [
        acceptance_plot(results.methods, out / "acceptance.png"),
        category_plot(by_category, out / "speedup_by_category.png"),
        study_plot(results.study, out / "study.png") if results.study else None,
        reliability_plot(results.methods, out / "calibration.png"),
    ]
    return [p for p in paths if p is not None]
