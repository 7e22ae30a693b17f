"""Which part of a draft to verify: the prefix-closed node set that emits the most tokens per second of step.

a_i (DraftTree.accept_probs): node i's chance of acceptance given its parent's; P_i, the product of a over i and
its ancestors, is its chance of being emitted. Verifying a prefix-closed set S emits 1 + sum_{i in S} P_i tokens in
expectation (the bonus token counted) and costs draft_s + cost(1 + |S|) seconds, cost being the target's verify
forward over that many rows (serve/engine/cost_profile.py). Every candidate size is evaluated; the best is kept.

Lossless under sampling takes two rules. Recursive rejection sampling is exact over whatever siblings are verified
as long as each kept node keeps every earlier sibling drawn before it, so sampling cuts whole depth levels only.
And a node drawn at random (the tree has draft_probs) must not be verified or dropped by a rule that looks at its own
draw: keeping a sampled token only when it is a likely one biases what is emitted. Such trees keep level d by what
levels < d say (a stopping rule); deterministic drafts (top-k, greedy) may look at the whole tree.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate

import torch
from torch import Tensor

from draftsmith.serve.engine.tree import DraftTree

log = logging.getLogger(__name__)

Cost = Callable[[int], float]  # seconds of one verify forward over this many rows


@dataclass
class CostCut:
    """Cuts each draft to the part worth verifying on this machine (spec.verify=cost)."""

    cost: Cost

    def cut(self, tree: DraftTree, draft_s: float, greedy: bool) -> Tensor | None:
        """The kept node indices (ascending); None: keep the whole tree (no accept_probs, or nothing to cut)."""
        if tree.accept_probs is None or not len(tree):
            return None
        if not bool(torch.isfinite(tree.accept_probs).all()):  # a broken estimate judges nothing: verify it all
            warn_once("a draft's accept_probs are not finite (a drafter with NaN weights?): verified whole")
            return None
        a = tree.accept_probs.float().clamp(0.0, 1.0).tolist()
        parents, depths = tree.parent_list, tree.depth_list
        if greedy:
            keep = best_subset(path_probs(parents, a), self.cost, draft_s)
        elif tree.draft_probs is None:
            keep = best_levels(path_probs(parents, a), depths, self.cost, draft_s)
        else:
            keep = stopped_levels(path_probs(parents, a), depths, self.cost, draft_s)
        if len(keep) == len(tree):
            return None
        return torch.tensor(keep, dtype=torch.long, device=tree.tokens.device)


def path_probs(parents: list[int], a: list[float]) -> list[float]:
    """P_i = a_i times P of i's parent (parents come first)."""
    out: list[float] = []
    for p, ai in zip(parents, a, strict=True):
        out.append(ai * (out[p] if p >= 0 else 1.0))
    return out


def best_size(gains: list[float], nodes: list[int], cost: Cost, draft_s: float) -> int:
    """The candidate k maximising (1 + gains[k]) / (draft_s + cost(1 + nodes[k])); the smallest on a tie."""
    rates = [(1.0 + g) / (draft_s + cost(1 + n)) for g, n in zip(gains, nodes, strict=True)]
    return max(range(len(rates)), key=lambda k: (rates[k], -k))


def best_subset(P: list[float], cost: Cost, draft_s: float) -> list[int]:
    """Greedy: the m likeliest nodes for the best m. A child's P never exceeds its parent's and a parent has the
    lower index, so ordering by (-P, index) puts every parent before its children: each prefix is prefix-closed."""
    order = sorted(range(len(P)), key=lambda i: (-P[i], i))
    m = best_size(list(accumulate((P[i] for i in order), initial=0.0)), list(range(len(P) + 1)), cost, draft_s)
    return sorted(order[:m])


def levels(P: list[float], depths: list[int]) -> tuple[list[float], list[int]]:
    """Per depth 1..D: the summed P of its nodes and how many there are."""
    deepest = max(depths, default=0)
    gain, size = [0.0] * deepest, [0] * deepest
    for p, d in zip(P, depths, strict=True):
        gain[d - 1] += p
        size[d - 1] += 1
    return gain, size


def upto(depths: list[int], d: int) -> list[int]:
    return [i for i, di in enumerate(depths) if di <= d]


def best_levels(P: list[float], depths: list[int], cost: Cost, draft_s: float) -> list[int]:
    """Sampling over deterministic drafts: the nodes of depth <= d for the best d."""
    gain, size = levels(P, depths)
    d = best_size(list(accumulate(gain, initial=0.0)), list(accumulate(size, initial=0)), cost, draft_s)
    return upto(depths, d)


def stopped_levels(P: list[float], depths: list[int], cost: Cost, draft_s: float) -> list[int]:
    """Sampling over drawn drafts: level 1 is kept, and level d (d >= 2) while the levels above it say going on
    pays: the levels from d on are guessed from level d-1, each one's P the one before's times level d-1's own
    ratio to level d-2. Whether level d is verified then never depends on level d's draws."""
    gain, size = levels(P, depths)
    nodes = list(accumulate(size, initial=0))
    kept = min(1, len(gain))
    while kept < len(gain):
        last, before = gain[kept - 1], gain[kept - 2] if kept >= 2 else 1.0
        ratio = last / before if before > 0 else 0.0
        guess = gain[:kept] + [last * ratio ** (j + 1) for j in range(len(gain) - kept)]
        known = list(accumulate(guess, initial=0.0))[kept:]
        if best_size(known, nodes[kept:], cost, draft_s) == 0:
            break
        kept += 1
    return upto(depths, kept)


@functools.cache
def warn_once(message: str) -> None:
    log.warning(message)
