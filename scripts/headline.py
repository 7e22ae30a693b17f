#!/usr/bin/env python
"""The main job's headline: per method speedup and tau with their 95% intervals and the lossless line on
MT-bench, the 2x2 study on rag (its control and finding), and where the reports are.
Usage: python scripts/headline.py runs/main"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from draftsmith.eval.machine import describe
from draftsmith.eval.report import ci, iv, speedup_cell


def mt_bench_lines(results: dict) -> list[str]:
    base = results["baseline"]
    repeats = f" x {results['repeats']} repeats" if results["repeats"] > 1 else ""
    lines = [
        f"MT-bench ({results['prompts']} questions{repeats}, both turns, {results['max_new_tokens']} new tokens, "
        f"{results['dtype']}, {results['device']}): plain decoding "
        f"{ci(base['tokens_per_s'], iv(base, 'tokens_per_s'), '{:.1f}')} tok/s  [95% intervals over questions]"
    ]
    for name, m in results["methods"].items():
        loss = m.get("lossless") or {}
        same = f"{loss.get('identical')}/{loss.get('checked')} identical" if loss.get("checked") else "unchecked"
        lines.append(
            f"  {name:<12} {m['tokens_per_s']:5.1f} tok/s  speedup {speedup_cell(m)}  "
            f"tau {ci(m['mean_acceptance_length'], iv(m, 'mean_acceptance_length'))}  {same}"
        )
    if (results.get("noise") or {}).get("noisy"):
        lines.append("  NOISY: plain decoding of the same question varied between repeats; see the report")
    return lines


def study_lines(results: dict) -> list[str]:
    study = results.get("study") or {}
    cells = {(c["prefix_cache"], bool(c["speculation"])): c for c in study.get("cells", [])}
    if not cells:
        return []
    lines = [f"rag 2x2 ({results['prompts']} questions over one document): TTFT / TPOT / total per request"]
    for cache in (False, True):
        for spec in (False, True):
            c = cells[(cache, spec)]
            name = f"cache {'on ' if cache else 'off'} + {study['method'] if spec else 'plain'}"
            tpot = ci(c["tpot_ms"], iv(c, "tpot_ms"), "{:.1f}")
            lines.append(f"  {name:<22} {c['ttft_ms']:7.0f} ms / {tpot} ms / {c['total_ms']:7.0f} ms")
    control = study.get("control")
    if control:
        verdict = "FAILED: machine too noisy" if control["noisy"] else "passed"
        lines.append(
            f"  control (plain TPOT, cache on / off): {ci(control['ratio'], control['interval'], unit='x')} {verdict}"
        )
    return lines + [f"  {study['finding']}"]


def main(out: Path) -> None:
    lines, machine = [], None
    for name, fn in (("mt_bench", mt_bench_lines), ("rag", study_lines)):
        path = out / name / "results.json"
        if path.is_file():
            results = json.loads(path.read_text())
            machine = machine or describe(results.get("environment") or {})
            lines += fn(results) + [f"  report: {out / name / 'report.md'}", ""]
    export = out / "export-vllm"
    if export.is_dir():
        lines.append(f"vLLM/SGLang export: {export} (serve commands in its README.md)")
    if machine:
        lines.append(f"machine: {machine}")
    print("\n".join(lines))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/main"))
