"""Requests timed side by side: draftsmith's engine with clocks around each step, the target forward in it and the
proposer (TimedEngine), HF transformers' generate on the same prompts, and variants run interleaved prompt by prompt
after a warm-up. The harness of eval/gpu_bench.py and of benchmarks/bench_engine.py and bench_drafters.py."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from draftsmith.serve.engine.engine import Engine
from draftsmith.serve.engine.metrics import Metrics
from draftsmith.serve.engine.sampling import SamplingParams

GREEDY = SamplingParams()


@dataclass
class Run:
    """One request: its new tokens, timings, and where a step's time went."""

    tokens: list[int]
    total_s: float
    ttft_s: float = 0.0
    metrics: Metrics | None = None
    steps: int = 0
    step_s: float = 0.0  # inside Engine.step
    target_s: float = 0.0  # inside Engine.forward, during a step
    proposer_s: float = 0.0  # inside proposer.propose / accept (drafter forwards included)


class TimedEngine(Engine):
    """Engine with wall-clock counters around each step, the target forward inside it, and the proposer."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.in_step = False
        self.reset_timers()
        if self.proposer is not None:  # wrapped on this instance alone
            self.proposer.propose = self.timed(self.proposer.propose)  # type: ignore[method-assign]
            self.proposer.accept = self.timed(self.proposer.accept)  # type: ignore[method-assign]

    def reset_timers(self) -> None:
        self.steps, self.step_s, self.target_s, self.proposer_s = 0, 0.0, 0.0, 0.0

    def clock(self) -> float:
        self.sync()
        return time.perf_counter()

    def timed(self, fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            begin = self.clock()
            out = fn(*args, **kwargs)
            self.proposer_s += self.clock() - begin
            return out

        return wrapper

    def step(self, *args, **kwargs) -> int:
        self.in_step = True
        begin = self.clock()
        n = super().step(*args, **kwargs)
        self.step_s += self.clock() - begin
        self.steps += 1
        self.in_step = False
        return n

    def forward(self, *args, **kwargs):
        if not self.in_step:  # prefill: not part of a verify step
            return super().forward(*args, **kwargs)
        begin = self.clock()
        out = super().forward(*args, **kwargs)
        self.target_s += self.clock() - begin
        return out


def run_engine(engine: TimedEngine, ids: list[int], max_new: int, eos: tuple[int, ...]) -> Run:
    engine.eos_ids = eos
    engine.reset_timers()
    if engine.proposer is not None:  # each request as if first: suffix's global tree would hold the last repeat's
        engine.proposer.forget()
    g = engine.generate(ids, max_new, GREEDY)
    m = g.metrics
    return Run(g.output_ids, m.total_s, m.ttft_s, m, engine.steps, engine.step_s, engine.target_s, engine.proposer_s)


def run_hf(model, ids: list[int], max_new: int, pad_id: int) -> Run:
    """HF greedy generate of exactly max_new tokens (EOS suppressed until then by min_new_tokens)."""
    x = torch.tensor([ids], device=model.device)
    with torch.inference_mode():
        sync(model.device)
        begin = time.perf_counter()
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
            use_cache=True,
            pad_token_id=pad_id,
        )
        sync(model.device)
        total = time.perf_counter() - begin
    return Run(out[0, len(ids) :].tolist(), total)


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


@dataclass
class Prompt:
    name: str
    ids: list[int]


Variant = tuple[str, Callable[[list[int], int], Run]]


@dataclass
class Results:
    """runs[variant][prompt index] = one Run per repeat."""

    prompts: list[Prompt]
    runs: dict[str, list[list[Run]]] = field(default_factory=dict)


def interleave(desc: str, variants: Sequence[Variant], prompts: list[Prompt], repeats: int, max_new: int, warmup: int):
    res = Results(prompts, {name: [[] for _ in prompts] for name, _ in variants})
    for _, fn in tqdm(variants, desc=f"{desc} warm-up", leave=False):
        fn(prompts[0].ids, warmup)
    with tqdm(total=repeats * len(prompts) * len(variants), desc=desc) as bar:
        for r in range(repeats):
            order = variants if r % 2 == 0 else variants[::-1]
            for i, p in enumerate(prompts):
                for name, fn in order:
                    bar.set_postfix_str(f"{p.name} {name}")
                    res.runs[name][i].append(fn(p.ids, max_new))
                    bar.update()
    return res
