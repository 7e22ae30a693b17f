"""τ of two drafters evaluated in one draftsmith-eval run, and the paired ratio of the first's τ to the second's.

    draftsmith-eval target=smollm2-135m spec=ar '+spec@methods.a=eagle3' methods.a.drafter=A/final \
        '+spec@methods.b=eagle3' methods.b.drafter=B/final suite=mt_bench limit=40 out=EVAL
    python benchmarks/paired_tau.py EVAL a b [--json OUT]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from draftsmith.eval.paired_tau import method_records, paired_tau
from draftsmith.files import write_text_atomic


def fmt(iv: list[float] | None) -> str:
    return f"[{iv[0]:.3f}, {iv[1]:.3f}]" if iv else "[–]"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", type=Path, help="a draftsmith-eval out= folder")
    p.add_argument("a", help="a method name of that run (the ratio's numerator)")
    p.add_argument("b", help="another method name (the denominator)")
    p.add_argument("--json", type=Path, help="write the report here as JSON")
    args = p.parse_args()
    try:
        report = paired_tau(method_records(args.folder, (args.a, args.b)))
    except ValueError as e:
        raise SystemExit(str(e)) from e
    for name in (args.a, args.b):
        r = report[name]
        pairs = zip(r["acceptance_by_position"], r["acceptance_intervals"], strict=True)
        rates = ", ".join(f"{x:.3f} {fmt(iv)}" for x, iv in pairs)
        print(f"{name:>12}  tau {r['tau']:.3f} {fmt(r['tau_interval'])}  acceptance by position {rates}")
    print(f"{args.a} / {args.b} tau: {report['tau_ratio']:.3f} {fmt(report['tau_ratio_interval'])}")
    if args.json:
        write_text_atomic(args.json, json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
