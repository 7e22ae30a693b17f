"""N-gram prompt lookup: draft what followed the latest earlier occurrence of the last n tokens."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from draftsmith.serve.engine.sampling import SamplingParams
from draftsmith.serve.engine.tree import DraftTree
from draftsmith.serve.models.target import LoadedTarget
from draftsmith.serve.proposers.base import Proposer
from draftsmith.serve.spec import SpecConfig


@dataclass
class NgramConfig:
    num_tokens: int = 5  # k: tokens drafted per step
    min_n: int = 2
    max_n: int = 4
    window: int = 4096  # search only this many latest tokens

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"ngram needs 1 <= min_n <= max_n, got min_n={self.min_n} max_n={self.max_n}")
        if self.num_tokens < 1:
            raise ValueError(f"spec.num_tokens must be >= 1, got {self.num_tokens}")


class NgramProposer(Proposer):
    name = "ngram"
    by_lookup = True

    def __init__(self, cfg: NgramConfig) -> None:
        self.cfg = cfg
        self.max_tree_size = cfg.num_tokens

    def propose(self, tokens: Tensor, sp: SamplingParams, budget: int) -> DraftTree:
        history, k = tokens[-self.cfg.window :], min(self.cfg.num_tokens, budget)
        for n in range(self.cfg.max_n, self.cfg.min_n - 1, -1):
            draft = lookup(history, n, k)
            if draft is not None:
                tree = DraftTree.chain(draft)
                tree.match_len = n
                return tree
        return DraftTree.empty(tokens.device)


def ngram_proposer(spec: SpecConfig, target: LoadedTarget) -> NgramProposer:
    assert spec.num_tokens is not None, "serve/build.py resolves it"
    return NgramProposer(NgramConfig(spec.num_tokens, spec.min_n, spec.max_n))


def lookup(tokens: Tensor, n: int, k: int) -> Tensor | None:
    """Up to k tokens that followed the latest earlier match of tokens[-n:], or None."""
    if tokens.numel() <= n:
        return None
    windows = tokens[:-1].unfold(0, n, 1)  # every window leaves >= 1 token after it
    hits = (windows == tokens[-n:]).all(dim=1).nonzero()
    if hits.numel() == 0:
        return None
    start = int(hits[-1]) + n
    return tokens[start : start + k].clone()
