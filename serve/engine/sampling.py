"""Sampling settings and the logits -> probabilities transform shared by plain and speculative decoding."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probs_from_logits(logits: Tensor, sp: SamplingParams) -> Tensor:
    """[..., vocab] logits -> the distribution plain sampling draws from (temperature, top-k, top-p)."""
    logits = logits.float() / sp.temperature
    if sp.top_k:
        kth = torch.topk(logits, min(sp.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return nucleus(probs, sp.top_p) if sp.top_p < 1 else probs


NUCLEUS_FIRST = 256  # the most likely tokens looked at before sorting the whole vocabulary


def nucleus(probs: Tensor, top_p: float) -> Tensor:
    """The smallest set of most likely tokens reaching top_p, renormalised. Sorting the whole vocabulary is the cost,
    and the set almost always ends within the NUCLEUS_FIRST most likely tokens: a row where it does drops the rest
    unsorted (the same set: each token past them follows at least their mass); only the other rows are sorted."""
    rows = probs.reshape(-1, probs.shape[-1])
    top, idx = rows.topk(min(NUCLEUS_FIRST, rows.shape[-1]), dim=-1)
    kept = torch.zeros_like(rows).scatter(-1, idx, within(top, top_p))
    wide = top.cumsum(-1)[:, -1] <= top_p  # the set reaches past the first tokens (the same sum the rule reads)
    if bool(wide.any()):
        top, idx = rows[wide].sort(dim=-1, descending=True)
        kept[wide] = torch.zeros_like(top).scatter(-1, idx, within(top, top_p))
    return (kept / kept.sum(-1, keepdim=True)).view_as(probs)


def within(ranked: Tensor, top_p: float) -> Tensor:
    """Probabilities in descending order with those past the smallest prefix reaching top_p zeroed."""
    return ranked.masked_fill(ranked.cumsum(-1) - ranked > top_p, 0.0)


def sample(probs: Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def pick(logits: Tensor, sp: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from one row of logits."""
    if sp.greedy:
        return int(logits.argmax())
    return sample(probs_from_logits(logits, sp), generator)


def pick_rows(logits: Tensor, sp: SamplingParams, generators: list[torch.Generator | None]) -> list[int]:
    """One token from each row of logits [rows, vocab], row i drawn with generators[i] from the distribution
    probs_from_logits gives (not pick's draw for a seed: it draws from the whole vocabulary). Under top_p only the
    NUCLEUS_FIRST most likely tokens of a row are ranked, where its set ends within them, and no row's whole
    distribution is written out. The kept tokens are drawn in vocabulary order: a rounding-level change in the logits
    (another batch, a resume) that swaps two near-tied tokens' ranks does not change the draw."""
    if sp.greedy:
        return logits.argmax(-1).tolist()
    if sp.top_k or sp.top_p == 1:
        probs = probs_from_logits(logits, sp)
        return [int(torch.multinomial(row, 1, generator=g)) for row, g in zip(probs, generators, strict=True)]
    z = logits.float() / sp.temperature
    top, idx = z.topk(min(NUCLEUS_FIRST, z.shape[-1]), dim=-1)
    ranked = (top - torch.logsumexp(z, dim=-1, keepdim=True)).exp()
    out = []
    for i, g in enumerate(generators):
        p, ids = ranked[i], idx[i]
        if bool(p.cumsum(-1)[-1] <= sp.top_p):  # the set reaches past the first tokens: rank the whole row
            p, ids = (z[i] - torch.logsumexp(z[i], -1)).exp().sort(descending=True)
        kept = within(p, sp.top_p)
        ids, order = ids[kept > 0].sort()
        out.append(int(ids[torch.multinomial(kept[kept > 0][order], 1, generator=g)]))
    return out


def widen(probs: Tensor, ids: Tensor | None, vocab_size: int) -> Tensor:
    """Draft probabilities over a draft vocabulary [rows, len(ids)] -> over the target's [rows, vocab_size]."""
    if ids is None:
        return probs
    full = probs.new_zeros(probs.shape[0], vocab_size)
    full[:, ids] = probs
    return full
