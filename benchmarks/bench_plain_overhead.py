#!/usr/bin/env python
"""What a step the draft policy leaves plain costs with a drafter attached, against plain decoding's own step.

Four engines on the real SmolLM2-135M, greedy, a suite's first turns (MT-bench's by default), run interleaved prompt
by prompt after a warm-up; per request, its decode time per token (TTFT apart) and its TTFT:
- plain: no drafter;
- attached: the head loaded and fed as under the policy (its prefill, the target's tapped layers, what each step
  hands it), never asked to draft: every step's plan is a plain step;
- deciding: the policy judging the head every step as the engine does, with every verify row past the first priced
  out of reach and no probe: it drafts once per round (the policy's first look at the head's shape, every node then
  cut) and never verifies a draft;
- unbenched: the policy attaching the head to every request (spec.policy.bench_after=0);
- policy: the policy as the engine runs it (its first draft, probes, drafts it judges worth it, and requests the head
  sits out once it stopped paying);
- with --head-window N, windowed: the policy with spec.head_window=N (the head's prefill over the prompt's last N
  tokens alone).
Each is set against plain, per token and per whole request, with a 95% bootstrap interval over prompts (paired: the
same prompts resampled together), and how many times each asked the head for a draft.
The prefix cache is off, so every request prefills its whole prompt, the head's too.

  python benchmarks/bench_plain_overhead.py --drafter runs/main/eagle3/final [--prompts 16] [--new 64] [--rounds 3]
      [--suite rag] [--head-window 256]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
from dataclasses import replace

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402

from draftsmith.eval.machine import cpu_flags  # noqa: E402
from draftsmith.eval.suites import SuiteConfig, load_suite  # noqa: E402
from draftsmith.serve.build import build_engine  # noqa: E402
from draftsmith.serve.engine.engine import Engine  # noqa: E402
from draftsmith.serve.engine.policy import Plan  # noqa: E402
from draftsmith.serve.engine.sampling import SamplingParams  # noqa: E402
from draftsmith.serve.models.target import LoadedTarget, TargetConfig, encode_chat, load_target  # noqa: E402
from draftsmith.serve.spec import SpecConfig  # noqa: E402

GREEDY = SamplingParams()
RESAMPLES = 2000


def engines(target: LoadedTarget, drafter: str, max_seq_len: int, window: int) -> dict[str, Engine]:
    cache = TargetConfig().cache_dir
    plain = build_engine(target, SpecConfig("ar"), False, max_seq_len, cache_dir=cache)
    spec = SpecConfig("eagle3", drafter=drafter, verify="policy")
    made = {name: build_engine(target, spec, False, max_seq_len, cache_dir=cache) for name in ENGINES}
    for name, engine in made.items():
        ENGINES[name](engine)
    if window:
        windowed = replace(spec, head_window=window)
        made["windowed"] = build_engine(target, windowed, False, max_seq_len, cache_dir=cache)
        ASKED["windowed"] = 0
    made = {"plain": plain, **made}
    for name, engine in made.items():
        counted(engine, ASKED, name)
    return made


def never_drafts(engine: Engine) -> None:
    never_benched(engine)
    policy = engine.policy
    assert policy is not None, "built with spec.verify=policy"
    policy.plan = lambda parts, tokens, sp, budget, timed: Plan(policy.empty_tree(tokens.device))  # type: ignore[method-assign]


def judges_nothing_worth(engine: Engine) -> None:
    policy = engine.policy
    assert policy is not None, "built with spec.verify=policy"
    policy.cfg = replace(policy.cfg, probe_every=0, bench_after=0)
    one_row = policy.cost(1)
    policy.cost = lambda rows: one_row if rows <= 1 else math.inf


def counted(engine: Engine, asked: dict[str, int], name: str) -> None:
    """Count the drafts the engine asks its proposer for."""
    if engine.proposer is None:
        return
    propose = engine.proposer.propose

    def asking(*args, **kwargs):
        asked[name] += 1
        return propose(*args, **kwargs)

    engine.proposer.propose = asking  # type: ignore[method-assign]


def never_benched(engine: Engine) -> None:
    assert engine.policy is not None, "built with spec.verify=policy"
    engine.policy.cfg = replace(engine.policy.cfg, bench_after=0)


ENGINES = {
    "attached": never_drafts,
    "deciding": judges_nothing_worth,
    "unbenched": never_benched,
    "policy": lambda engine: None,
}
ASKED = {"plain": 0, **dict.fromkeys(ENGINES, 0)}  # drafts asked of the head, per engine, over the timed rounds


def timed_request(engine: Engine, ids: list[int], new: int) -> tuple[tuple[float, float, float], list[int]]:
    """(ms per token after the first, TTFT ms, the request's ms), and the tokens."""
    g = engine.generate(ids, new, GREEDY)
    m = g.metrics
    return (1000 * (m.total_s - m.ttft_s) / max(m.new_tokens - 1, 1), 1000 * m.ttft_s, 1000 * m.total_s), g.output_ids


def measure(made: dict[str, Engine], prompts: list[list[int]], new: int, rounds: int) -> dict[str, np.ndarray]:
    """name -> [prompt, round, (tpot, ttft, request)], variants in a rotating order; outputs checked against plain's."""
    out = {name: np.zeros((len(prompts), rounds, 3)) for name in made}
    names = list(made)
    for name in names:  # warm-up: first-call costs, the cost curve
        timed_request(made[name], prompts[0], 8)
    ASKED.update(dict.fromkeys(ASKED, 0))
    for r in range(rounds):
        for engine in made.values():  # each round starts cold, as an eval's repeat does
            engine.forget()
        for i, ids in enumerate(prompts):
            k = (i + r) % len(names)
            tokens = {}
            for name in names[k:] + names[:k]:
                out[name][i, r], tokens[name] = timed_request(made[name], ids, new)
            assert all(t == tokens["plain"] for t in tokens.values()), f"prompt {i}: an output differs from plain's"
        print(f"round {r + 1}/{rounds} done")
    assert ASKED["attached"] == 0 and ASKED["deciding"] <= rounds, ASKED
    return out


def paired(a: np.ndarray, b: np.ndarray, seed: int = 0) -> tuple[float, float, float]:
    """sum(a) / sum(b) over prompts (each prompt's rounds averaged), with a 95% bootstrap interval."""
    a, b = a.mean(axis=1), b.mean(axis=1)
    rng = np.random.default_rng(seed)
    w = rng.multinomial(len(a), [1 / len(a)] * len(a), size=RESAMPLES)
    draws = (w @ a) / (w @ b)
    low, high = np.percentile(draws, [2.5, 97.5])
    return float(a.sum() / b.sum()), float(low), float(high)


def report(out: dict[str, np.ndarray]) -> None:
    base = out["plain"]
    cols = "".join(f"  {label:>8s}  {'vs plain':>22s}" for label in ("ms/token", "TTFT ms", "request"))
    print(f"{'engine':10s}{cols}  drafts asked")
    for name, x in out.items():
        cells = ""
        for j in range(3):
            r, lo, hi = paired(x[..., j], base[..., j])
            cells += f"  {statistics.median(x[..., j].ravel()):8.1f}  {r:6.3f}x [{lo:.3f}, {hi:.3f}]"
        print(f"{name:10s}{cells}  {ASKED[name]}")
    for j, label in enumerate(("ms per token", "TTFT", "request")):
        r, lo, hi = paired(out["policy"][..., j], out["unbenched"][..., j])
        print(f"policy / unbenched {label}: {r:.3f}x [{lo:.3f}, {hi:.3f}]")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", required=True, help="an EAGLE-3 drafter folder")
    ap.add_argument("--suite", default="mt_bench", help="a suite's first turns (mt_bench, humaneval, rag, ...)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--head-window", type=int, default=0, help="also the policy with spec.head_window=N (0: not)")
    args = ap.parse_args()
    target = load_target(TargetConfig())
    questions = [p.turns[0] for p in load_suite(SuiteConfig(name=args.suite), args.prompts)]
    prompts = [encode_chat(target.tokenizer, [{"role": "user", "content": q}]) for q in questions]
    made = engines(target, args.drafter, max(map(len, prompts)) + args.new + 64, args.head_window)
    flags = " ".join(cpu_flags())
    print(f"{target.target_id}, {len(prompts)} {args.suite} first turns x {args.rounds} rounds, {args.new} new tokens")
    print(f"CPU flags: {flags}")
    report(measure(made, prompts, args.new, args.rounds))


if __name__ == "__main__":
    main()
