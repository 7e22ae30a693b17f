"""Draft trees: what a proposer hands the verifier.

Node i has a token, a parent (-1 = the root, i.e. the pending token whose KV is not cached
yet) and a depth (root children have depth 1). Nodes are topologically ordered (parent < i).
For sampling, each node also carries the draft distribution its token was drawn from, given
its earlier siblings; a deterministic choice (greedy, n-gram, top-k) is a one-hot row. A drafter that knows how
likely its nodes are also sets accept_probs, which the engine's cost cut (serve/engine/draft_cut.py) cuts by.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class TreeConfig:
    """EAGLE-2 dynamic tree: every level expands the topk best nodes (by cumulative log-prob) into topk children
    each; at the end the total_tokens best of all drafted nodes are kept. topk=1 drafts a chain."""

    topk: int | None = 1  # None (in a spec): the drafter's
    total_tokens: int | None = 0  # 0: keep every drafted node (topk + (depth - 1) * topk^2); None: the drafter's

    def __post_init__(self) -> None:
        if self.topk is not None and self.topk < 1:
            raise ValueError(f"spec.tree.topk must be >= 1, got {self.topk}")
        if self.total_tokens is not None and self.total_tokens < 0:
            raise ValueError(f"spec.tree.total_tokens must be >= 0 (0 = keep all), got {self.total_tokens}")

    @property
    def width(self) -> int:
        """topk of a tree a proposer drafts: serve/build.py has resolved it from the drafter by then."""
        assert self.topk is not None, "spec.tree.topk is unresolved"
        return self.topk


@dataclass
class DraftTree:
    tokens: Tensor  # [n] int64
    parents: Tensor  # [n] int64, -1 for children of the root
    draft_probs: Tensor | None = None  # [n, vocab] or None (then every node counts as one-hot)
    # [n] float: each node's estimated chance of acceptance given its parent's (the draft's probability of its token
    # under its parent's distribution); None: unknown, the tree is verified whole
    accept_probs: Tensor | None = None
    match_len: int = 0  # a lookup draft's strength where it has no probabilities: the tokens its match is long

    def __post_init__(self) -> None:
        self.parent_list: list[int] = self.parents.tolist()  # the same as Python ints, for per-node decisions
        self.depth_list = python_depths(self.parent_list)
        self.depths = torch.tensor(self.depth_list, dtype=torch.long, device=self.parents.device)

    @classmethod
    def chain(cls, tokens: Tensor, draft_probs: Tensor | None = None, accept_probs: Tensor | None = None) -> DraftTree:
        n = tokens.numel()
        return cls(tokens, torch.arange(-1, n - 1, device=tokens.device), draft_probs, accept_probs)

    @classmethod
    def empty(cls, device: torch.device | str = "cpu") -> DraftTree:
        z = torch.zeros(0, dtype=torch.long, device=device)
        return cls(z, z.clone())

    def __len__(self) -> int:
        return self.tokens.numel()

    @property
    def is_chain(self) -> bool:
        return bool((self.parents == torch.arange(-1, len(self) - 1, device=self.parents.device)).all())

    def subtree(self, keep: Tensor) -> DraftTree:
        """The nodes `keep` (ascending, prefix-closed: a kept node's parent is kept), renumbered 0.. in that order;
        their draft and accept probabilities come along."""
        new_index = torch.full_like(self.parents, -1)
        new_index[keep] = torch.arange(keep.numel(), device=keep.device)
        p = self.parents[keep]
        parents = torch.where(p >= 0, new_index[p.clamp_min(0)], p)
        draft = None if self.draft_probs is None else self.draft_probs[keep]
        accept = None if self.accept_probs is None else self.accept_probs[keep]
        return DraftTree(self.tokens[keep], parents, draft, accept, self.match_len)

    def children(self) -> list[list[int]]:
        """children()[0] are the root's, children()[i + 1] are node i's, in proposal order."""
        kids: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, p in enumerate(self.parent_list):
            kids[p + 1].append(i)
        return kids

    def positions(self, prefix_len: int) -> Tensor:
        """Position ids of [root, nodes...]: the root sits at prefix_len, a node at prefix_len + depth."""
        root = torch.zeros(1, dtype=torch.long, device=self.tokens.device)
        return prefix_len + torch.cat([root, self.depths])

    def attention_mask(self, prefix_len: int) -> Tensor:
        """Bool [n+1, prefix_len+n+1]: every row sees the whole prefix, itself and its ancestors."""
        n = len(self)
        anc = torch.eye(n + 1, dtype=torch.bool, device=self.tokens.device)
        anc[1:, 0] = True
        for i, p in enumerate(self.parent_list):
            if p >= 0:
                anc[i + 1] |= anc[p + 1]
        prefix = torch.ones(n + 1, prefix_len, dtype=torch.bool, device=anc.device)
        return torch.cat([prefix, anc], dim=1)


def python_depths(parents: list[int]) -> list[int]:
    depths: list[int] = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    return depths


def causal_mask(start: int, n: int, device) -> Tensor | None:
    """Bool [n, start+n] for n new tokens after `start` cached ones; None where SDPA needs none."""
    if n == 1 or start == 0:
        return None
    return torch.ones(n, start + n, dtype=torch.bool, device=device).tril(start)
