"""Acceptance estimates calibrated on what the target accepted: per request and per drafter, updated every step.

A draft node's estimate is the observed acceptance of nodes like it (given its parent's): the same drafter, depth
and strength. Strength is the drafter's own probability for the node, in ten bins, where it gives one; a lookup's
match length where it drafts by lookup; nothing otherwise (a drafter with NaN probabilities falls back there). A
drafter with constant probabilities lands in one bin: judged by observed acceptance alone, as it must be.

A request's counts decay with a half-life in steps, so one that turns from prose to code re-learns. They sit on the
engine's counts over earlier requests, weighted as `prior_weight` observations, which sit on the drafter's own
probability (1/2 where it gives none) weighted as one; where no request has seen a key, a deeper node starts from its
parent level's estimate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

BINS = 10
DEPTHS = 4  # depths past this share their estimates
# (part, sampled, depth, strength kind: 0 none, 1 probability bin, 2 match length; its value)
Key = tuple[int, bool, int, int, int]


@dataclass
class Counts:
    seen: float = 0.0
    hits: float = 0.0
    step: int = 0  # the request step these counts were last decayed to

    def add(self, seen: float, hits: float) -> None:
        self.seen, self.hits = self.seen + seen, self.hits + hits


def bin_of(p: float) -> int:
    return min(int(p * BINS), BINS - 1)


def node_key(part: int, sampled: bool, depth: int, prob: float | None, match_len: int) -> Key:
    """What a node's estimate is pooled by: its drafter, whether the request samples, its depth, and its probability's
    bin, else its lookup's match length, else nothing more."""
    d = min(depth, DEPTHS)
    if prob is not None and math.isfinite(prob):
        return (part, sampled, d, 1, bin_of(min(max(prob, 0.0), 1.0)))
    return (part, sampled, d, 2, min(match_len, 8)) if match_len else (part, sampled, d, 0, 0)


def default_rate(key: Key) -> float:
    """Before anything is observed: the drafter's probability (its bin's middle), else even odds."""
    return (key[4] + 0.5) / BINS if key[3] == 1 else 0.5


@dataclass
class Acceptance:
    prior_weight: float = 4.0  # observations the engine's pooled estimate counts as in a request's
    half_life: float = 32.0  # request steps after which an observation weighs half
    pooled: dict[Key, Counts] = field(default_factory=dict)  # earlier requests, undecayed
    mine: dict[Key, Counts] = field(default_factory=dict)  # this request, decayed
    tally: dict[Key, Counts] = field(default_factory=dict)  # this request, undecayed: pooled at its end
    step: int = 0
    memo: dict[Key, float] = field(default_factory=dict)  # rates asked this step, until an observation

    def start(self) -> None:
        """A new request: the last one's counts join the pool."""
        for key, c in self.tally.items():
            self.pooled.setdefault(key, Counts()).add(c.seen, c.hits)
        self.mine, self.tally, self.step, self.memo = {}, {}, 0, {}

    def tick(self) -> None:
        self.step += 1
        self.memo.clear()

    def rate(self, key: Key) -> float:
        known = self.memo.get(key)
        if known is None:
            known = self.memo[key] = self.fresh_rate(key)
        return known

    def fresh_rate(self, key: Key) -> float:
        pool = self.pooled.get(key)
        prior = self.unseen(key) if pool is None else (pool.hits + default_rate(key)) / (pool.seen + 1.0)
        c = self.mine.get(key)
        if c is None:
            return prior
        self.decay(c)
        return (c.hits + self.prior_weight * prior) / (c.seen + self.prior_weight)

    def unseen(self, key: Key) -> float:
        """A key no earlier request saw: a node one level deeper is estimated as its parent's level is (a draft cut
        short never verifies its deep nodes, and would never learn them from an even-odds guess); depth 1 by the
        drafter's own probability, else even odds."""
        part, sampled, depth, kind, value = key
        return self.rate((part, sampled, depth - 1, kind, value)) if depth > 1 else default_rate(key)

    def observe(self, key: Key, hit: bool) -> None:
        self.memo.clear()
        c = self.mine.setdefault(key, Counts(step=self.step))
        self.decay(c)
        c.add(1.0, hit)
        self.tally.setdefault(key, Counts()).add(1.0, hit)

    def decay(self, c: Counts) -> None:
        if c.step < self.step:
            f = 0.5 ** ((self.step - c.step) / self.half_life)
            c.seen, c.hits, c.step = c.seen * f, c.hits * f, self.step


def reliability_add(table: list[float], predicted: float, hit: bool) -> list[float]:
    """One observation into a reliability table: [count per bin..., predicted sum per bin..., hits per bin...]."""
    if not table:
        table = [0.0] * (3 * BINS)
    b = bin_of(min(max(predicted, 0.0), 1.0))
    table[b] += 1.0
    table[BINS + b] += predicted
    table[2 * BINS + b] += float(hit)
    return table


def calibration_error(table: list[float]) -> float | None:
    """Expected calibration error: the count-weighted mean |predicted - observed| over bins; None when empty."""
    total = sum(table[:BINS])
    if not total:
        return None
    return sum(abs(table[BINS + b] - table[2 * BINS + b]) for b in range(BINS)) / total
