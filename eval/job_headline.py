"""The main job's headline: per method speedup and tau with their 95% intervals and the lossless line on
MT-bench, the 2x2 study on rag (its control and finding), and where the reports are.
Usage: draftsmith-headline runs/main"""

from __future__ import annotations

import sys
from pathlib import Path

from draftsmith.eval.machine import describe
from draftsmith.eval.report import ci, number, plain_share, speedup_cell
from draftsmith.eval.results import RunResult, load_results


def mt_bench_lines(results: RunResult) -> list[str]:
    repeats = f" x {results.repeats} repeats" if results.repeats > 1 else ""
    lines = [
        f"MT-bench ({results.prompts} questions{repeats}, both turns, {results.max_new_tokens} new tokens, "
        f"{results.dtype}, {results.device}): plain decoding "
        f"{number(results.baseline, 'tokens_per_s', '{:.1f}')} tok/s  [95% intervals over questions]"
    ]
    for name, m in results.methods.items():
        loss = m.lossless
        same = f"{loss.identical}/{loss.checked} identical" if loss.checked else "unchecked"
        lines.append(
            f"  {name:<12} {m.tokens_per_s:5.1f} tok/s  speedup {speedup_cell(m)}  "
            f"tau {number(m, 'mean_acceptance_length')}  {same}" + plain_share(m)
        )
    if results.noise.noisy:
        lines.append("  NOISY: plain decoding of the same question varied between repeats; see the report")
    return lines


def study_lines(results: RunResult) -> list[str]:
    study = results.study
    if not study:
        return []
    cells = {(c.prefix_cache, bool(c.speculation)): c for c in study.cells}
    lines = [f"rag 2x2 ({results.prompts} questions over one document): TTFT / TPOT / total per request"]
    for cache in (False, True):
        for spec in (False, True):
            c = cells[(cache, spec)]
            name = f"cache {'on ' if cache else 'off'} + {study.method if spec else 'plain'}"
            tpot = ci(c.tpot_ms, c.intervals.get("tpot_ms"), "{:.1f}")
            lines.append(f"  {name:<22} {c.ttft_ms:7.0f} ms / {tpot} ms / {c.total_ms:7.0f} ms")
    control = study.control
    verdict = "FAILED: machine too noisy" if control.noisy else "passed"
    lines.append(f"  control (plain TPOT, cache on / off): {ci(control.ratio, control.interval, unit='x')} {verdict}")
    return lines + [f"  {study.finding}"]


def main(argv: list[str] | None = None) -> None:
    """`draftsmith-headline [RUN_DIR]` (default runs/main)."""
    args = sys.argv[1:] if argv is None else argv
    print(headline(Path(args[0] if args else "runs/main")))


def headline(out: Path) -> str:
    lines, machine = [], None
    for name, fn in (("mt_bench", mt_bench_lines), ("rag", study_lines)):
        path = out / name / "results.json"
        if path.is_file():
            results = load_results(path)
            machine = machine or describe(results.environment)
            lines += fn(results) + [f"  report: {out / name / 'report.md'}", ""]
    export = out / "export-vllm"
    if export.is_dir():
        lines.append(f"vLLM/SGLang export: {export} (serve commands in its README.md)")
    if machine:
        lines.append(f"machine: {machine}")
    return "\n".join(lines)
