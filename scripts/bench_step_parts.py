#!/usr/bin/env python
"""Where a decode step of the real SmolLM2-135M goes (CPU, batch 1), measured side by side in one process.

1. the step with parts swapped out (monkeypatched), variants interleaved, min over steps: today's bit-exact bf16,
   without the linear wrappers' checks, a 1-row linear run as one row (not bit-exact), the SDPA-style attention
   instead of the batch-invariant one (not bit-exact), and fp32
2. the linears alone: every layer's packed weights once, cold (as a step streams them), one row, bf16 and fp32

  python scripts/bench_step_parts.py [--context 300] [--rounds 6]
"""

from __future__ import annotations

import argparse
import os
import time
from contextlib import ExitStack
from unittest import mock

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from draftsmith.heads import llama, packed  # noqa: E402
from draftsmith.serve.engine.tree import causal_mask  # noqa: E402
from draftsmith.serve.models.target import (
    TargetConfig,  # noqa: E402
    load_target,  # noqa: E402
)


def lean_packed(self, x):
    return (
        packed.packed_linear(x, self.packed, self.bias, self.out_features)
        if self.packed is not None
        else (F.linear(x, self.weight, self.bias))
    )


def lean_fused(self, x):
    return packed.packed_linear(x, self.packed, self.bias, sum(self.sizes))


def one_row(x, weight, bias, out_features):
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


VARIANTS = {
    "today": [],
    "linear wrappers without checks": [
        (packed.PackedLinear, "forward", lean_packed),
        (packed.FusedLinear, "forward", lean_fused),
    ],
    "1-row linear as 1 row (inexact)": [(packed, "packed_linear", one_row)],
    "SDPA-style attention (inexact)": [(llama, "invariant_path", lambda dtype, device: False)],
}


def patched(patches) -> ExitStack:
    stack = ExitStack()
    for obj, name, value in patches:
        stack.enter_context(mock.patch.object(obj, name, value))
    return stack


def step_section(context: int, rounds: int) -> None:
    models = {dtype: load_target(TargetConfig(dtype=dtype)).model for dtype in ("bfloat16", "float32")}
    runs = {(name, "bfloat16"): patches for name, patches in VARIANTS.items()} | {("today", "float32"): []}
    tokens = torch.randint(0, 1000, (context + 40,), generator=torch.Generator().manual_seed(0))
    caches, times = {}, {key: [] for key in runs}
    with torch.inference_mode():
        for key, patches in runs.items():
            model = models[key[1]]
            with patched(patches):
                caches[key] = model.new_cache(context + 64)
                model(tokens[:context], torch.arange(context), caches[key], 0, causal_mask(0, context, "cpu"))
        for r in range(rounds + 1):  # round 0 warms up
            for key, patches in runs.items():
                model = models[key[1]]
                with patched(patches):
                    for i in range(12):
                        p = context + i % 30
                        t = time.perf_counter()
                        model(tokens[p : p + 1], torch.arange(p, p + 1), caches[key], p, None)
                        if r:
                            times[key].append(time.perf_counter() - t)
    base = min(times["today", "bfloat16"])
    print(f"decode step, {context} tokens in cache, min over {rounds * 12} interleaved steps (ms)")
    for (name, dtype), ts in times.items():
        print(f"  {dtype:9s} {name:34s} {min(ts) * 1e3:7.2f}  {min(ts) / base:5.2f}x")


def linears_section(rounds: int) -> None:
    cfg = load_target(TargetConfig(dtype="float32")).model.config
    h, i, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_key_value_heads * cfg.head_dim
    shapes = [(h + 2 * kv, h), (h, h), (2 * i, h), (h, i)]  # qkv, o, gate_up, down
    print(f"the {cfg.num_hidden_layers} layers' packed linears, one row, cold weights (ms per step)")
    for dtype in (torch.bfloat16, torch.float32):
        weights = [
            [packed.pack_weight(torch.randn(o, n, dtype=dtype) * 0.02) for o, n in shapes]
            for _ in range(cfg.num_hidden_layers)
        ]
        xs = [torch.randn(1, n, dtype=dtype) for _, n in shapes]
        mb = sum(o * n for o, n in shapes) * cfg.num_hidden_layers * (2 if dtype == torch.bfloat16 else 4) / 1e6
        best = float("inf")
        with torch.inference_mode():
            for _ in range(rounds * 2):
                t = time.perf_counter()
                for layer in weights:
                    for x, w in zip(xs, layer, strict=True):
                        torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
                best = min(best, time.perf_counter() - t)
        print(f"  {str(dtype):15s} {best * 1e3:6.2f} ms for {mb:.0f} MB: {mb / best / 1e3:.1f} GB/s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=300, help="tokens in the cache when a step runs")
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args()
    step_section(args.context, args.rounds)
    linears_section(args.rounds)


if __name__ == "__main__":
    main()
