"""The draft-length part of peers/vllm_concurrency.py's report: each K's throughput speedup per concurrency
level side by side, the recommendation derived from them (serve/export/draft_lengths.py), shown against the K the
export's card asks for at every load, and the --speculative-config that serves it in vLLM 0.32; with the measured
schedule's own speedup where that was run too."""

from __future__ import annotations

import json

from draftsmith.eval.report import ci, table
from draftsmith.serve.export.card_concurrency import SCHEDULE_NOTE
from draftsmith.serve.export.draft_lengths import RULE, SCHEDULE_KEY, Choice, Point, speculative_options, verdict
from draftsmith.serve.export.vllm_sweep import Sweep

VLLM_DEFAULT = (
    "vLLM itself has no default K for an EAGLE-3 export: its config.json has no `n_predict`, so vLLM 0.32 requires "
    "`num_speculative_tokens`, and serves that K at every batch size."
)


def cell(points: dict[tuple[int, int], Point], k: int, n: int) -> str:
    p = points.get((k, n))
    return ci(p.speedup, p.interval, unit="x") if p else "-"


def choice_cell(c: Choice) -> str:
    return "off" if c.k == 0 else f"K={c.k} ({c.why})"


def summary_table(sweep: Sweep, schedule: list[Point]) -> str:
    """Rows: levels; columns: each K's throughput speedup, the measured schedule's, the recommendation."""
    points = {(p.k, p.concurrency): p for p in sweep.points}
    ks = sorted({p.k for p in sweep.points})
    measured = {p.concurrency: p for p in schedule}
    header = ["N"] + [f"K={k}" + (" (card)" if k == sweep.default_k else "") for k in ks]
    header += ["schedule"] * bool(schedule) + ["recommended"]
    rows = []
    for c in sweep.choices():
        n = c.concurrency
        sched = [ci(measured[n].speedup, measured[n].interval, unit="x") if n in measured else "-"] * bool(schedule)
        rows.append([n, *(cell(points, k, n) for k in ks), *sched, choice_cell(c)])
    return table(header, rows)


def against_default(sweep: Sweep) -> str:
    """Per level, what the recommendation gains over the card's K, in words."""
    if sweep.default_k is None:
        return "The export's card K is unknown (its README.md names no num_speculative_tokens)."
    card = {p.concurrency: p for p in sweep.points if p.k == sweep.default_k}
    parts = []
    for c in sweep.choices():
        fixed = card.get(c.concurrency)
        was = ci(fixed.speedup, fixed.interval, unit="x") if fixed else "not measured"
        now = "plain decoding (1.00x)" if c.k == 0 else f"K={c.k} at {ci(c.speedup, c.interval, unit='x')}"
        same = c.k == sweep.default_k
        parts.append(
            f"N={c.concurrency}: the card's K ({was})" if same else f"N={c.concurrency}: {now} instead of {was}"
        )
    return f"Against the card's K={sweep.default_k} at every load: " + "; ".join(parts) + "."


def serve_line(sweep: Sweep) -> str:
    options = speculative_options(sweep.choices())
    if options is None:
        return "Serve the target without `--speculative-config`."
    spec = {"method": sweep.method, "model": sweep.model} | options
    note = f"{SCHEDULE_NOTE}.\n\n" if SCHEDULE_KEY in options else ""
    return f"{note}```\n--speculative-config '{json.dumps(spec)}'\n```"


def draft_lengths_section(sweep: Sweep, schedule: list[Point]) -> str:
    return "\n\n".join(
        [
            "## Draft length per concurrency",
            f"Throughput speedup against plain vLLM, per K ({sweep.origin()}):",
            summary_table(sweep, schedule),
            f"**Recommendation: {verdict(sweep.choices())}.** Per level: {RULE}.",
            against_default(sweep),
            VLLM_DEFAULT,
            serve_line(sweep),
        ]
    )
