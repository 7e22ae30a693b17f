#!/usr/bin/env python
"""Where a decode step of the real SmolLM2-135M goes (CPU, batch 1), measured side by side in one process.

1. the step with parts swapped out (monkeypatched), variants interleaved, min over steps: the eager bit-exact bf16
   on torch's ops (oneDNN),
   without the linear wrappers' checks, a 1-row linear run as one row (not bit-exact), the SDPA-style attention
   instead of the batch-invariant one (not bit-exact), and fp32 (also on torch's kernels, oneDNN's linears and
   SDPA, where cpu_kernels/native.py's library runs, with its layers one call each instead of the whole stack in one,
   and with every weight in fp32 panels instead of the narrowest exact format, cpu_kernels/panel_codes.py), bf16 as the
   engine runs it there (bf16 weights in fp32 on the kernels, serve/models/loader.py); beside them the compiled step
   (serve/engine/compiled.py) in bf16 (torch's ops) and fp32
2. the linears alone: every layer's packed weights once, cold (as a step streams them), 1 to 32 rows, bf16 and fp32
   (fp32 on cpu_kernels/panels.py's kernel, its weights in each panel format, and on oneDNN's where the panel kernel
   runs), beside this machine's memory
   bandwidth (a plain probe: the sum of a 512 MB tensor), and the compiled bf16 step against the bandwidth limit
   (every weight it reads, once per token)

3. with --drafter DIR, a trained drafter's draft step beside the target's step it follows, as the engine runs them:
   the target decodes a token (which evicts the drafter's weights from the caches), the drafter takes it and drafts
   one level (every other step with its layer module by module instead of one kernel call), and the draft step is
   set against the time its weights' bytes take at the probe's bandwidth and its multiply-adds at this CPU's
   measured fp32 peak

bf16 runs where the CPU has oneDNN bf16 kernels (AVX512-BF16, AMX); on AVX2, where it is emulated, fp32 alone.

  python benchmarks/bench_step_parts.py [--context 300] [--rounds 6] [--dtypes bfloat16,float32] [--rows 1,2,4,8,32]
  python benchmarks/bench_step_parts.py --sections drafter --drafter runs/main/eagle3/final
"""

from __future__ import annotations

import argparse
import os
import time
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from draftsmith.cpu_kernels import decoder_layer, decoder_stack, eagle3_draft, native, packed, panel_codes, panels  # noqa: E402
from draftsmith.cpu_kernels.packed import can_pack  # noqa: E402
from draftsmith.heads.drafter_folder import read_meta  # noqa: E402
from draftsmith.runtime import llama  # noqa: E402
from draftsmith.serve.build import build_engine  # noqa: E402
from draftsmith.serve.engine.compiled import CompiledStep, cache_slots  # noqa: E402
from draftsmith.serve.engine.metrics import Metrics  # noqa: E402
from draftsmith.serve.engine.sampling import SamplingParams  # noqa: E402
from draftsmith.serve.engine.tree import DraftTree, causal_mask  # noqa: E402
from draftsmith.serve.models.target import (
    TargetConfig,  # noqa: E402
    load_target,  # noqa: E402
)
from draftsmith.serve.spec import SpecConfig  # noqa: E402


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
    "eager": [],
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


ONEDNN = "eager, fp32 on torch's kernels"  # oneDNN's linears and SDPA, without cpu_kernels/native.py's library
TORCH_OPS = [(native, "wanted", lambda: False)]  # every one of draftsmith's kernels steps aside
LAYER_BY_LAYER = "eager, fp32 one call per layer"  # the layers as one call each, not the whole stack in one
ONE_CALL_PER_LAYER = [(decoder_stack, "steps", lambda *args: False)]


FP32_PANELS = "eager, fp32 weights in fp32 panels"  # every weight in fp32 panels, none in a narrower exact format


BF16_KERNELS = "eager, bf16 weights on the kernels"  # what dtype=bfloat16 runs where the kernels do


def torch_model(dtype: str):
    """The target on torch's ops alone (bf16: oneDNN's bit-exact bf16, as where draftsmith's kernels do not run)."""
    with patched(TORCH_OPS):
        return load_target(TargetConfig(dtype=dtype)).model


def fp32_panels_model():
    """The fp32 target with every weight in fp32 panels (DRAFTSMITH_PANELS=fp32)."""
    with mock.patch.dict(os.environ, {panels.ENV: "fp32"}):
        return load_target(TargetConfig(dtype="float32")).model


MODELS = {  # the variants that need a model of their own
    ONEDNN: lambda: torch_model("float32"),  # packed for oneDNN, as before draftsmith's kernels
    FP32_PANELS: fp32_panels_model,
    BF16_KERNELS: lambda: load_target(TargetConfig(dtype="bfloat16")).model,
}


def step_section(context: int, rounds: int, dtypes: list[str]) -> dict[tuple[str, str], float]:
    """-> the best step time (s) per (variant, dtype); bf16 runs every variant, fp32 the eager step (and the eager
    step on torch's kernels where draftsmith's own run)."""
    models = {
        dtype: torch_model(dtype) if dtype == "bfloat16" else load_target(TargetConfig(dtype=dtype)).model
        for dtype in dtypes
    }
    runs = {(name, d): patches for d in dtypes for name, patches in VARIANTS.items() if d == "bfloat16" or not patches}
    if "float32" in dtypes and panels.available():
        runs[ONEDNN, "float32"] = TORCH_OPS
        runs[LAYER_BY_LAYER, "float32"] = ONE_CALL_PER_LAYER
        runs[FP32_PANELS, "float32"] = []
    if "bfloat16" in dtypes and panels.available():
        runs[BF16_KERNELS, "bfloat16"] = []
    tokens = torch.randint(0, 1000, (context + 40,), generator=torch.Generator().manual_seed(0))
    steps, times = {}, {key: [] for key in runs} | {("compiled", d): [] for d in models}
    with torch.inference_mode():
        for key, patches in runs.items():
            with patched(patches):
                made = MODELS.get(key[0])
                model = made() if made is not None else models[key[1]]
                steps[key] = eager_step(model, context + 64)
                steps[key](tokens[:context], torch.arange(context), 0, causal_mask(0, context, "cpu"))
        for dtype, model in models.items():
            steps["compiled", dtype] = CompiledStep(model, model.new_cache(cache_slots(context + 64)))
            begin = time.perf_counter()
            steps["compiled", dtype](tokens[:context], torch.arange(context), 0, causal_mask(0, context, "cpu"))
            print(
                f"compiled step, {dtype}: first call (compile, or load from the cache, + prefill) "
                f"{time.perf_counter() - begin:.1f} s"
            )
        for r in range(rounds + 1):  # round 0 warms up
            for key in times:
                with patched(runs.get(key, [])):
                    for i in range(12):
                        p = context + i % 30
                        t = time.perf_counter()
                        steps[key](tokens[p : p + 1], torch.arange(p, p + 1), p, None)
                        if r:
                            times[key].append(time.perf_counter() - t)
    base = min(times["eager", dtypes[0]])
    print(f"decode step, {context} tokens in cache, min over {rounds * 12} interleaved steps (ms)")
    for (name, dtype), ts in times.items():
        print(f"  {dtype:9s} {name:34s} {min(ts) * 1e3:7.2f}  {min(ts) / base:5.2f}x")
    return {key: min(ts) for key, ts in times.items()}


def eager_step(model, slots: int):
    cache = model.new_cache(slots)
    return lambda tokens, positions, start, mask: model(tokens, positions, cache, start, mask)


def bandwidth_gbs(rounds: int) -> float:
    """This machine's read bandwidth: the best of rounds sums over a 512 MB tensor (far past every cache)."""
    buf = torch.ones(1 << 27)
    best = float("inf")
    for _ in range(rounds * 2):
        t = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t)
    return buf.nbytes / best / 1e9


def weight_bytes(model) -> int:
    """What a decode step streams: every linear's packed weight (fused ones once, in the format they are packed in),
    the (tied) lm_head once."""
    linears = (packed.PackedLinear, packed.FusedLinear, torch.nn.Linear)
    return sum(
        m.current().nbytes if isinstance(m, (packed.PackedLinear, packed.FusedLinear)) else m.weight.nbytes
        for m in model.modules()
        if isinstance(m, linears) and not (isinstance(m, packed.PackedLinear) and m.packed is None)
    )


def linears_section(rounds: int, dtypes: list[str], rows: list[int]) -> float:
    """-> the bandwidth probe's GB/s."""
    cfg = load_target(TargetConfig(dtype="float32")).model.config
    h, i, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_key_value_heads * cfg.head_dim
    shapes = [(h + 2 * kv, h), (h, h), (2 * i, h), (h, i)]  # qkv, o, gate_up, down
    print(f"the {cfg.num_hidden_layers} layers' packed linears, cold weights (ms per step; GB/s of weights read)")
    runs = [(d, "panels" if d == "float32" and panels.available() else "oneDNN") for d in dtypes]
    if ("float32", "panels") in runs:
        runs[runs.index(("float32", "panels")) + 1 : 1] = [("float32", f"{code} panels") for code in panels.CODED]
        runs.append(("float32", "oneDNN"))
    for name, kernel in runs:
        dtype, code = getattr(torch, name), kernel.split()[0]
        with mock.patch.dict(os.environ, {native.ENV: "0" if kernel == "oneDNN" else "1"}):
            weights = [
                [pack(torch.randn(o, n, dtype=dtype) * 0.02, code) for o, n in shapes]
                for _ in range(cfg.num_hidden_layers)
            ]
        mb = sum(w.nbytes for layer in weights for w in layer) / 1e6
        for n_rows in rows:
            best = time_linears(weights, shapes, dtype, n_rows, rounds)
            print(
                f"  {name:9s} {kernel:11s} {n_rows:3d} row(s) {best * 1e3:7.2f} ms for {mb:3.0f} MB: "
                f"{mb / best / 1e3:.1f} GB/s"
            )
    gbs = bandwidth_gbs(rounds)
    print(f"  memory bandwidth probe (sum of a 512 MB fp32 tensor): {gbs:.1f} GB/s")
    return gbs


def pack(weight: torch.Tensor, code: str) -> torch.Tensor:
    """The weight packed for its kernel; for a panel format, first rounded so that the format holds it exactly."""
    if code in panels.CODED:
        exact = weight.bfloat16().float() if code == "bf16" else panel_codes.quantized(weight, code)
        coded = panels.pack_as(panels.pad(exact), code)
        assert coded is not None, f"{code} holds the weight it was rounded to"
        return coded
    return packed.pack_weight(weight)


def time_linears(weights: list[list[torch.Tensor]], shapes, dtype: torch.dtype, rows: int, rounds: int) -> float:
    """The best time of one pass of `rows` rows through every layer's packed linears."""
    xs = [torch.randn(rows, n, dtype=dtype) for _, n in shapes]
    best = float("inf")
    with torch.inference_mode():
        for _ in range(rounds * 2):
            t = time.perf_counter()
            for layer in weights:
                for x, w, (o, _) in zip(xs, layer, shapes, strict=True):
                    packed.packed_linear(x, w, None, o)
            best = min(best, time.perf_counter() - t)
    return best


def limit_section(best: dict[tuple[str, str], float], gbs: float, dtypes: list[str]) -> None:
    """The decode step against the bandwidth limit: one pass over the weights per token."""
    print("decode step vs the bandwidth limit (every weight read once per token)")
    for dtype in dtypes:
        mb = weight_bytes(load_target(TargetConfig(dtype=dtype)).model) / 1e6
        limit = mb / gbs / 1e3
        for name in ("compiled", "eager", BF16_KERNELS):
            if (name, dtype) not in best:
                continue
            step, label = best[name, dtype], "kernels" if name == BF16_KERNELS else name
            print(
                f"  {dtype:9s} {label:9s} {step * 1e3:6.2f} ms; limit {limit * 1e3:5.2f} ms ({mb:.0f} MB at "
                f"{gbs:.1f} GB/s, {1 / limit:.0f} tok/s): {limit / step:.0%} of it"
            )


def fp32_peak_gflops(rounds: int) -> float:
    """This CPU's fp32 multiply-add pace on every thread: the best of rounds 1024-square matmuls."""
    a = torch.randn(1024, 1024)
    best = float("inf")
    for _ in range(rounds * 2):
        t = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - t)
    return 2 * 1024**3 / best / 1e9


# the one-call draft (cpu_kernels/eagle3_draft.py) beside the head's kernels called one by one from its modules, and
# beside its layer run module by module too (as before cpu_kernels/decoder_layer.py's one call took EAGLE-3's midlayer)
KERNELS, MODULES = "draft (kernels one by one)", "draft (layer module by module)"
DRAFT_VARIANTS = {
    "draft": [],
    KERNELS: [(eagle3_draft, "plan", lambda *args: None)],
    MODULES: [(eagle3_draft, "plan", lambda *args: None), (decoder_layer, "step_plan", lambda *args: None)],
}


def drafter_section(folder: str, context: int, rounds: int, gbs: float) -> None:
    """The drafter's one-level draft step after each target decode step, interleaved, min and median over steps."""
    target = load_target(TargetConfig(dtype="float32"))
    spec = SpecConfig(name=read_meta(Path(folder))["kind"], drafter=folder)
    engine = build_engine(target, spec, prefix_cache=False, max_seq_len=context + 96 * (rounds + 1) + 64)
    proposer = engine.proposer
    assert proposer is not None, "a drafter spec builds a proposer"
    tokens = torch.zeros(context + 96 * (rounds + 1) + 1, dtype=torch.long)
    tokens[:context] = torch.randint(0, 1000, (context,), generator=torch.Generator().manual_seed(0))
    sp, empty = SamplingParams(temperature=0.0), DraftTree.empty()
    times: dict[str, list[float]] = {"target": [], **{name: [] for name in DRAFT_VARIANTS}}
    with torch.inference_mode():
        n = engine.prefill(tokens, context, sp, None, Metrics())
        for step in range(3 * 32 * (rounds + 1)):  # the first 96 warm up
            begin = time.perf_counter()
            out = engine.forward(tokens[n - 1 : n], torch.arange(n - 1, n), n - 1, None)
            tokens[n] = out.logits[-1].argmax()
            middle = time.perf_counter()
            # the variants take turns step by step (the same bits: the engine's state holds)
            variant = list(DRAFT_VARIANTS)[step % len(DRAFT_VARIANTS)]
            with patched(DRAFT_VARIANTS[variant]):
                proposer.accept(tokens[: n + 1], empty, [], out)  # a plain step's token, then a draft of one level
                proposer.propose(tokens[: n + 1], sp, 1)
            end = time.perf_counter()
            n += 1
            if step >= 96:
                times["target"].append(middle - begin)
                times[variant].append(end - middle)
    mb, macs = draft_weights(proposer.head) if hasattr(proposer, "head") else (0.0, 0.0)
    bytes_s, flops_s = mb / gbs / 1e3, 2 * macs / fp32_peak_gflops(rounds) / 1e9
    limit, least = max(bytes_s, flops_s), {name: sorted(ts) for name, ts in times.items()}
    print(f"{spec.name} draft step of one level ({folder}) after each target step, {len(times['draft'])} steps (ms)")
    for name, ts in least.items():
        median = ts[len(ts) // 2]
        print(f"  {name:30s} min {ts[0] * 1e3:6.3f}  median {median * 1e3:6.3f}  {ts[0] / least['target'][0]:5.2f}x")
    print(
        f"  its weights: {mb:.1f} MB, {macs / 1e6:.1f}M multiply-adds a row; limit {limit * 1e3:.3f} ms (bytes "
        f"{bytes_s * 1e3:.3f} ms at {gbs:.1f} GB/s, FLOPs {flops_s * 1e3:.3f} ms)"
    )
    draft = least["draft"]
    least_x, median_x = draft[0] / limit, draft[len(draft) // 2] / limit
    print(f"  the draft step: {least_x:.2f}x the limit at its min, {median_x:.2f}x at its median")


def draft_weights(head: torch.nn.Module) -> tuple[float, float]:
    """MB a one-level draft streams (every packed linear the head owns once: fc, its layer, its lm_head; not the
    borrowed target embedding or lm_head) and its multiply-adds per row."""
    borrowed = {id(m) for name, m in head.named_children() if name in ("embed_tokens", "target_lm_head")}
    mb = macs = 0.0
    for name, m in head.named_modules():
        if id(m) in borrowed or name.startswith("target_lm_head"):
            continue
        if isinstance(m, packed.FusedLinear) or isinstance(m, packed.PackedLinear) and m.packed is not None:
            mb += m.current().nbytes / 1e6
            macs += m.out_features * (m.parts[0].in_features if isinstance(m, packed.FusedLinear) else m.in_features)
    return mb, macs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=300, help="tokens in the cache when a step runs")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument(
        "--dtypes",
        type=lambda s: s.split(","),
        default=["bfloat16", "float32"] if can_pack(torch.zeros(0, dtype=torch.bfloat16)) else ["float32"],
        help="default: bfloat16,float32, or float32 alone where bf16 is emulated (no oneDNN bf16 kernels)",
    )
    p.add_argument(
        "--rows",
        type=lambda s: [int(n) for n in s.split(",")],
        default=[1, 2, 4, 8, 32],
        help="row counts for the linears alone (1: a decode step; a few: a verify; 32: a prefill chunk)",
    )
    p.add_argument("--drafter", help="a trained drafter folder: its draft step beside the target's (section drafter)")
    p.add_argument(
        "--sections",
        type=lambda s: s.split(","),
        default=["step", "linears", "drafter"],
        help="which to run of step, linears and drafter (drafter: where --drafter names one)",
    )
    args = p.parse_args()
    best = step_section(args.context, args.rounds, args.dtypes) if "step" in args.sections else {}
    gbs = (
        linears_section(args.rounds, args.dtypes, args.rows)
        if "linears" in args.sections
        else bandwidth_gbs(args.rounds)
    )
    if best:
        limit_section(best, gbs, args.dtypes)
    if args.drafter and "drafter" in args.sections:
        drafter_section(args.drafter, args.context, args.rounds, gbs)


if __name__ == "__main__":
    main()
