"""How each step went and how well acceptance was predicted: the report's tables and the reliability PNG.

The tables come from each method's `steps` and `calibration` (serve/engine/calibration.py's reliability tables): per
drafter and depth, the nodes whose parent was accepted, their mean estimate against their observed acceptance, and
the expected calibration error of the draft policy's estimates (all steps, and past a request's first 32) and of the
drafter's own probabilities.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

from draftsmith.serve.engine.calibration import BINS, calibration_error

from .results import MethodResult, Summary

STEPS = ("plain", "probe", "whole", "cut")


Table = tuple[list[str], list[list]]  # header, rows


def steps_table(methods: dict[str, MethodResult]) -> Table:
    """Each method's target passes by what they verified."""
    rows = []
    for label, m in methods.items():
        total = sum(m.steps.values())
        rows.append([label, *(share(m.steps.get(k, 0), total) for k in STEPS)])
    return ["method", "plain", "probe", "whole draft", "cut draft"], rows


def share(count: int, total: int) -> str:
    return f"{count} ({count / total:.0%})" if total else "0"


def tables_of(m: Summary) -> dict[str, list[float]]:
    """'<drafter>/<depth>' -> the policy's reliability table (the settled and own ones are looked up beside it)."""
    return {k: v for k, v in sorted(m.calibration.items()) if k.count("/") == 1}


def calibration_table(methods: dict[str, MethodResult]) -> Table | None:
    rows = []
    for label, m in methods.items():
        for key, t in tables_of(m).items():
            n = sum(t[:BINS])
            settled, own = m.calibration.get(f"{key}/settled", []), m.calibration.get(f"{key}/own", [])
            rows.append(
                [
                    label,
                    key.replace("/", " @ depth "),
                    int(n),
                    f"{sum(t[BINS : 2 * BINS]) / n:.2f}" if n else "-",
                    f"{sum(t[2 * BINS :]) / n:.2f}" if n else "-",
                    ece(t),
                    ece(settled),
                    own_cell(own),
                ]
            )
    if not rows:
        return None
    header = ["method", "drafter", "nodes", "estimate", "observed", "ECE", "ECE after 32 steps", "ECE, own probs"]
    return header, rows


def own_cell(own: list[float]) -> str:
    """The drafter's own probabilities' ECE, or why the policy judged it by observed acceptance alone."""
    if not own or not sum(own[:BINS]):
        return "none or NaN: judged by observed acceptance alone"
    if sum(1 for b in range(BINS) if own[b]) == 1 and sum(own[:BINS]) >= 16:
        return f"{ece(own)} (all in one bin: judged by observed acceptance alone)"
    return ece(own)


def ece(t: list[float]) -> str:
    e = calibration_error(t)
    return "-" if e is None else f"{e:.3f}"


def reliability_plot(methods: dict[str, MethodResult], path: Path) -> Path | None:
    """Per drafter and depth: observed acceptance against the estimate, by estimate bin (dot area: nodes)."""
    curves = [(label, key, t) for label, m in methods.items() for key, t in tables_of(m).items() if sum(t[:BINS])]
    if not curves:
        return None
    fig = Figure(figsize=(5, 5))
    ax = fig.subplots()
    ax.plot([0, 1], [0, 1], color="grey", lw=1, ls="--", label="calibrated")
    for label, key, t in curves:
        bins = [b for b in range(BINS) if t[b]]
        x = [t[BINS + b] / t[b] for b in bins]
        y = [t[2 * BINS + b] / t[b] for b in bins]
        size = [20 + 200 * t[b] / max(t[:BINS]) for b in bins]
        ax.plot(x, y, alpha=0.6)
        ax.scatter(x, y, s=size, label=f"{label}: {key.replace('/', ' @ depth ')} (ECE {ece(t)})")
    ax.set(xlabel="estimated acceptance", ylabel="observed acceptance", xlim=(0, 1), ylim=(0, 1))
    ax.set_title("Acceptance: estimated vs observed")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path
