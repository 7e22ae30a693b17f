"""results.json -> DIR/report.md (tables a person reads) and the PNG plots next to it."""

from __future__ import annotations

import json
from pathlib import Path

from .plots import write_plots


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def overall(r: dict) -> str:
    b = r["baseline"]
    rows = [["ar", f"{b['tokens_per_s']:.1f}", "1.00x", "-", "-", f"{b['ttft_ms']:.0f}", f"{b['tpot_ms']:.1f}", "-"]]
    for label, m in r["methods"].items():
        spread = m.get("speedup_per_repeat", [])
        span = f" ({min(spread):.2f}-{max(spread):.2f})" if len(spread) > 1 else ""
        rows.append(
            [
                label,
                f"{m['tokens_per_s']:.1f}",
                f"{m['speedup']:.2f}x{span}",
                f"{m['mean_acceptance_length']:.2f}",
                f"{m['draft_acceptance_rate']:.2f}",
                f"{m['ttft_ms']:.0f}",
                f"{m['tpot_ms']:.1f}",
                lossless_cell(m),
            ]
        )
    header = ["method", "tokens/s", "speedup", "τ", "draft acc.", "TTFT ms", "TPOT ms", "lossless"]
    return table(header, rows)


def lossless_cell(m: dict) -> str:
    if "distribution_check" in m:
        d = m["distribution_check"]
        return "n/a" if d["p_value"] is None else f"TV {d['tv_distance']:.3f}, p={d['p_value']:.2f}"
    return f"{m['lossless']['identical']}/{m['lossless']['checked']}"


def by_category(r: dict, key: str, fmt: str) -> str:
    cats = list(r["by_category"])
    rows = [
        [label] + [fmt.format(r["by_category"][c]["methods"][label][key]) for c in cats] + [fmt.format(m[key])]
        for label, m in r["methods"].items()
    ]
    return table(["method", *cats, "all"], rows)


def acceptance(r: dict) -> str:
    depth = max((len(m["acceptance_rate_per_position"]) for m in r["methods"].values()), default=0)
    rates = {label: m["acceptance_rate_per_position"] for label, m in r["methods"].items()}
    rows = [[label] + [f"{x:.2f}" for x in a] + ["-"] * (depth - len(a)) for label, a in rates.items()]
    return table(["method", *(str(i) for i in range(1, depth + 1))], rows) if depth else "(no drafts)"


def lossless_line(r: dict) -> str:
    if r["temperature"] > 0:
        parts = [f"{label}: {lossless_cell(m)}" for label, m in r["methods"].items()]
        test = next(iter(r["methods"].values()))["distribution_check"]["test"]
        return f"Sampling at T={r['temperature']}: {test}; " + "; ".join(parts) + ". A small p flags a sampling bug."
    same, checked = r["lossless"]["identical"], r["lossless"]["checked"]
    verdict = "lossless" if same == checked else "NOT lossless: outputs differ from plain decoding"
    return f"Greedy: {same}/{checked} turns identical to plain decoding ({verdict})."


def study(s: dict) -> str:
    rows = [
        [
            "on" if c["prefix_cache"] else "off",
            c["speculation"] or "plain",
            f"{c['ttft_ms']:.0f}",
            f"{c['tpot_ms']:.1f}",
            f"{c['total_ms']:.0f}",
            f"{c['prefix_cache_hit_rate']:.0%}",
        ]
        for c in s["cells"]
    ]
    text = table(["prefix cache", "speculation", "TTFT ms", "TPOT ms", "total ms", "cache hit"], rows)
    same = s["identical"]
    check = f"\n\nOutputs identical to the plain uncached cell: {same['identical']}/{same['checked']}." if same else ""
    return f"{text}\n\n**Finding:** {s['finding']}{check}"


def environment(r: dict) -> str:
    env = r["environment"]
    rows = [[k, env.get(k, "")] for k in ("device", "dtype", "torch", "python", "threads", "cpu_count", "commit")]
    return table(["", ""], rows)


def render(r: dict, plots: list[Path]) -> str:
    source = f"suite {r['suite']}" if r["suite"] else f"prompts {r['prompts_file']}"
    partial = "\n\n**PARTIAL: interrupted; counts only the prompts every method finished.**" if r["partial"] else ""
    parts = [
        f"# Eval: {', '.join(r['methods'])} vs plain decoding on {source}{partial}",
        f"Target {r['target']}, {r['prompts']} prompts x {r['repeats']} repeat(s), {r['max_new_tokens']} new tokens, "
        f"temperature {r['temperature']}, prefix cache {'on' if r['prefix_cache']['enabled'] else 'off'}.",
        "## Overall\n\n" + overall(r),
        lossless_line(r),
        "## Speedup by category\n\n" + by_category(r, "speedup", "{:.2f}x"),
        "## τ by category\n\n" + by_category(r, "mean_acceptance_length", "{:.2f}"),
        "## Per-position acceptance\n\n" + acceptance(r),
    ]
    if "study" in r:
        parts.append("## Prefix cache x speculation\n\n" + study(r["study"]))
    parts.append("## Plots\n\n" + "\n".join(f"![{p.stem}]({p.name})" for p in plots))
    parts.append("## Environment\n\n" + environment(r))
    return "\n\n".join(parts) + "\n"


def write_report(out: str | Path, results: dict | None = None) -> Path:
    """DIR/report.md and its PNGs, from `results` or from DIR/results.json."""
    out = Path(out)
    results = results or json.loads((out / "results.json").read_text())
    plots = write_plots(results, out)
    path = out / "report.md"
    path.write_text(render(results, plots))
    return path
