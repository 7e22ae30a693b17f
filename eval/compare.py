"""draftsmith-compare EVAL1 EVAL2 ... out=REPORT: one report over several eval folders, e.g. a sweep over draft
size (a sweep folder DIR stands for its numbered runs DIR/0, DIR/1, ...): speedup and tau against drafter
parameters, with the Pareto front."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .plots import category_plot, params_plot
from .report import table

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


def find_evals(folders: list[str]) -> list[Path]:
    """Each folder holds results.json, or is a sweep folder whose subfolders do."""
    found = []
    for name in folders:
        folder = Path(name)
        if (folder / "results.json").is_file():
            found.append(folder)
            continue
        runs = sorted((p.parent for p in folder.glob("*/results.json")), key=lambda p: (len(p.name), p.name))
        if not runs:
            raise FileNotFoundError(f"{folder} is not an eval folder: no results.json in it or in its subfolders")
        found += runs
    return found


def labels_for(evals: list[Path]) -> list[str]:
    names = [p.name for p in evals]
    return names if len(set(names)) == len(names) else [f"{p.parent.name}/{p.name}" for p in evals]


def load_rows(evals: list[Path]) -> list[dict]:
    rows = []
    for folder, name in zip(evals, labels_for(evals), strict=True):
        try:
            r = json.loads((folder / "results.json").read_text())
            methods = r["methods"] if "methods" in r else {r["spec"]["method"]: r["spec"]}  # issue 2's single form
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{folder}/results.json is not a draftsmith-eval result ({e})") from e
        for label, m in methods.items():
            rows.append(row(folder, f"{name}:{label}", r, m))
    return rows


def row(folder: Path, label: str, r: dict, m: dict) -> dict:
    return {
        "label": label,
        "eval": str(folder),
        "target": r["target"],
        "suite": r.get("suite") or r.get("prompts_file"),
        "drafter": (m.get("config") or {}).get("drafter"),
        "drafter_params": m.get("drafter_params"),
        "speedup": m["speedup"],
        "mean_acceptance_length": m["mean_acceptance_length"],
        "tokens_per_s": m["tokens_per_s"],
        "lossless": f"{m['lossless']['identical']}/{m['lossless']['checked']}" if "lossless" in m else "",
        "partial": r.get("partial", False),
        "by_category": {c: v["methods"][m["method"]]["speedup"] for c, v in r.get("by_category", {}).items()},
    }


def render(rows: list[dict], plots: list[Path]) -> str:
    params = lambda n: "-" if n is None else "0" if n == 0 else f"{n / 1e6:.2f}M"
    table_rows = [
        [
            r["label"] + (" (partial)" if r["partial"] else ""),
            r["suite"],
            params(r["drafter_params"]),
            f"{r['speedup']:.2f}x",
            f"{r['mean_acceptance_length']:.2f}",
            f"{r['tokens_per_s']:.1f}",
            r["lossless"],
        ]
        for r in rows
    ]
    header = ["run:method", "suite", "drafter params", "speedup", "τ", "tokens/s", "lossless"]
    parts = ["# Comparison of " + ", ".join(sorted({r["eval"] for r in rows})), table(header, table_rows)]
    targets = sorted({r["target"] for r in rows})
    if len(targets) > 1:
        parts.append(f"**Note:** these evals ran on different targets ({', '.join(targets)}); compare with care.")
    cats = common_categories(rows)
    if cats:
        cat_rows = [[r["label"]] + [f"{r['by_category'][c]:.2f}x" for c in cats] for r in rows]
        parts.append("## Speedup by category\n\n" + table(["run:method", *cats], cat_rows))
    parts.append("## Plots\n\n" + "\n".join(f"![{p.stem}]({p.name})" for p in plots))
    return "\n\n".join(parts) + "\n"


def common_categories(rows: list[dict]) -> list[str]:
    return [c for c in rows[0]["by_category"] if all(c in r["by_category"] for r in rows)]


def compare(folders: list[str], out: Path) -> Path:
    """Reads every folder first (a bad one fails before anything is written), then writes out/report.md."""
    rows = load_rows(find_evals(folders))
    out.mkdir(parents=True, exist_ok=True)
    cats = common_categories(rows)
    by_cat = {c: {"methods": {r["label"]: {"speedup": r["by_category"][c]} for r in rows}} for c in cats}
    plots = [
        params_plot(rows, out / "speedup_vs_params.png"),
        category_plot(by_cat, out / "speedup_by_category.png") if cats else None,
    ]
    plots = [p for p in plots if p is not None]
    (out / "compare.json").write_text(json.dumps(rows, indent=2) + "\n")
    path = out / "report.md"
    path.write_text(render(rows, plots))
    return path


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return
    try:
        folders, out = parse_args(argv)
        path = compare(folders, out)
    except (ValueError, FileNotFoundError) as e:
        print(f"draftsmith-compare: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"report: {path}")


if __name__ == "__main__":
    main()
