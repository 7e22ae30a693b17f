"""The statistics, table and plot of peers/vllm_concurrency.py: plain vLLM against vLLM with a drafter, level by
level of concurrency, from the blocks it measured (one block: one arm driven at one concurrency in one round), pass
by pass (one pass: plain against one draft setting, K=2 or the recommended schedule); the draft lengths compared
and the recommendation from them are eval/vllm_draft_lengths_report.py's.

Throughput is output tokens over a block's wall time, pooled over rounds (sums, then ratios, as eval/stats.py
pools); its interval and the speedup's are a bootstrap over rounds, the two arms' blocks of a round drawn together.
TPOT is per request, (latency - TTFT) / (tokens - 1), and its mean's interval a bootstrap over requests; the TPOT
speedup draws the same (round, prompt) pairs from both arms. τ = 1 + accepted / drafts from vLLM's counters.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from draftsmith.eval.plots import errors, save
from draftsmith.eval.replay_stats import number
from draftsmith.eval.report import ci, table
from draftsmith.eval.stats import Bootstrap, Interval, interval, ratio
from draftsmith.eval.vllm_draft_lengths_report import draft_lengths_section
from draftsmith.serve.export.draft_lengths import Point
from draftsmith.serve.export.vllm_sweep import Sweep, record

ARMS = ("plain", "spec")
PLOT = "speedup_vs_concurrency.png"
SCHEDULE = "schedule"  # the pass that serves the recommended batch-size schedule


@dataclass
class Request:
    key: str  # "round/prompt id": the same request in the other arm
    tokens: int
    tpot_s: float | None  # None: under two tokens, no first-token time, or failed
    text: str | None  # None: failed


@dataclass
class Block:
    arm: str  # plain | spec
    concurrency: int
    round: int
    wall_s: float  # the block's first send to its last answer
    requests: list[Request]
    drafts: float = 0.0  # growth of vLLM's spec-decode counters over the block
    accepted: float = 0.0
    cpu_s: dict[str, float] = field(default_factory=dict)  # CPU seconds each server used during the block
    draft: str = ""  # its pass: the spec arm's draft setting ("K=2", "schedule"), on both arms' blocks

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.requests)


@dataclass
class Level:
    """One row of the table: both arms at one concurrency."""

    concurrency: int
    rounds: int
    pairs: int  # requests with a TPOT in both arms
    tok_s: dict[str, float | None]
    tok_s_interval: dict[str, Interval]
    throughput_speedup: float | None  # spec tok/s / plain tok/s
    throughput_speedup_interval: Interval
    tpot_ms: dict[str, float | None]
    tpot_ms_interval: dict[str, Interval]
    tpot_speedup: float | None  # plain TPOT / spec TPOT: above 1, spec answers each token sooner
    tpot_speedup_interval: Interval
    tau: float | None
    tau_interval: Interval
    identical: int  # spec's text equal to plain's on the same request
    compared: int


def tpot_s(latency_s: float | None, ttft_s: float | None, tokens: int | None) -> float | None:
    if latency_s is None or ttft_s is None or not tokens or tokens < 2:
        return None
    return (latency_s - ttft_s) / (tokens - 1)


def by_key(blocks: list[Block], attr: str) -> dict[str, dict[str, float | str]]:
    """arm -> request key -> the request's `attr`, where it has one."""
    found: dict[str, dict] = {a: {} for a in ARMS}
    for b in blocks:
        found[b.arm] |= {r.key: getattr(r, attr) for r in b.requests if getattr(r, attr) is not None}
    return found


def by_round(blocks: list[Block]) -> dict[str, dict[int, Block]]:
    return {arm: {b.round: b for b in blocks if b.arm == arm} for arm in ARMS}


def throughput(blocks: list[Block], seed: int) -> tuple[dict, dict, float | None, Interval]:
    """Each arm's tok/s and interval, and spec / plain with its interval, over the rounds both arms ran."""
    arms = by_round(blocks)
    rounds = sorted(arms["plain"].keys() & arms["spec"].keys())
    tables = {a: np.array([[arms[a][r].tokens, arms[a][r].wall_s] for r in rounds], float) for a in ARMS}
    points = {a: np.asarray(ratio(*tables[a].sum(0)) if rounds else np.nan) for a in ARMS}
    boot = Bootstrap.over(map(str, rounds), seed)
    samples = {a: ratio(*(boot.weights @ tables[a]).T) for a in ARMS} if boot.enough else {}
    ivs = {a: interval(samples[a]) if samples else None for a in ARMS}
    speedup_iv = interval(ratio(samples["spec"], samples["plain"])) if samples else None
    return {a: number(points[a]) for a in ARMS}, ivs, number(ratio(points["spec"], points["plain"])), speedup_iv


def tpot(blocks: list[Block], seed: int) -> tuple[int, dict, dict, float | None, Interval]:
    """Mean TPOT (ms) of each arm over the requests both answered with a TPOT, its interval, and plain / spec."""
    found = by_key(blocks, "tpot_s")
    keys = sorted(found["plain"].keys() & found["spec"].keys())
    ms = np.array([[1000 * found[a][k] for a in ARMS] for k in keys], float).reshape(-1, 2)
    means = ms.mean(0) if keys else np.full(2, np.nan)
    boot = Bootstrap.over(keys, seed)
    drawn = boot.weights @ ms / max(len(keys), 1) if boot.enough else None  # resampled means, [RESAMPLES, 2]
    ivs = {a: interval(drawn[:, i]) if drawn is not None else None for i, a in enumerate(ARMS)}
    speedup_iv = interval(ratio(drawn[:, 0], drawn[:, 1])) if drawn is not None else None
    points = {a: number(means[i]) for i, a in enumerate(ARMS)}
    return len(keys), points, ivs, number(ratio(means[0], means[1])), speedup_iv


def tau(blocks: list[Block], seed: int) -> tuple[float | None, Interval]:
    spec = sorted((b for b in blocks if b.arm == "spec"), key=lambda b: b.round)
    counts = np.array([[b.accepted, b.drafts] for b in spec], float).reshape(-1, 2)
    point = np.asarray(1 + ratio(*counts.sum(0)) if counts[:, 1].sum() > 0 else np.nan)
    boot = Bootstrap.over((str(b.round) for b in spec), seed)
    if not boot.enough or not counts[:, 1].sum():
        return number(point), None
    return number(point), interval(1 + ratio(*(boot.weights @ counts).T))


def identical(blocks: list[Block]) -> tuple[int, int]:
    texts = by_key(blocks, "text")
    keys = texts["plain"].keys() & texts["spec"].keys()
    return sum(texts["plain"][k] == texts["spec"][k] for k in keys), len(keys)


def level(blocks: list[Block], concurrency: int) -> Level:
    mine = [b for b in blocks if b.concurrency == concurrency]
    tok_s, tok_iv, speedup, speedup_iv = throughput(mine, seed=concurrency)
    pairs, tpot_ms, tpot_iv, tpot_speedup, tpot_speedup_iv = tpot(mine, seed=concurrency)
    rounds = len({b.round for b in mine if b.arm == "plain"} & {b.round for b in mine if b.arm == "spec"})
    return Level(
        concurrency,
        rounds,
        pairs,
        tok_s,
        tok_iv,
        speedup,
        speedup_iv,
        tpot_ms,
        tpot_iv,
        tpot_speedup,
        tpot_speedup_iv,
        *tau(mine, seed=concurrency),
        *identical(mine),
    )


def levels(blocks: list[Block]) -> list[Level]:
    return [level(blocks, n) for n in sorted({b.concurrency for b in blocks})]


def stops_paying(rows: list[Level]) -> tuple[int | None, str]:
    """The smallest concurrency whose throughput speedup is no longer above 1: its interval reaches 1 or lies
    below it (the point estimate where there is no interval), and how that was decided."""
    for row in rows:
        iv, point = row.throughput_speedup_interval, row.throughput_speedup
        if iv is not None and iv[0] <= 1.0:
            return row.concurrency, f"the interval of its throughput speedup, {ci(point, iv, unit='x')}, reaches 1"
        if iv is None and point is not None and point <= 1.0:
            return row.concurrency, f"its throughput speedup is {point:.2f}x (one round: no interval)"
    return None, ""


def verdict(rows: list[Level]) -> str:
    n, why = stops_paying(rows)
    top = max(r.concurrency for r in rows) if rows else 0
    if n is None:
        return f"**Speculation pays through N={top}** on this machine: every throughput speedup's interval is above 1."
    slower = [r.concurrency for r in rows if r.throughput_speedup_interval and r.throughput_speedup_interval[1] < 1]
    costs = f" It is significantly slower than plain decoding at N={', '.join(map(str, slower))}." if slower else ""
    return f"**Speculation stops paying at N={n}** on this machine: {why}.{costs}"


def row_cells(r: Level) -> list:
    def arm(key: str, a: str, fmt: str) -> str:
        return ci(getattr(r, key)[a], getattr(r, f"{key}_interval")[a], fmt)

    return [
        r.concurrency,
        arm("tok_s", "plain", "{:.1f}"),
        arm("tok_s", "spec", "{:.1f}"),
        ci(r.throughput_speedup, r.throughput_speedup_interval, unit="x"),
        arm("tpot_ms", "plain", "{:.1f}"),
        arm("tpot_ms", "spec", "{:.1f}"),
        ci(r.tpot_speedup, r.tpot_speedup_interval, unit="x"),
        ci(r.tau, r.tau_interval, "{:.3f}"),
        f"{r.identical}/{r.compared}",
    ]


def levels_table(rows: list[Level]) -> str:
    header = ["N", "plain tok/s", "spec tok/s", "throughput speedup", "plain TPOT ms", "spec TPOT ms"]
    header += ["TPOT speedup", "τ (spec)", "spec text == plain"]
    return table(header, [row_cells(r) for r in rows])


def speedup_series(ax, passes: dict[str, list[Level]], key: str) -> None:
    """One series per pass, shifted apart on the log axis so that the error bars do not overlap."""
    for i, (label, rows) in enumerate(passes.items()):
        keep = [r for r in rows if getattr(r, key) is not None]
        ys, ivs = [getattr(r, key) for r in keep], [getattr(r, f"{key}_interval") for r in keep]
        xs = [r.concurrency * 1.04 ** (i - (len(passes) - 1) / 2) for r in keep]
        ax.errorbar(xs, ys, yerr=errors(ys, ivs), marker="o", capsize=3, label=label or "spec")
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)


def speedup_plot(passes: dict[str, list[Level]], path: Path) -> Path:
    fig = Figure(figsize=(10, 3.8))
    left, right = fig.subplots(1, 2)
    ns = sorted({r.concurrency for rows in passes.values() for r in rows})
    speedup_series(left, passes, "throughput_speedup")
    left.set(xscale="log", xlabel="concurrent requests", ylabel="spec / plain", title="throughput speedup (95% CI)")
    speedup_series(right, passes, "tpot_speedup")
    right.set(xscale="log", xlabel="concurrent requests", ylabel="plain / spec", title="TPOT speedup (95% CI)")
    for ax in (left, right):
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.legend()
    return save(fig, path)


def idle_cpu(blocks: list[Block]) -> str:
    """CPU the idle server used while the other arm's blocks ran: whether an idle vLLM server spins."""
    idle = sum(b.cpu_s.get("spec" if b.arm == "plain" else "plain", 0.0) for b in blocks)
    busy = sum(b.cpu_s.get(b.arm, 0.0) for b in blocks)
    wall = sum(b.wall_s for b in blocks)
    if not wall:
        return ""
    return (
        f"While one arm's blocks ran ({wall:.0f} s in all), its server used {busy:.0f} CPU s and the idle one "
        f"{idle:.1f} CPU s ({100 * idle / wall:.1f}% of a core)."
    )


FEW_ROUNDS = 5


def few_rounds(rows: list[Level]) -> str:
    rounds = min((r.rounds for r in rows), default=0)
    if rounds >= FEW_ROUNDS:
        return ""
    return (
        f"Throughput intervals are over {rounds} round(s) only: under {FEW_ROUNDS} a bootstrap over rounds gives "
        "intervals too narrow to trust (one round: none); run more `--rounds`."
    )


def failures(blocks: list[Block]) -> str:
    failed = [b for b in blocks for r in b.requests if r.text is None]
    if not failed:
        return ""
    where = sorted({(f"{b.draft} {b.arm}".strip(), b.concurrency) for b in failed})
    return f"**{len(failed)} requests failed** (not counted), in " + ", ".join(f"{a} N={n}" for a, n in where) + "."


def pass_section(label: str, rows: list[Level], spec: dict | None) -> str:
    """One pass's table and verdict, under a heading with its draft setting where it has a label."""
    options = {k: v for k, v in (spec or {}).items() if k not in ("method", "model")}
    head = (f"## {label}" + (f": `{json.dumps(options)}`" if options else "") + "\n\n") if label else ""
    return head + levels_table(rows) + "\n\n" + verdict(rows)


def render(passes: dict[str, list[Level]], blocks: list[Block], meta: dict, plot: Path, sweep: Sweep | None) -> str:
    specs = {p["label"]: p.get("spec") for p in meta.get("passes", [])}
    schedule = points(passes.get(SCHEDULE, []), 0)
    parts = [
        "# Speculation under concurrency, through vLLM",
        meta["setting"],
        draft_lengths_section(sweep, schedule) if sweep else "",
        f"**The schedule's pass failed**: {meta['schedule_failed']}" if meta.get("schedule_failed") else "",
        *(pass_section(label, rows, specs.get(label)) for label, rows in passes.items()),
        few_rounds([r for rows in passes.values() for r in rows]),
        failures(blocks),
        "N: requests in flight (closed loop). tok/s: output tokens over the block's wall time, pooled over rounds. "
        "TPOT: (latency - TTFT) / (tokens - 1) per request, streamed, mean over requests. Speedups: spec / plain for "
        "throughput, plain / spec for TPOT (above 1: speculation helps). Brackets: 95% bootstrap intervals, over "
        "rounds for throughput (both arms' blocks of a round drawn together), over (round, prompt) pairs for TPOT. "
        "τ = 1 + accepted / drafts from vLLM's /metrics. Last column: greedy outputs whose text is equal.",
        idle_cpu(blocks),
        f"![speedup vs concurrency]({plot.name})",
    ]
    return "\n\n".join(p for p in parts if p) + "\n"


def by_pass(blocks: list[Block]) -> dict[str, list[Block]]:
    found: dict[str, list[Block]] = {}
    for b in blocks:
        found.setdefault(b.draft, []).append(b)
    return found


def points(rows: list[Level], k: int) -> list[Point]:
    return [Point(k, r.concurrency, r.throughput_speedup, r.throughput_speedup_interval) for r in rows]


def sweep_of(meta: dict, passes: dict[str, list[Level]], out: Path) -> Sweep | None:
    """The draft-length sweep: every pass of a fixed K (meta["passes"]), where meta says how it was served."""
    ks = {p["label"]: p["k"] for p in meta.get("passes", []) if p.get("k")}
    measured = [p for label, rows in passes.items() if label in ks for p in points(rows, ks[label])]
    if "sweep" not in meta or not measured:
        return None
    return Sweep(**meta["sweep"], points=measured, source=str(out / "results.json"))


def pass_entries(meta: dict, passes: dict[str, list[Level]]) -> list[dict]:
    known = {p["label"]: p for p in meta.get("passes", [])}
    entries = []
    for label, rows in passes.items():
        n, why = stops_paying(rows)
        found = {"levels": [asdict(r) for r in rows], "stops_paying_at": n, "stops_paying_because": why}
        entries.append(known.get(label, {"label": label}) | found)
    return entries


def write_report(blocks: list[Block], meta: dict, out: Path) -> dict[str, list[Level]]:
    """results.json, report.md and the plot; the levels of each pass, by its label."""
    passes = {label: levels(bs) for label, bs in by_pass(blocks).items()}
    plot = speedup_plot(passes, out / PLOT)
    sweep = sweep_of(meta, passes, out)
    result = meta | {"passes": pass_entries(meta, passes)} | ({"draft_lengths": record(sweep)} if sweep else {})
    result["blocks"] = [asdict(b) | {"requests": [asdict(r) | {"text": None} for r in b.requests]} for b in blocks]
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "report.md").write_text(render(passes, blocks, meta, plot, sweep))
    return passes
