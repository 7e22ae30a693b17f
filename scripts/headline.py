#!/usr/bin/env python
"""The main job's headline: per method speedup, tau and lossless line on MT-bench, the 2x2 finding on rag,
and where the reports are. Usage: python scripts/headline.py runs/main"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def mt_bench_lines(results: dict) -> list[str]:
    base = results["baseline"]
    lines = [
        f"MT-bench ({results['prompts']} questions, both turns, {results['max_new_tokens']} new tokens, "
        f"{results['dtype']}, {results['device']}): plain decoding {base['tokens_per_s']:.1f} tok/s"
    ]
    for name, m in results["methods"].items():
        loss = m.get("lossless") or {}
        same = f"{loss.get('identical')}/{loss.get('checked')} identical" if loss.get("checked") else "unchecked"
        lines.append(
            f"  {name:<12} {m['tokens_per_s']:5.1f} tok/s  speedup {m['speedup']:.2f}x  "
            f"tau {m['mean_acceptance_length']:.2f}  {same}"
        )
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
            lines.append(f"  {name:<22} {c['ttft_ms']:7.0f} ms / {c['tpot_ms']:6.1f} ms / {c['total_ms']:7.0f} ms")
    return lines + [f"  {study['finding']}"]


def main(out: Path) -> None:
    lines = []
    for name, fn in (("mt_bench", mt_bench_lines), ("rag", study_lines)):
        path = out / name / "results.json"
        if path.is_file():
            lines += fn(json.loads(path.read_text())) + [f"  report: {out / name / 'report.md'}", ""]
    export = out / "export-vllm"
    if export.is_dir():
        lines.append(f"vLLM/SGLang export: {export} (serve commands in its README.md)")
    print("\n".join(lines))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/main"))
