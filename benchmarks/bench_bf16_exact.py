#!/usr/bin/env python
"""What bit-exact bf16 costs on the real SmolLM2-135M (CPU, batch 1), measured A vs B interleaved in one run.

1. target forward time per step size (1-row decode, k-row verify): bf16 bit-exact (runtime/attention.py) vs the
   previous bf16 path (SDPA / grouped attention, no plans) vs fp32; the minimum over repeats (robust to load).
2. a long prefill: bf16 bit-exact (linears in pieces of packed.MAX_ROWS rows) vs bf16 with its linears whole
   (inexact on AMX) vs fp32.
3. plain greedy decoding tok/s, fp32 vs bf16 (bit-exact), on a few MT-bench prompts, interleaved prompt by prompt.

  python benchmarks/bench_bf16_exact.py [--repeats 30] [--prompts 4] [--new 64] [--prefill 2000]
"""

from __future__ import annotations

import argparse
import os
import time
from contextlib import nullcontext
from unittest import mock

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

from draftsmith.cpu_kernels import packed  # noqa: E402
from draftsmith.eval.suites import mt_bench  # noqa: E402
from draftsmith.runtime import llama  # noqa: E402
from draftsmith.serve.build import build_engine  # noqa: E402
from draftsmith.serve.engine.sampling import SamplingParams  # noqa: E402
from draftsmith.serve.engine.tree import causal_mask  # noqa: E402
from draftsmith.serve.models.target import (  # noqa: E402
    TargetConfig,  # noqa: E402
    encode_chat,
    load_target,
)
from draftsmith.serve.spec import SpecConfig  # noqa: E402

CONTEXT = 300  # tokens already in the cache when a step runs
ROWS = (1, 4, 8, 16)


def old_bf16_path():
    """The runner before bit-exact bf16: no batch-invariant plans (packed linears still run a row as two)."""
    return mock.patch.object(llama, "invariant_path", lambda dtype, device: False)


def step_time(model, rows: int) -> float:
    cache = model.new_cache(CONTEXT + 32)
    tokens = torch.randint(0, 1000, (CONTEXT + rows,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        model(tokens[:CONTEXT], torch.arange(CONTEXT), cache, 0, causal_mask(0, CONTEXT, "cpu"))
        mask = causal_mask(CONTEXT, rows, "cpu") if rows > 1 else None
        t = time.perf_counter()
        model(tokens[CONTEXT:], torch.arange(CONTEXT, CONTEXT + rows), cache, CONTEXT, mask)
        return time.perf_counter() - t


def step_section(fp32, bf16, repeats: int) -> None:
    variants = {"bf16 exact": (bf16, nullcontext), "bf16 old": (bf16, old_bf16_path), "fp32": (fp32, nullcontext)}
    best = {(v, r): float("inf") for v in variants for r in ROWS}
    for i in range(repeats + 2):  # 2 warm-up rounds
        for name, (model, ctx) in variants.items():
            for rows in ROWS:
                with ctx():
                    t = step_time(model, rows)
                if i >= 2:
                    best[name, rows] = min(best[name, rows], t)
    print(f"target forward, min over {repeats} interleaved repeats, {CONTEXT} tokens in cache (ms)")
    print("rows | " + " | ".join(variants) + " | exact/old")
    for rows in ROWS:
        ms = [best[v, rows] * 1e3 for v in variants]
        print(f"{rows:4d} | " + " | ".join(f"{m:7.2f}" for m in ms) + f" | {ms[0] / ms[1]:.2f}x")


def prefill_time(model, n: int) -> float:
    tokens = torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        t = time.perf_counter()
        model(tokens, torch.arange(n), model.new_cache(n), 0, causal_mask(0, n, "cpu"))
        return time.perf_counter() - t


def prefill_section(fp32, bf16, n: int, repeats: int = 3) -> None:
    whole = mock.patch.object(packed, "MAX_ROWS", n)
    variants = {
        "bf16 exact": (bf16, nullcontext),
        "bf16 linears whole": (bf16, lambda: whole),
        "fp32": (fp32, nullcontext),
    }
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(repeats):
        for name, (model, ctx) in variants.items():
            with ctx():
                best[name] = min(best[name], prefill_time(model, n))
    print(f"prefill of {n} tokens, min over {repeats} interleaved repeats (ms)")
    print("  " + "   ".join(f"{k} {v * 1e3:.0f}" for k, v in best.items()))


def plain_section(targets: dict, n_prompts: int, new: int) -> None:
    engines = {k: build_engine(t, SpecConfig("ar"), prefix_cache=False, max_seq_len=1024) for k, t in targets.items()}
    tok = next(iter(targets.values())).tokenizer
    prompts = [encode_chat(tok, [{"role": "user", "content": p.turns[0]}]) for p in mt_bench(n_prompts)]
    spent = dict.fromkeys(engines, 0.0)
    made = dict.fromkeys(engines, 0)
    for e in engines.values():  # warm-up
        e.generate(prompts[0], 8, SamplingParams())
    for i, ids in enumerate(prompts):
        order = list(engines) if i % 2 == 0 else list(engines)[::-1]
        for name in order:
            t = time.perf_counter()
            g = engines[name].generate(ids, new, SamplingParams())
            spent[name] += time.perf_counter() - t
            made[name] += len(g.output_ids)
    rates = {k: made[k] / spent[k] for k in engines}
    print(f"plain greedy decoding, {n_prompts} MT-bench prompts, {new} new tokens, interleaved")
    line = "   ".join(f"{k} {v:.1f} tok/s" for k, v in rates.items())
    print(f"  {line}   bf16/fp32 {rates['bf16'] / rates['fp32']:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--prefill", type=int, default=2000, help="prompt tokens of section 2 (0: skip it)")
    args = ap.parse_args()
    # bf16 on torch's ops (offline=True), whose exactness this measures, not bf16 weights on draftsmith's kernels
    targets = {
        k: load_target(TargetConfig(dtype=d, device="cpu"), offline=True)
        for k, d in (("fp32", "float32"), ("bf16", "bfloat16"))
    }
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    step_section(targets["fp32"].model, targets["bf16"].model, args.repeats)
    if args.prefill:
        prefill_section(targets["fp32"].model, targets["bf16"].model, args.prefill)
    plain_section(targets, args.prompts, args.new)


if __name__ == "__main__":
    main()
