"""Temperature > 0: outputs differ run to run, so instead of token equality test whether a method's outputs
look drawn from the same distribution as plain sampling's.

The test: total variation (TV) distance between the pooled output-token histograms of plain decoding and the
method, with a p-value from a paired permutation test. Tokens seen fewer than MIN_COUNT times (both sides
together) share one bin: with a vocabulary of ~50k and a few thousand samples most tokens appear once, and
TV over such raw histograms saturates near 1 whatever the sampler does.

A unit is one prompt in one repeat (all its turns); plain and method runs of a unit use independent seeds, so
under H0 (the method samples the target's distribution) their labels are exchangeable, and swapping them per
unit gives the statistic's null distribution. A unigram histogram ignores order, so this can miss a bug that
keeps token frequencies; a large p is no proof.
"""

from __future__ import annotations

import itertools

import numpy as np

from .aggregate import Record
from .results import DistributionCheck

TEST = "paired permutation test of the TV distance between pooled output-token histograms (plain vs method)"
MIN_COUNT = 5
TOO_FEW = (
    f"too few samples: no output token occurred {MIN_COUNT} times (both sides together), so there is nothing to "
    "compare; raise max_new_tokens, repeats or the number of prompts"
)


def histograms(base: list[Record], records: list[Record]) -> tuple[np.ndarray, np.ndarray]:
    """[units, bins] token counts of plain decoding and of the method, units matched by (id, repeat); the last
    bin holds the rare tokens."""
    units = sorted({(r.id, r.repeat) for r in base} & {(r.id, r.repeat) for r in records})
    vocab = sorted({t for r in base + records for t in r.output_ids})
    col = {t: j for j, t in enumerate(vocab)}
    row = {u: i for i, u in enumerate(units)}
    a, b = np.zeros((len(units), len(vocab))), np.zeros((len(units), len(vocab)))
    for counts, rs in ((a, base), (b, records)):
        for r in rs:
            if (r.id, r.repeat) in row:
                np.add.at(counts[row[(r.id, r.repeat)]], [col[t] for t in r.output_ids], 1)
    keep = (a + b).sum(0) >= MIN_COUNT  # chosen from both sides pooled, so label swaps leave the bins unchanged
    rare = lambda m: m[:, ~keep].sum(1, keepdims=True)
    return np.hstack([a[:, keep], rare(a)]), np.hstack([b[:, keep], rare(b)])


def tv(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """TV distance between the row sums' distributions; a, b: [..., vocab]."""
    pa = a / np.maximum(a.sum(-1, keepdims=True), 1)
    pb = b / np.maximum(b.sum(-1, keepdims=True), 1)
    return 0.5 * np.abs(pa - pb).sum(-1)


def swaps(units: int, permutations: int, seed: int) -> tuple[np.ndarray, bool]:
    """[n, units] 0/1 rows: which units swap labels. All 2^units when that is few enough (an exact test)."""
    if 2**units <= permutations:
        return np.array(list(itertools.product((0.0, 1.0), repeat=units))).reshape(-1, units), True
    return np.random.default_rng(seed).integers(0, 2, (permutations, units)).astype(float), False


def distribution_check(
    base: list[Record], records: list[Record], permutations: int = 1000, seed: int = 0
) -> DistributionCheck:
    a, b = histograms(base, records)
    units = a.shape[0]
    if units == 0 or a.sum() == 0 or b.sum() == 0:
        return DistributionCheck(TEST, units, note="no outputs to compare")
    if a.shape[1] == 1:  # only the rare bin: TV is 0 and p is 1 whatever the sampler does
        return DistributionCheck(TEST, units, note=TOO_FEW)
    observed = float(tv(a.sum(0), b.sum(0)))
    s, exact = swaps(units, permutations, seed)
    diff = b - a
    null = tv(a.sum(0) + s @ diff, b.sum(0) - s @ diff)
    hits = int((null >= observed - 1e-12).sum())
    p = hits / len(s) if exact else (hits + 1) / (len(s) + 1)
    return DistributionCheck(
        test=TEST,
        units=units,
        permutations=len(s),
        exact=exact,
        tv_distance=observed,
        p_value=p,
        mean_new_tokens={"ar": mean_len(base), "method": mean_len(records)},
        note="H0: same output distribution. p < 0.01 flags a sampling bug; a large p is no proof "
        "(power grows with prompts x repeats)",
    )


def mean_len(records: list[Record]) -> float:
    return sum(len(r.output_ids) for r in records) / len(records) if records else 0.0
