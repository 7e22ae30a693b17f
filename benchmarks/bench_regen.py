"""Regeneration throughput: vLLM against draftsmith's own batched decoder, on the same conversations, one run.

Each backend re-answers the same ShareGPT conversations turn by turn (greedy unless --temperature, the target in
its default dtype, each backend's default conversations in flight) into a file of its own; printed per backend:
conversations, new tokens, generation seconds (vLLM's start-up apart), tokens/s, and the ratio. Run it on an idle
machine.

    python benchmarks/bench_regen.py --conversations 64 --max-new-tokens 128
    python benchmarks/bench_regen.py --conversations 96 --max-new-tokens 256 --temperature 0.7 --top-p 0.8
    python benchmarks/bench_regen.py --backends vllm:whole-sort,vllm --temperature 0.7 --top-p 0.8  # the worker's top-p
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from draftsmith.serve.models.target import (
    TargetConfig,  # noqa: E402
    load_target,  # noqa: E402
)
from draftsmith.serve.shared.conversations import Skipped, load_conversations  # noqa: E402
from draftsmith.train.data import RegenerateConfig  # noqa: E402
from draftsmith.train.regenerate import TREE_ROOM, generate_into  # noqa: E402
from draftsmith.train.turns import prepare  # noqa: E402


def run_backend(name: str, target, convs, args, out: Path) -> dict:
    """name: a backend, or vllm:whole-sort (vLLM's own top-p, which sorts each row's vocabulary; the worker's)."""
    backend, _, variant = name.partition(":")
    os.environ["DRAFTSMITH_VLLM_WHOLE_SORT"] = "1" if variant == "whole-sort" else "0"
    cfg = RegenerateConfig(
        max_new_tokens=args.max_new_tokens,
        backend=backend,
        batch_size=args.batch_size,
        temperature=args.temperature,
        top_p=args.top_p,
    )
    limit = min(args.max_length, target.model.config.max_position_embeddings - TREE_ROOM)
    todo = prepare(convs, target.tokenizer, limit, Skipped())
    path = out / f"{name.replace(':', '-')}.jsonl"
    path.unlink(missing_ok=True)
    began = time.perf_counter()
    done = generate_into(path, todo, target, cfg, limit, show=True)
    total = time.perf_counter() - began
    row = {
        "backend": name,
        "generator": done.generator,
        "conversations": done.conversations,
        "tokens": done.tokens,
        "generate_s": done.seconds,
        "total_s": total,  # with the backend's start (vLLM: its engine and compile)
        "tok_s": done.tokens / done.seconds,
    }
    print(json.dumps(row))
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=None, help="conversations in flight (default: each backend's)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--backends", default="vllm,draftsmith")
    p.add_argument("--out", default="runs/bench_regen")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    convs, _ = load_conversations("sharegpt", 0.02, limit=args.conversations)
    target = load_target(TargetConfig(), offline=True)  # as regeneration loads it
    rows = [run_backend(name, target, convs, args, out) for name in args.backends.split(",")]
    print(f"\nregeneration, {len(convs)} ShareGPT conversations turn by turn, <= {args.max_new_tokens} new tokens per")
    how = "greedy" if not args.temperature else f"temperature {args.temperature}, top-p {args.top_p}"
    print(f"answer, {how}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")
    print(f"{'backend':<36} {'convs':>6} {'tokens':>8} {'gen s':>8} {'total s':>8} {'tok/s':>8}")
    for r in rows:
        g = r["generator"]
        label = f"{g['engine']} {g['version']} {g['dtype']}" + (" whole sort" if r["backend"].endswith("sort") else "")
        print(
            f"{label:<36} {r['conversations']:>6} {r['tokens']:>8} {r['generate_s']:>8.1f} {r['total_s']:>8.1f} "
            f"{r['tok_s']:>8.1f}"
        )
    if len(rows) == 2:
        print(f"{rows[0]['backend']} / {rows[1]['backend']}: {rows[0]['tok_s'] / rows[1]['tok_s']:.2f}x tokens/s")
    (out / "results.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
