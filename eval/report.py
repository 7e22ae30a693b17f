"""results.json -> DIR/report.md (tables a person reads) and the PNG plots next to it."""

from __future__ import annotations

from pathlib import Path

from .calibration_report import calibration_table, steps_table
from .machine import describe
from .plots import write_plots
from .results import Compared, Effect, MethodResult, RunResult, StudyResult, Summary, load_results
from .stats import position_intervals


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def ci(value: float | None, iv: list[float] | None, fmt: str = "{:.2f}", unit: str = "") -> str:
    """'1.18x [1.10, 1.26]': a number and its 95% interval (the number alone where there is none)."""
    if value is None:
        return "undefined"
    text = fmt.format(value) + unit
    return text if not iv else f"{text} [{fmt.format(iv[0])}, {fmt.format(iv[1])}]"


def speedup_cell(m: Compared) -> str:
    flag = " (not significant)" if m.significant is False else ""
    return ci(m.speedup, m.interval("speedup"), unit="x") + flag


def plain_share(m: Summary) -> str:
    """'  plain 35%': the share of steps that verified no draft (the policy's choice, or nothing found)."""
    total = sum(m.steps.values())
    return f"  plain {m.steps.get('plain', 0) / total:.0%}" if total and m.steps.get("plain") else ""


def number(s: Summary, key: str, fmt: str = "{:.2f}") -> str:
    """A summary's number with its interval: number(m, "tpot_ms", "{:.1f}")."""
    return ci(getattr(s, key), s.interval(key), fmt)


def overall(r: RunResult) -> str:
    b = r.baseline
    rows = [
        ["ar", number(b, "tokens_per_s", "{:.1f}"), "1.00x", "-", "-"]
        + [number(b, "ttft_ms", "{:.0f}"), number(b, "tpot_ms", "{:.1f}"), "-"]
    ]
    for label, m in r.methods.items():
        rows.append(
            [
                label,
                number(m, "tokens_per_s", "{:.1f}"),
                speedup_cell(m),
                number(m, "mean_acceptance_length"),
                f"{m.draft_acceptance_rate:.2f}",
                number(m, "ttft_ms", "{:.0f}"),
                number(m, "tpot_ms", "{:.1f}"),
                lossless_cell(m),
            ]
        )
    header = ["method", "tokens/s", "speedup", "τ", "draft acc.", "TTFT ms", "TPOT ms", "lossless"]
    return table(header, rows)


def intervals_line(r: RunResult) -> str:
    return (
        f"Brackets: 95% intervals, a percentile bootstrap over the {r.prompts} prompts (all turns and repeats of a "
        "prompt resampled together; speedup paired with plain decoding on the same prompts). A speedup whose "
        "interval holds 1.00x is marked not significant. With few prompts the intervals are optimistic."
    )


def lossless_cell(m: MethodResult) -> str:
    if m.distribution_check is not None:
        d = m.distribution_check
        return f"n/a ({d.note})" if d.p_value is None else f"TV {d.tv_distance:.3f}, p={d.p_value:.2f}"
    return f"{m.lossless.identical}/{m.lossless.checked}"


def category_table(r: RunResult, key: str, fmt: str) -> str:
    cats = list(r.by_category)

    def cell(m: Compared) -> str:
        return speedup_cell(m) if key == "speedup" else number(m, key, fmt)

    rows = [
        [label] + [cell(r.by_category[c].methods[label]) for c in cats] + [cell(m)] for label, m in r.methods.items()
    ]
    return table(["method", *cats, "all"], rows)


def acceptance(r: RunResult) -> str:
    depth = max((len(m.acceptance_rate_per_position) for m in r.methods.values()), default=0)
    rows = []
    for label, m in r.methods.items():
        rates = m.acceptance_rate_per_position
        cells = [ci(x, i) for x, i in zip(rates, position_intervals(m), strict=True)]
        rows.append([label, *cells] + ["-"] * (depth - len(rates)))
    return table(["method", *(str(i) for i in range(1, depth + 1))], rows) if depth else "(no drafts)"


def verify_rows(r: RunResult) -> str:
    """Rows a target pass verified (the pending token plus the draft nodes sent; spec.verify=cost cuts them) and the
    proposer's time per pass."""
    rows = [
        [label, f"{m.mean_verify_rows:.2f}", f"{m.draft_ms_per_step:.2f}", rows_shares(m.verify_rows)]
        for label, m in r.methods.items()
    ]
    return table(["method", "mean rows", "draft ms/step", "share of steps by rows"], rows)


def rows_shares(counts: list[int]) -> str:
    """'1: 10%, 4: 90%': each row count a step verified and its share of the steps."""
    steps = sum(counts)
    return ", ".join(f"{i + 1}: {c / steps:.0%}" for i, c in enumerate(counts) if c) if steps else "-"


def lossless_line(r: RunResult) -> str:
    if r.temperature > 0:
        parts = [f"{label}: {lossless_cell(m)}" for label, m in r.methods.items()]
        assert r.spec.distribution_check is not None, "sampled runs check the distribution"
        test = r.spec.distribution_check.test
        sampling = f"T={r.temperature}, top_p={r.top_p}, top_k={r.top_k}"
        return f"Sampling at {sampling}: {test}; " + "; ".join(parts) + ". A small p flags a sampling bug."
    same, checked = r.lossless.identical, r.lossless.checked
    verdict = "lossless" if same == checked else "NOT lossless: outputs differ from plain decoding"
    return f"Greedy: {same}/{checked} turns identical to plain decoding ({verdict})."


EFFECTS = {
    "control": "control: plain TPOT, cache on / off (should be 1.00x)",
    "prefill": "prefix cache: TTFT cut (plain, off / on)",
    "decode_cold": "speculation: TPOT cut without the cache",
    "decode_hit": "speculation: TPOT cut with the cache",
    "stacking": "decode cut without / with the cache (1.00x: they stack)",
    "total": "both: total latency cut (plain off / speculation on)",
}


def effect_cell(e: Effect) -> str:
    return ci(e.ratio, e.interval, unit="x")


def study(s: StudyResult) -> str:
    rows = [
        [
            "on" if c.prefix_cache else "off",
            c.speculation or "plain",
            ci(c.ttft_ms, c.intervals.get("ttft_ms"), "{:.0f}"),
            ci(c.tpot_ms, c.intervals.get("tpot_ms"), "{:.1f}"),
            ci(c.total_ms, c.intervals.get("total_ms"), "{:.0f}"),
            f"{c.prefix_cache_hit_rate:.0%}",
        ]
        for c in s.cells
    ]
    text = table(["prefix cache", "speculation", "TTFT ms", "TPOT ms", "total ms", "cache hit"], rows)
    effects = [[EFFECTS[k], effect_cell(e)] for k, e in s.effects.items()]
    if effects:
        text += "\n\n" + table(["ratio", "value [95% interval]"], effects)
    same = s.identical
    check = f"\n\nOutputs identical to the plain uncached cell: {same.identical}/{same.checked}." if same else ""
    return f"{text}\n\n**Finding:** {s.finding}{check}"


def busy(r: RunResult) -> str | None:
    """A warning when other processes competed for the CPU: the run's own threads load it to about the CPU count,
    so a 1-minute load average past 1.5x the CPUs means others. Interleaving keeps a steady competitor out of the
    control, not out of the ratios: a speculative step (more rows, a drafter) slows differently from a plain one."""
    env = r.environment
    cpus, loads = env.cpu_count, [x[0] for x in (env.load_before, env.load_after) if x]
    if not cpus or not loads or max(loads) <= 1.5 * cpus:
        return None
    return (
        f"BUSY: load average {max(loads):.2f} on {cpus} CPUs, other processes shared the CPU: times are inflated "
        "and speedups may differ from an idle machine's"
    )


def noise_text(r: RunResult) -> str:
    """The run's own noise controls, in words."""
    env, lines = r.environment, []
    spread = r.noise.repeat_spread
    if spread:
        verdict = "the machine was noisy: compare with care" if r.noise.noisy else "steady"
        lines.append(
            f"Plain decoding's time per token for the same prompt varied by a median {spread.median:.1%} "
            f"(max {spread.max:.1%}) between repeats over {spread.prompts} prompts: {verdict}."
        )
    else:
        lines.append("One repeat: no repeat-to-repeat control (use repeats=2 or more).")
    before, after = env.load_before, env.load_after
    if before and after:
        lines.append(f"Load average (1 min) {before[0]:.2f} before and {after[0]:.2f} after, on {env.cpu_count} CPUs.")
    if warning := busy(r):
        lines.append(warning + ".")
    if r.study and r.study.control.noisy:
        lines.append("The 2x2 study's control failed: its finding is withheld.")
    if r.study and r.study.control.undefined:
        lines.append("The 2x2 study's control is undefined (no decode steps): its finding is withheld.")
    return " ".join(lines)


def skipped(r: RunResult) -> str:
    s = r.skipped
    if not s.turns:
        return "No turn was skipped."
    rows = [[x.id, x.turn + 1, x.method, x.reason] for x in s.list]
    head = f"{s.turns} turn(s) skipped, not counted anywhere above:\n\n"
    return head + table(["prompt", "turn", "method", "why"], rows)


def environment_table(r: RunResult) -> str:
    env = r.environment
    keys = ("device", "cpu_flags", "gpu", "dtype", "torch", "python", "threads", "cpu_count", "commit")
    rows = [["machine", describe(env)]] + [[k, getattr(env, k)] for k in keys]
    return table(["", ""], rows)


def settings_line(r: RunResult) -> str:
    sampling = "greedy" if r.temperature == 0 else f"temperature {r.temperature}, top_p {r.top_p}, top_k {r.top_k}"
    return (
        f"Target {r.target}, {r.prompts} prompts x {r.repeats} repeat(s), {r.max_new_tokens} new tokens, "
        f"{sampling}, seed {r.config.seed}, prefix cache {'on' if r.prefix_cache.enabled else 'off'}, "
        f"cuda_graphs {r.config.cuda_graphs}, max_seq_len {r.config.max_seq_len}."
    )


CALIBRATION_NOTE = (
    "\n\nNodes whose parent was accepted, with the draft policy's acceptance estimate (spec.verify=policy, or "
    "spec.policy.report_estimates=true beside a draft verified whole or cut) and what was accepted; ECE: the "
    "expected calibration error over ten estimate bins. A drafter whose probabilities are NaN, or that gives none, is "
    "judged by observed acceptance alone."
)


def render(r: RunResult, plots: list[Path]) -> str:
    source = f"suite {r.suite}" if r.suite else f"prompts {r.prompts_file}"
    partial = "\n\n**PARTIAL: interrupted; counts only the prompts every method finished.**" if r.partial else ""
    parts = [
        f"# Eval: {', '.join(r.methods)} vs plain decoding on {source}{partial}",
        settings_line(r),
        "## Overall\n\n" + overall(r),
        intervals_line(r),
        lossless_line(r),
        "## Speedup by category\n\n" + category_table(r, "speedup", "{:.2f}x"),
        "## τ by category\n\n" + category_table(r, "mean_acceptance_length", "{:.2f}"),
        "## Per-position acceptance\n\n" + acceptance(r),
        "## Verify rows per step\n\n" + verify_rows(r),
        "## Steps: plain, probe, whole or cut\n\n" + table(*steps_table(r.methods)),
    ]
    if calibrated := calibration_table(r.methods):
        parts.append("## Acceptance estimates against what was accepted\n\n" + table(*calibrated) + CALIBRATION_NOTE)
    if r.study:
        parts.append("## Prefix cache x speculation\n\n" + study(r.study))
    parts.append("## Noise\n\n" + noise_text(r))
    parts.append("## Skipped turns\n\n" + skipped(r))
    parts.append("## Plots\n\n" + "\n".join(f"![{p.stem}]({p.name})" for p in plots))
    parts.append("## Environment\n\n" + environment_table(r))
    return "\n\n".join(parts) + "\n"


def write_report(out: str | Path, results: RunResult | None = None) -> Path:
    """DIR/report.md and its PNGs, from `results` or from DIR/results.json."""
    out = Path(out)
    results = results or load_results(out / "results.json")
    plots = write_plots(results, out)
    path = out / "report.md"
    path.write_text(render(results, plots))
    return path
