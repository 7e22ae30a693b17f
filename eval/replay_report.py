"""draftsmith-eval replay=LOG out=DIR: DIR/replay_results.json, report.md (tables a person reads) and
replay_windows.png (τ and tokens/s per window, one line per log, with their 95% intervals)."""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from draftsmith.files import write_text_atomic

from .plots import errors, save
from .replay_log import read_log
from .replay_results import Comparison, LogSummary, Percentiles, ReplayResult, Window, dump_replay
from .replay_stats import replay_result
from .report import ci, table

RESULTS, PLOT = "replay_results.json", "replay_windows.png"


def seconds(p: Percentiles) -> str:
    if not p.n:
        return "-"
    return " / ".join(f"{1000 * v:.0f}" for v in (p.p50, p.p90, p.p99) if v is not None) + " ms"


def rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def summary_table(logs: list[LogSummary]) -> str:
    header = ["log", "requests", "ok", "failed", "tokens/s (wall)", "tokens/s per request", "τ"]
    header += ["latency p50/p90/p99", "TTFT p50/p90/p99"]
    rows = [
        [s.label, s.requests, s.ok, failed_cell(s), rate(s.throughput_tokens_per_s)]
        + [
            ci(s.overall.tokens_per_s, s.overall.tokens_per_s_interval, "{:.1f}"),
            ci(s.overall.tau, s.overall.tau_interval),
        ]
        + [seconds(s.latency_s), seconds(s.ttft_s)]
        for s in logs
    ]
    return table(header, rows)


def failed_cell(s: LogSummary) -> str:
    return str(s.failed) + (" (" + ", ".join(f"{k}: {n}" for k, n in s.failures.items()) + ")" if s.failures else "")


def windows_table(s: LogSummary) -> str:
    rows = [
        [w.index + 1, f"{w.first + 1}-{w.first + w.requests}", w.ok]
        + [ci(w.tau, w.tau_interval), ci(w.tokens_per_s, w.tokens_per_s_interval, "{:.1f}")]
        for w in s.windows
    ]
    return f"### {s.label}\n\n" + table(["window", "requests", "ok", "τ", "tokens/s per request"], rows)


def comparison_table(c: Comparison) -> str:
    a, b = c.labels
    rows = []
    for w in [*c.windows, c.overall]:
        name = "all" if w.index < 0 else w.index + 1
        taus = " / ".join("-" if t is None else f"{t:.2f}" for t in w.tau)
        rows.append(
            [name, w.paired, taus, ci(w.tau_ratio, w.tau_ratio_interval, unit="x")]
            + [ci(w.tokens_per_s_ratio, w.tokens_per_s_ratio_interval, unit="x")]
        )
    header = ["window", "paired requests", f"τ {a} / {b}", f"τ {b} ÷ {a}", f"tokens/s {b} ÷ {a}"]
    return table(header, rows)


def runs_line(s: LogSummary) -> str:
    parts = []
    for r in s.runs:
        at = f"{r.get('rate')} req/s ({r.get('arrivals')}, seed {r.get('seed')})" if r.get("rate") else "closed loop"
        parts.append(
            f"{r.get('started')}: {r.get('model')} at {r.get('base_url')}, {at}, concurrency {r.get('concurrency')}, "
            f"max_tokens {r.get('max_tokens')}, temperature {r.get('temperature')}, stream {r.get('stream')}"
        )
    return f"- **{s.label}** ({s.path}, TTFT from the {s.ttft_source}): " + "; ".join(parts)


def render(r: ReplayResult, plot: Path) -> str:
    parts = [
        "# Replay: " + " vs ".join(s.label for s in r.logs),
        "\n".join(runs_line(s) for s in r.logs),
        "## Overall\n\n" + summary_table(r.logs),
        "tokens/s (wall): completion tokens over the run's wall time. tokens/s per request: completion tokens over "
        "the requests' latencies (queueing included). τ = 1 + accepted / drafts. Brackets: 95% bootstrap intervals "
        "over requests.",
    ]
    if r.comparison:
        parts.append(f"## {r.comparison.labels[1]} over {r.comparison.labels[0]}, window by window\n\n")
        parts[-1] += comparison_table(r.comparison) + "\n\nPaired: the same requests of the stream in both logs."
    parts.append(f"## Per window of {r.window} requests\n\n" + "\n\n".join(windows_table(s) for s in r.logs))
    parts.append(f"## Plot\n\n![windows]({plot.name})")
    return "\n\n".join(parts) + "\n"


def windows_plot(logs: list[LogSummary], path: Path) -> Path:
    fig = Figure(figsize=(10, 3.6))
    left, right = fig.subplots(1, 2)
    for ax, key, name in ((left, "tau", "τ"), (right, "tokens_per_s", "tokens/s per request")):
        for s in logs:
            ws = [w for w in s.windows if getattr(w, key) is not None]
            ys = [getattr(w, key) for w in ws]
            ivs = [getattr(w, f"{key}_interval") for w in ws]
            ax.errorbar([w.index + 1 for w in ws], ys, yerr=errors(ys, ivs), marker="o", capsize=3, label=s.label)
        ax.set(xlabel="window", ylabel=name, title=f"{name} per window")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend()
    return save(fig, path)


def write_replay_report(paths: list[str], labels: list[str] | None, size: int, out: str | Path) -> ReplayResult:
    result = replay_result([read_log(p) for p in paths], labels, size)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / RESULTS, dump_replay(result))
    plot = windows_plot(result.logs, out / PLOT)
    write_text_atomic(out / "report.md", render(result, plot))
    return result


def headline(r: ReplayResult) -> str:
    lines = []
    for s in r.logs:
        w: Window = s.overall
        lines.append(
            f"  {s.label}: {s.ok}/{s.requests} ok, {rate(s.throughput_tokens_per_s)} tok/s (wall), "
            f"tau {ci(w.tau, w.tau_interval)}, latency p50/p90/p99 {seconds(s.latency_s)}, {len(s.windows)} windows"
        )
    if r.comparison:
        c = r.comparison
        lines.append(f"  tau {c.labels[1]} / {c.labels[0]}: {ci(c.overall.tau_ratio, c.overall.tau_ratio_interval)}")
    return "\n".join(lines)
