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
    if sp.top_p < 1:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p > sp.top_p  # keep the smallest set reaching top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def pick(logits: Tensor, sp: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from one row of logits."""
    if sp.greedy:
        return int(logits.argmax())
    return sample(probs_from_logits(logits, sp), generator)


def widen(probs: Tensor, ids: Tensor | None, vocab_size: int) -> Tensor:
    """Draft probabilities over a draft vocabulary [rows, len(ids)] -> over the target's [rows, vocab_size]."""
    if ids is None:
        return probs
    full = probs.new_zeros(probs.shape[0], vocab_size)
    full[:, ids] = probs
    return full
