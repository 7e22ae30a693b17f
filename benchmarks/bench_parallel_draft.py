#!/usr/bin/env python
"""What a parallel drafter's draft of K tokens (P-EAGLE or DFlash: one forward) costs against one EAGLE-3 level.

Random heads of the target's real shapes (SmolLM2-135M: hidden 576, three target layers, the default draft vocabulary,
one decoder layer), packed as serve/build.py packs a loaded drafter, a context of --context tokens in the
drafter's cache, --accepted real pairs entering per step (tau - 1 accepted + the bonus). Per step, interleaved
over --repeats rounds (median, with the quartiles):
  eagle3 level   the forward that gives EAGLE-3's level 1 (the real pairs) and its logits: the main job's draft
  eagle3 chain K that, then K-1 more one-token levels (a chain of K)
  peagle K       the one forward of the real pairs and K-1 mask slots, K rows of logits, then the chain's ids
  dflash K       the accepted tokens' context k/v, the block of K+1 slots (block_size K+1), K rows of logits
Only the drafters run (the target's outputs are random tensors), so this is draft cost, not acceptance; on a
loaded machine the ratios hold better than the times.

    python benchmarks/bench_parallel_draft.py --kind peagle --dtype bfloat16 --k 4
    python benchmarks/bench_parallel_draft.py --kind dflash --k 1,3,7
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

from draftsmith.cpu_kernels.packed import pack_linears  # noqa: E402
from draftsmith.heads.dflash import DFlashConfig, DFlashHead  # noqa: E402
from draftsmith.heads.eagle3 import Eagle3Config, Eagle3Head  # noqa: E402
from draftsmith.heads.peagle import PEagleConfig, PEagleHead  # noqa: E402
from draftsmith.runtime.llama import ForwardOut  # noqa: E402
from draftsmith.serve.engine.sampling import SamplingParams  # noqa: E402
from draftsmith.serve.engine.tree import TreeConfig  # noqa: E402
from draftsmith.serve.models.target import TargetConfig, load_target  # noqa: E402
from draftsmith.serve.proposers.propose_dflash import DFlashProposer  # noqa: E402
from draftsmith.serve.proposers.propose_eagle import EagleProposer  # noqa: E402
from draftsmith.serve.proposers.propose_peagle import PEagleProposer  # noqa: E402

CHAIN = TreeConfig(1, 0)


def ready(head: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    head.to(dtype).eval().requires_grad_(False)
    pack_linears(head)
    return head


def parallel(kind: str, target, k: int, dtype: torch.dtype):
    c = target.config
    if kind == "peagle":
        head = PEagleHead(PEagleConfig.from_target(c, num_depths=k), target)
        return PEagleProposer(ready(head, dtype), k, CHAIN)
    head = DFlashHead(DFlashConfig.from_target(c, block_size=k + 1), target)
    return DFlashProposer(ready(head, dtype), k, CHAIN)


def proposers(kind: str, target, ks: list[int], dtype: torch.dtype) -> dict:
    torch.manual_seed(0)
    e3 = ready(Eagle3Head(Eagle3Config.from_target(target.config), target), dtype)
    ps = {"eagle3 level": EagleProposer(e3, "eagle3", 1, CHAIN)}
    for k in ks:
        if k > 1:  # a chain of 1 is the level
            ps[f"eagle3 chain {k}"] = EagleProposer(e3, "eagle3", k, CHAIN)
        ps[f"{kind} {k}"] = parallel(kind, target, k, dtype)
    return ps


def step(p, tokens: torch.Tensor, out: ForwardOut, held: int, accepted: int) -> None:
    """One verify step's drafting: the accepted pairs in (the drafter back to before them), then the draft."""
    p.cached = held - accepted
    p.accept(tokens, None, [], out)
    p.propose(tokens, SamplingParams(), 64)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", default="peagle", choices=("peagle", "dflash"))
    ap.add_argument("--k", default="4", help="tokens per draft, comma-separated: one case each")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--accepted", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=300)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(TargetConfig(dtype="float32")).model
    ks = [int(k) for k in args.k.split(",")]
    ps = proposers(args.kind, target, ks, getattr(torch, args.dtype))
    c, n = target.config, args.context
    tokens = torch.randint(0, c.vocab_size, (n,))
    hidden = torch.randn(n, c.hidden_size)
    prefill = ForwardOut(torch.empty(0), hidden[:-1], [torch.randn(n - 1, c.hidden_size) for _ in range(3)])
    out = ForwardOut(torch.empty(0), hidden[: args.accepted], [torch.randn(args.accepted, c.hidden_size)] * 3)
    times, held = {name: [] for name in ps}, {}
    with torch.inference_mode():
        for name, p in ps.items():
            p.reserve(n + 16)
            p.prefill(tokens, 0, prefill)
            held[name] = p.cached
            for _ in range(10):  # warm-up
                step(p, tokens, out, held[name], args.accepted)
        for _ in range(args.repeats):
            for name, p in ps.items():
                t = time.perf_counter()
                step(p, tokens, out, held[name], args.accepted)
                times[name].append(time.perf_counter() - t)
    base = statistics.median(times["eagle3 level"])
    print(f"{args.dtype}, context {n}, {args.accepted} pairs in per step, {args.repeats} interleaved rounds")
    for name, ts in times.items():
        q = statistics.quantiles(ts, n=4)
        med = statistics.median(ts)
        print(f"  {name:16s} median {1e3 * med:7.3f} ms  (IQR {1e3 * q[0]:.3f}-{1e3 * q[2]:.3f})  x{med / base:.2f}")


if __name__ == "__main__":
    main()
