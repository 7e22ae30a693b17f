"""The draft length to serve with at each concurrency level, from a measured sweep of draft lengths (K) against
plain decoding, and how vLLM 0.32 takes it.

Per level: the K with the best throughput speedup among those whose 95% interval lies above 1, or speculation off
where none does. K whose intervals overlap the best one's are tied (the sweep cannot tell them apart): the shortest
of them is chosen, since it verifies fewer rows per request and so loses least as the batch grows.

vLLM 0.32 has no switch that turns speculation off above a batch size (no `disable_by_batch_size`). It has a
batch-size schedule, `num_speculative_tokens_per_batch_size`: inclusive ranges of the requests in one step, each
with its K, K = 0 drafting nothing, every K capped at `num_speculative_tokens` (the largest K in the schedule), the
last range carried on to `--max-num-seqs`. V1's scheduler picks the K per step and the model runner drafts that
many (CPU included). A step at K = 0 still runs the head's forward once, to keep its KV cache in step: off by
the schedule is cheaper than K >= 1 but not free, so where every level is off, speculation is left out.
"""

from __future__ import annotations

from dataclasses import dataclass

Interval = list[float] | None
SCHEDULE_KEY = "num_speculative_tokens_per_batch_size"
RULE = (
    "the K with the best throughput among those whose interval lies above 1 (the shortest of those tied within "
    "intervals), off where none does"
)


@dataclass(frozen=True)
class Point:
    """One measured cell: K drafted tokens at one concurrency, its throughput speedup over plain decoding."""

    k: int
    concurrency: int
    speedup: float | None
    interval: Interval  # 95%; None: too few rounds to tell


@dataclass(frozen=True)
class Choice:
    concurrency: int
    k: int  # 0: speculation off
    speedup: float | None  # the chosen K's, None when off
    interval: Interval
    why: str


def above_one(p: Point) -> bool:
    return p.interval is not None and p.interval[0] > 1.0


def overlap(a: Point, b: Point) -> bool:
    assert a.interval is not None and b.interval is not None, "only points above 1, which have intervals"
    return a.interval[0] <= b.interval[1] and b.interval[0] <= a.interval[1]


def choose(level: list[Point]) -> Choice:
    """The recommendation at one concurrency from its measured K."""
    n, paying = level[0].concurrency, [p for p in level if above_one(p)]
    if not paying:
        return Choice(n, 0, None, None, "no K's throughput interval lies above 1")
    best = max(paying, key=lambda p: p.speedup or 0.0)
    tied = sorted((p for p in paying if overlap(p, best)), key=lambda p: p.k)
    pick = tied[0]
    if len(tied) == 1:
        return Choice(n, pick.k, pick.speedup, pick.interval, "the best throughput")
    others = ", ".join(f"K={p.k}" for p in tied[1:])
    return Choice(n, pick.k, pick.speedup, pick.interval, f"tied with {others} within intervals: the shortest")


def recommend(points: list[Point]) -> list[Choice]:
    """One choice per measured concurrency, in increasing order."""
    levels = sorted({p.concurrency for p in points})
    return [choose([p for p in points if p.concurrency == n]) for n in levels]


def schedule(choices: list[Choice]) -> list[list[int]]:
    """vLLM's batch-size ranges: a size between two measured levels takes the larger level's K (never more
    speculation than was measured to pay at the higher load); neighbouring ranges with one K are merged."""
    ranges: list[list[int]] = []
    start = 1
    for c in choices:
        if ranges and ranges[-1][2] == c.k:
            ranges[-1][1] = c.concurrency
        else:
            ranges.append([start, c.concurrency, c.k])
        start = c.concurrency + 1
    return ranges


def speculative_options(choices: list[Choice]) -> dict | None:
    """The --speculative-config keys that serve the choices (method and model aside); None: serve without it."""
    ks = {c.k for c in choices}
    if not choices or ks == {0}:
        return None
    if len(ks) == 1:
        return {"num_speculative_tokens": ks.pop()}
    return {"num_speculative_tokens": max(ks), SCHEDULE_KEY: schedule(choices)}


def off_above(choices: list[Choice]) -> int | None:
    """The level above which every measured level is off (0: off at all of them); None: on at the highest."""
    if not choices or choices[-1].k:
        return None
    on = [c.concurrency for c in choices if c.k]
    return on[-1] if on else 0


def verdict(choices: list[Choice]) -> str:
    """Where to turn speculation off, in words."""
    n = off_above(choices)
    top = choices[-1].concurrency if choices else 0
    below = [str(c.concurrency) for c in choices if c.k == 0 and c.concurrency < (n or top)]
    also = f" (and at N={', '.join(below)})" if below else ""
    if n is None:
        return f"speculation pays up to N={top} (the highest level measured){also}"
    if n == 0:
        return "speculation off at every level measured: serve without --speculative-config"
    return f"speculation off above {n} concurrent request{'s' if n > 1 else ''}{also}"


def choice_text(c: Choice) -> str:
    return f"N={c.concurrency}: {'off' if c.k == 0 else f'K={c.k}'}"


def one_line(choices: list[Choice]) -> str:
    """'N=1: K=2, N=4: off, N=16: off; speculation off above 1 concurrent request'."""
    return ", ".join(choice_text(c) for c in choices) + "; " + verdict(choices)
