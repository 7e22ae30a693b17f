"""Medusa proposer: a static tree filled from the heads' top-k tokens at the last verified position.

Offsets: the engine's pending token sits at t+1, where t is the last position the target has verified, and
only hidden(t) is known when drafting. Head k reads hidden(t) and predicts token t+k+2, so the tree's
depth-1 nodes (children of the pending token) come from head 0, depth-2 nodes from head 1, and so on.
A path [i, j] means: the i-th most likely token of head 0, then the j-th most likely of head 1.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import Tensor

from draftsmith.heads.medusa import DEFAULT_CHOICES, MedusaHeads
from draftsmith.runtime.llama import ForwardOut
from draftsmith.serve.drafters import load_drafter
from draftsmith.serve.engine.sampling import SamplingParams
from draftsmith.serve.engine.tree import DraftTree
from draftsmith.serve.models.target import LoadedTarget
from draftsmith.serve.proposers.base import Proposer
from draftsmith.serve.spec import SpecConfig


def tree_from_choices(choices: list[list[int]], max_depth: int) -> list[tuple[int, ...]]:
    """Paths of at most max_depth nodes, in topological order (shorter first, then by rank);
    every path's parent must be a path too."""
    paths = sorted({tuple(c) for c in choices if len(c) <= max_depth}, key=lambda p: (len(p), p))
    known = set(paths)
    for p in paths:
        if not p or min(p) < 0:
            raise ValueError(f"medusa choices: {list(p)} is not a path of ranks >= 0 (e.g. [0, 1])")
        if len(p) > 1 and p[:-1] not in known:
            raise ValueError(f"medusa choices: path {list(p)} has no parent {list(p[:-1])} in the tree")
    if not paths:
        raise ValueError(f"medusa choices: no path of depth <= {max_depth} in {choices}")
    return paths


class MedusaProposer(Proposer):
    name = "medusa"
    mergeable = True

    def __init__(self, heads: MedusaHeads, choices: list[list[int]] | None = None, max_depth: int = 4) -> None:
        self.heads = heads
        paths = tree_from_choices(DEFAULT_CHOICES if choices is None else choices, min(max_depth, len(heads.blocks)))
        index = {p: i for i, p in enumerate(paths)}
        device = heads.linears()[0].weight.device
        self.parents = torch.tensor([index.get(p[:-1], -1) for p in paths], device=device)
        self.head_of = torch.tensor([len(p) - 1 for p in paths], device=device)  # depth d uses head d-1
        self.rank_of = torch.tensor([p[-1] for p in paths], device=device)
        self.depth = max(len(p) for p in paths)
        self.topk = max(p[-1] for p in paths) + 1
        check_ranks(self.topk, heads.linears()[0].out_features)
        self.max_tree_size = len(paths)
        self.sizes = [sum(len(p) <= d for p in paths) for d in range(self.depth + 1)]  # [d]: nodes of depth <= d
        self.hidden: Tensor | None = None  # the target's final hidden state at the last verified position

    def prefill(self, tokens: Tensor, start: int, out: ForwardOut) -> None:
        self.hidden = out.hidden[-1]

    def accept(self, tokens: Tensor, tree: DraftTree, path: list[int], out: ForwardOut) -> None:
        self.hidden = out.hidden[-1]

    def propose(self, tokens: Tensor, sp: SamplingParams, budget: int) -> DraftTree:
        """Top-k tokens of each head: a deterministic choice, so every node counts as one-hot when sampling.
        Paths are sorted shortest first, so the nodes within the budget's depth are a prefix of the tree."""
        depth = min(self.depth, budget)
        n = self.sizes[depth]
        assert self.hidden is not None, "a draft follows prefill()"
        logits = self.heads(self.hidden.to(self.heads.linears()[0].weight.dtype), depth)  # [depth, V]
        top = logits.topk(self.topk, dim=-1).indices  # [depth, topk]
        probs = torch.softmax(logits.float(), dim=-1).gather(-1, top)
        ranked = top if self.heads.vocab_ids is None else self.heads.vocab_ids[top]
        at = (self.head_of[:n], self.rank_of[:n])
        return DraftTree(ranked[at], self.parents[:n], accept_probs=probs[at])


def medusa_proposer(spec: SpecConfig, target: LoadedTarget) -> MedusaProposer:
    assert spec.num_tokens is not None, "serve/build.py resolves it"
    return MedusaProposer(cast(MedusaHeads, load_drafter(spec, target)), spec.choices, spec.num_tokens)


def check_ranks(topk: int, vocab: int) -> None:
    """A tree path of rank r takes a head's (r+1)-th most likely token: the heads need at least topk logits."""
    if topk > vocab:
        raise ValueError(
            f"the medusa tree uses ranks up to {topk - 1}, but the heads draft over {vocab} tokens; "
            f"set spec.draft_vocab >= {topk} (or 0 for the full vocabulary), or spec.choices with ranks below {vocab}"
        )
