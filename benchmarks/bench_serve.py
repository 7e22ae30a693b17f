#!/usr/bin/env python
"""Tokens/s through draftsmith-serve's endpoint against the engine called directly: same prompts, side by side.

The real SmolLM2-135M target (dtype auto), MT-bench first turns taken round-robin over categories, greedy, batch 1,
the prefix cache on in both. `engine`: Engine.generate in this process, in a thread of its own as in the server.
`endpoint` and `endpoint-stream`: a draftsmith-serve process (same target, spec, dtype, and OMP_NUM_THREADS: it
inherits this environment), one request at a time through the openai client, timed at the client: chat template and
tokenization, HTTP, queueing, detokenization and JSON or server-sent events included. Variants run interleaved
prompt by prompt, their order rotating with the repeat; a variant's time on a prompt is the median over repeats and
its tokens/s the sum of tokens over the sum of those medians. The ratio's 95% interval is a bootstrap over prompts.
Every output is checked identical token for token to the engine's.

    python benchmarks/bench_serve.py                       # 8 prompts x 64 tokens x 3 repeats, spec=ngram
    OMP_NUM_THREADS=1 python benchmarks/bench_serve.py --prompts 16 --new 128 --spec suffix
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import openai  # noqa: E402
import torch  # noqa: E402

from draftsmith.eval.suites import SuiteConfig, load_suite  # noqa: E402
from draftsmith.peers.processes import free_port, wait_healthy  # noqa: E402
from draftsmith.serve.build import build_engine  # noqa: E402
from draftsmith.serve.engine.sampling import SamplingParams  # noqa: E402
from draftsmith.serve.models.target import TargetConfig, encode_chat, load_target  # noqa: E402
from draftsmith.serve.spec import SpecConfig  # noqa: E402

VARIANTS = ("engine", "endpoint", "endpoint-stream")
MODEL = "smollm2-135m"


def start_server(spec: str, port: int) -> subprocess.Popen:
    """The server inherits this environment: OMP_NUM_THREADS sets both sides' threads alike."""
    cmd = [sys.executable, "-m", "draftsmith.serve.http", f"spec={spec}", f"port={port}", f"model_name={MODEL}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if wait_healthy(proc, f"http://127.0.0.1:{port}"):
        return proc
    proc.kill()
    raise SystemExit(f"draftsmith-serve did not start: {' '.join(cmd)}")


def direct(engine, tokenizer, new: int) -> Callable[[str], tuple[list[int], float, float]]:
    """The engine in a thread of its own, as the server runs it."""
    pool = ThreadPoolExecutor(1)

    def generate(question: str) -> tuple[list[int], float, float]:
        ids = encode_chat(tokenizer, [{"role": "user", "content": question}])
        begin = time.perf_counter()
        g = engine.generate(ids, new, SamplingParams())
        return g.output_ids, time.perf_counter() - begin, g.metrics.ttft_s

    return lambda question: pool.submit(generate, question).result()


def endpoint(client: openai.OpenAI, new: int, stream: bool) -> Callable[[str], tuple[list[int], float, float]]:
    def run(question: str) -> tuple[list[int], float, float]:
        kw = dict(model=MODEL, messages=[{"role": "user", "content": question}], temperature=0, max_tokens=new)
        begin = time.perf_counter()
        if not stream:
            r = client.chat.completions.create(**kw, extra_body={"return_token_ids": True})
            took = time.perf_counter() - begin
            return r.choices[0].model_extra["token_ids"], took, float("nan")
        ids, first = [], None
        for chunk in client.chat.completions.create(**kw, stream=True, extra_body={"return_token_ids": True}):
            got = chunk.choices[0].model_extra.get("token_ids") if chunk.choices else None
            if got:
                first = first or time.perf_counter() - begin
                ids += got
        return ids, time.perf_counter() - begin, first

    return run


def measure(runs: dict, questions: list[str], repeats: int) -> dict:
    """variant -> per prompt (tokens, median seconds, median first-token seconds); outputs checked identical."""
    times = {v: [[] for _ in questions] for v in runs}
    firsts = {v: [[] for _ in questions] for v in runs}
    outputs: dict[str, list] = {v: [None] * len(questions) for v in runs}
    order = list(runs)
    for rep in range(repeats):
        for i, q in enumerate(questions):
            shift = (rep + i) % len(order)
            for v in order[shift:] + order[:shift]:
                ids, took, first = runs[v](q)
                outputs[v][i] = ids
                times[v][i].append(took)
                firsts[v][i].append(first)
    for v in runs:
        same = sum(a == b for a, b in zip(outputs[v], outputs["engine"], strict=True))
        assert same == len(questions), f"{v}: {same}/{len(questions)} outputs identical to the engine's"
    tokens = [len(ids) for ids in outputs["engine"]]
    return {
        v: (tokens, [statistics.median(t) for t in times[v]], [statistics.median(f) for f in firsts[v]]) for v in runs
    }


def ratio_interval(tokens, a, b, draws: int = 10000) -> tuple[float, float, float]:
    """tok/s of a over tok/s of b (sums over prompts), with a 95% bootstrap interval over prompts."""
    tokens, a, b = np.array(tokens, float), np.array(a), np.array(b)
    rate = lambda idx: (tokens[idx].sum() / a[idx].sum()) / (tokens[idx].sum() / b[idx].sum())
    idx = np.random.default_rng(0).integers(0, len(tokens), (draws, len(tokens)))
    boot = np.array([rate(row) for row in idx])
    return rate(np.arange(len(tokens))), *np.percentile(boot, [2.5, 97.5])


def report(res: dict, args) -> None:
    tokens = res["engine"][0]
    print(
        f"{len(tokens)} MT-bench prompts x {args.new} new tokens, spec={args.spec}, greedy, {args.repeats} repeats, "
        f"{torch.get_num_threads()} threads, {sum(tokens)} tokens per pass; every output identical to the engine's"
    )
    for v in VARIANTS:
        _, secs, firsts = res[v]
        tps = sum(tokens) / sum(secs)
        speed, lo, hi = ratio_interval(tokens, secs, res["engine"][1])
        first = [f for f in firsts if f == f]
        ttft = f"TTFT {statistics.median(first) * 1000:6.1f} ms" if first else "TTFT      -   "
        print(f"  {v:16s} {tps:6.1f} tok/s  {ttft}  vs engine {speed:.3f}x [{lo:.3f}, {hi:.3f}]")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--spec", default="ngram")
    args = ap.parse_args()
    questions = [p.turns[0] for p in load_suite(SuiteConfig(name="mt_bench"), args.prompts)]
    target = load_target(TargetConfig())
    engine = build_engine(target, SpecConfig(args.spec), True, 4096)
    port = free_port()
    proc = start_server(args.spec, port)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=600)
        runs = {
            "engine": direct(engine, target.tokenizer, args.new),
            "endpoint": endpoint(client, args.new, stream=False),
            "endpoint-stream": endpoint(client, args.new, stream=True),
        }
        for q in questions[:2]:  # warm-up: first calls, and the prefix caches of both filled alike
            for run in runs.values():
                run(q)
        report(measure(runs, questions, args.repeats), args)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


if __name__ == "__main__":
    main()
