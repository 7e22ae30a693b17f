"""Draft cost of one DFlash forward (block B) against one EAGLE-3 level, random heads of SmolLM2-135M's shape.

Both heads are built from a SmolLM2-shaped config with random weights (no target weights are needed: only the
shapes set the cost), packed as serve/build.py packs a loaded drafter, and timed interleaved in one run, so the
machine's load hits both alike; the ratio of medians is the result (absolute times on a shared machine are not).
  EAGLE-3 level: the head over one drafted row at context n (cached) + logits over the draft vocabulary.
  DFlash block:  the context k/v of one verified token + the block of B slots at context n + logits of B-1 slots.
Run: python scripts/bench_dflash_cost.py [--blocks 2,4,8] [--context 300] [--reps 200] [--dtype float32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from draftsmith.heads.dflash import DFlashConfig, DFlashHead
from draftsmith.heads.eagle3 import Eagle3Config, Eagle3Head
from draftsmith.heads.kv_cache import KVCache
from draftsmith.heads.llama import ModelConfig
from draftsmith.heads.packed import pack_linears

SMOL = ModelConfig(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    rope_theta=100000.0,
    max_position_embeddings=8192,
    eos_token_ids=[2],
)


def ready(head: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    head = head.to(dtype).eval().requires_grad_(False)
    pack_linears(head)
    return head


def eagle3_level(head: Eagle3Head, cache: KVCache, n: int):
    feat, tok = torch.randn(1, 1, SMOL.hidden_size, dtype=head.fc.weight.dtype), torch.tensor([[5]])
    pos = torch.tensor([n])
    mask = torch.ones(1, n + 1, dtype=torch.bool)

    def step():
        h = head(feat, tok, pos, cache, n, mask)[0]
        return head.logits(h).float()

    return step


def dflash_block(head: DFlashHead, cache: KVCache, n: int):
    ctx = torch.randn(1, len(head.config.target_layers) * SMOL.hidden_size, dtype=head.fc.weight.dtype)

    def step():
        head.write_context(head.target_features(None, ctx), torch.tensor([n - 1]), cache, n - 1)
        x = head.draft(head.block_tokens(torch.tensor(5)), n, cache)
        return head.logits(x[1:]).float()

    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", default="2,4,8")
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = p.parse_args()
    dtype, n = getattr(torch, args.dtype), args.context
    torch.manual_seed(0)
    e3 = ready(Eagle3Head(Eagle3Config.from_target(SMOL)), dtype)
    e3.rope_cache(n + 16)
    ecache = KVCache.allocate(1, SMOL.num_key_value_heads, SMOL.head_dim, n + 16, dtype, "cpu")
    steps = {"eagle3 level": eagle3_level(e3, ecache, n)}
    for b in map(int, args.blocks.split(",")):
        head = ready(DFlashHead(DFlashConfig.from_target(SMOL, block_size=b)), dtype)
        head.rope_cache(n + b + 1)
        cache = KVCache.allocate(1, SMOL.num_key_value_heads, SMOL.head_dim, n + b + 1, dtype, "cpu")
        steps[f"dflash B={b}"] = dflash_block(head, cache, n)
    times = {k: [] for k in steps}
    with torch.no_grad():
        for f in steps.values():  # warm-up
            for _ in range(5):
                f()
        for _ in range(args.reps):  # interleaved: each round runs every case once
            for name, f in steps.items():
                t = time.perf_counter()
                f()
                times[name].append(time.perf_counter() - t)
    base = statistics.median(times["eagle3 level"])
    print(f"threads {torch.get_num_threads()}, {args.dtype}, context {n}, {args.reps} interleaved rounds")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:14s} median {med * 1e3:7.3f} ms   / eagle3 level {med / base:5.2f}")


if __name__ == "__main__":
    main()
