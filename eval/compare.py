"""draftsmith-compare EVAL1 EVAL2 ... out=REPORT: one report over several eval folders, e.g. a sweep over draft
size (a sweep folder DIR stands for its numbered runs DIR/0, DIR/1, ...): speedup and tau with their intervals
against drafter parameters, with the Pareto front; which differences between runs are significant, and a warning
when the runs come from different machines, differ in settings that change speed or outputs, or when a run of a
sweep is unfinished (named, left out)."""

from __future__ import annotations

import itertools
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .journal import RECORDS
from .machine import describe, machine_key
from .plots import category_plot, params_plot
from .report import ci, table
from .results import Compared, Environment, MethodResult, RunResult, load_results, to_json

USAGE = "usage: draftsmith-compare EVAL1 EVAL2 ... out=REPORT   (each EVAL: a draftsmith-eval out folder)"


def parse_args(argv: list[str]) -> tuple[list[str], Path]:
    outs = [a.removeprefix("out=") for a in argv if a.startswith("out=")]
    keys = [a for a in argv if "=" in a and not a.startswith("out=")]
    folders = [a for a in argv if "=" not in a]
    if keys:
        raise ValueError(f"unknown argument {keys[0]!r}; {USAGE}")
    if len(outs) != 1 or not outs[0]:
        raise ValueError(f"give one out=REPORT; {USAGE}")
    if not folders:
        raise ValueError(f"give at least one eval folder; {USAGE}")
    out = Path(outs[0])
    if (out / "results.json").is_file() or out.resolve() in {Path(f).resolve() for f in folders}:
        raise ValueError(f"out={out} is an eval folder (its report.md and plots would be overwritten): pick another")
    return folders, out


def find_evals(folders: list[str]) -> tuple[list[Path], list[Path]]:
    """Each folder holds results.json, or is a sweep folder whose subfolders do; also the runs left unfinished
    (records.jsonl without results.json: a crash or a kill), which have nothing to compare yet but are named."""
    found: list[Path] = []
    unfinished: list[Path] = []
    for name in folders:
        folder = Path(name)
        runs = [folder] if is_run(folder) else numbered(p for p in folder.glob("*") if is_run(p))
        if not runs:
            raise FileNotFoundError(f"{folder} is not an eval folder: no results.json in it or in its subfolders")
        for run in runs:
            (found if (run / "results.json").is_file() else unfinished).append(run)
    if not found:
        raise ValueError("no finished eval to compare; " + "; ".join(unfinished_notes(unfinished)))
    return found, unfinished


def is_run(folder: Path) -> bool:
    """An eval run, finished (results.json) or not (records.jsonl only)."""
    return (folder / "results.json").is_file() or (folder / RECORDS).is_file()


def numbered(runs) -> list[Path]:
    """A sweep's runs in job order: 0, 1, ..., 10 (not 0, 1, 10)."""
    return sorted(runs, key=lambda p: (len(p.name), p.name))


def unfinished_notes(unfinished: list[Path]) -> list[str]:
    return [f"unfinished: {p} (resume=true finishes it)" for p in unfinished]


def labels_for(evals: list[Path]) -> list[str]:
    names = [p.name for p in evals]
    return names if len(set(names)) == len(names) else [f"{p.parent.name}/{p.name}" for p in evals]


@dataclass
class Row:
    """One method of one eval, as compared (compare.json holds a list of them)."""

    label: str  # run:method
    eval: str
    target: str
    suite: str
    drafter: str | None
    drafter_params: int | None
    drafter_dtype: str | None  # the dtype its drafter ran in
    draft_shape: str
    speedup: float
    mean_acceptance_length: float
    intervals: dict[str, Any]  # speedup, mean_acceptance_length
    significant: bool | None
    environment: Environment
    tokens_per_s: float
    lossless: str
    partial: bool
    settings: dict[str, Any]  # RunResult.settings(): a difference is warned about
    by_category: dict[str, Compared]


def load_rows(evals: list[Path]) -> list[Row]:
    rows = []
    for folder, name in zip(evals, labels_for(evals), strict=True):
        r = load_results(folder / "results.json")
        for label, m in r.methods.items():
            rows.append(row(folder, f"{name}:{label}", r, m))
    return rows


def row(folder: Path, label: str, r: RunResult, m: MethodResult) -> Row:
    return Row(
        label=label,
        eval=str(folder),
        target=r.target,
        suite=r.source,
        drafter=m.config.get("drafter"),
        drafter_params=m.drafter_params,
        drafter_dtype=m.drafter_dtype,
        draft_shape=m.draft_shape(),
        speedup=m.speedup,
        mean_acceptance_length=m.mean_acceptance_length,
        intervals={k: m.interval(k) for k in ("speedup", "mean_acceptance_length")},
        significant=m.significant,
        environment=r.environment,
        tokens_per_s=m.tokens_per_s,
        lossless=f"{m.lossless.identical}/{m.lossless.checked}" if r.temperature == 0 else "sampled",
        partial=r.partial,
        settings=r.settings(),
        by_category={c: v.methods[m.method] for c, v in r.by_category.items()},
    )


def render(rows: list[Row], plots: list[Path], warnings: list[str]) -> str:
    params = lambda n: "-" if n is None else "0" if n == 0 else f"{n / 1e6:.2f}M"  # noqa: E731
    dtype = lambda r: f" {r.drafter_dtype}" if r.drafter_dtype else ""  # noqa: E731
    table_rows = [
        [
            r.label + (" (partial)" if r.partial else ""),
            r.suite,
            params(r.drafter_params) + dtype(r),
            r.draft_shape,
            ci(r.speedup, r.intervals["speedup"], unit="x") + (" (n.s.)" if r.significant is False else ""),
            ci(r.mean_acceptance_length, r.intervals["mean_acceptance_length"]),
            f"{r.tokens_per_s:.1f}",
            r.lossless,
        ]
        for r in rows
    ]
    header = ["run:method", "suite", "drafter params", "draft", "speedup [95%]", "τ [95%]", "tokens/s", "lossless"]
    parts = ["# Comparison of " + ", ".join(sorted({r.eval for r in rows})), table(header, table_rows)]
    parts.append("n.s.: the speedup's interval holds 1.00x. " + machines_note(rows))
    parts += [f"**Warning:** {w}" for w in warnings]
    targets = sorted({r.target for r in rows})
    if len(targets) > 1:
        parts.append(f"**Note:** these evals ran on different targets ({', '.join(targets)}); compare with care.")
    parts.append("## Differences between runs\n\n" + differences(rows))
    cats = common_categories(rows)
    if cats:
        cat_rows = [[r.label] + [ci(m.speedup, m.interval("speedup"), unit="x") for m in cols(r, cats)] for r in rows]
        parts.append("## Speedup by category\n\n" + table(["run:method", *cats], cat_rows))
    parts.append("## Plots\n\n" + "\n".join(f"![{p.stem}]({p.name})" for p in plots))
    return "\n\n".join(parts) + "\n"


def cols(row: Row, cats: list[str]) -> list[Compared]:
    return [row.by_category[c] for c in cats]


def machines_note(rows: list[Row]) -> str:
    """A warning when the evals ran on different machines: speed is comparable only within one."""
    machines = {machine_key(r.environment): describe(r.environment) for r in rows}
    if len(machines) <= 1:
        return f"All runs on one machine: {next(iter(machines.values()), 'unknown')}."
    return (
        "**Warning: these runs come from different machines** ("
        + "; ".join(sorted(machines.values()))
        + "): speedups measured on different CPUs are not comparable."
    )


def settings_note(rows: list[Row]) -> str | None:
    """A warning when the runs differ in a setting that changes speed or outputs (dtype, prompts, lengths, sampling,
    the prefix cache, CUDA graphs: RunResult.settings)."""
    differ = {k: sorted({str(r.settings[k]) for r in rows}) for k in rows[0].settings}
    differ = {k: v for k, v in differ.items() if len(v) > 1}
    if not differ:
        return None
    named = "; ".join(f"{k}: {', '.join(v)}" for k, v in differ.items())
    return f"these runs differ in settings that change speed or outputs ({named}): compare with care"


def log_se(iv: list[float] | None) -> float | None:
    """Standard error of log(speedup) read off a 95% interval."""
    return None if not iv or iv[0] <= 0 else (math.log(iv[1]) - math.log(iv[0])) / (2 * 1.96)


def differences(rows: list[Row]) -> str:
    """Each pair of runs on the same suite: is their speedup difference significant (z-test on log speedup, the
    standard errors read off each run's interval; runs on different prompts are independent samples)?"""
    out = []
    for a, b in itertools.combinations(rows, 2):
        if a.suite != b.suite:
            continue
        se_a, se_b = log_se(a.intervals["speedup"]), log_se(b.intervals["speedup"])
        if se_a is None or se_b is None or a.speedup <= 0 or b.speedup <= 0:
            verdict = "no intervals"
        else:
            gap, se = abs(math.log(a.speedup / b.speedup)), math.hypot(se_a, se_b)
            verdict = "significant" if (gap > 1.96 * se if se else gap > 0) else "not significant"
        out.append([a.label, b.label, f"{a.speedup:.2f}x vs {b.speedup:.2f}x", verdict])
    return table(["run:method", "run:method", "speedup", "difference"], out) if out else "(one run per suite)"


def common_categories(rows: list[Row]) -> list[str]:
    return [c for c in rows[0].by_category if all(c in r.by_category for r in rows)]


def compare(folders: list[str], out: Path) -> tuple[Path, list[str]]:
    """Reads every folder first (a bad one fails before anything is written), then writes out/report.md.
    Returns it with the warnings it holds (unfinished runs left out, settings that differ)."""
    evals, unfinished = find_evals(folders)
    rows = load_rows(evals)
    warnings = unfinished_notes(unfinished) + [n for n in [settings_note(rows)] if n]
    out.mkdir(parents=True, exist_ok=True)
    cats = common_categories(rows)
    by_cat = {c: {r.label: r.by_category[c] for r in rows} for c in cats}
    plots = [
        params_plot(rows, out / "speedup_vs_params.png"),
        category_plot(by_cat, out / "speedup_by_category.png") if cats else None,
    ]
    made = [p for p in plots if p is not None]
    (out / "compare.json").write_text(json.dumps(to_json(rows), indent=2) + "\n")
    path = out / "report.md"
    path.write_text(render(rows, made, warnings))
    return path, warnings


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return
    try:
        folders, out = parse_args(argv)
        path, warnings = compare(folders, out)
    except (ValueError, FileNotFoundError) as e:
        print(f"draftsmith-compare: {e}", file=sys.stderr)
        sys.exit(2)
    for w in warnings:
        print(f"warning: {w}")
    print(f"report: {path}")


if __name__ == "__main__":
    main()
