"""A model drafter plus n-gram prompt lookup.

Small targets repeat themselves and their prompts (SmolLM2's MT-bench answers: n-gram tau ~3), which a
one-layer head trained on a few hundred thousand tokens rarely predicts, and the lookup costs nothing to
draft (Arctic Inference pairs suffix decoding with its speculators for the same reason). Two policies:
`prefer` (the default) verifies the lookup's chain alone when it finds one and the drafter's tree otherwise,
so a step pays for one of them, never both; `merge` puts the lookup's chain into the drafter's tree (sharing
the nodes where the chain repeats them), so the target keeps whichever path it accepts and verification pays
at most the chain's extra rows.

Only drafters that rebuild their state from the target's outputs after each step (EAGLE heads, Medusa) can
take a path through nodes they did not draft. Under `merge`, a sampled chain (topk 1, T > 0) carries draft
probabilities that a merged one-hot sibling would change, so there the drafter's own tree is used unchanged.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor

from draftsmith.heads.kv_cache import KVCache
from draftsmith.heads.llama import ForwardOut

from .ngram import NgramProposer
from .proposer import Proposer
from .sampling import SamplingParams
from .tree import DraftTree

POLICIES = ("prefer", "merge")


class HybridProposer(Proposer):
    def __init__(self, drafter: Proposer, ngram: NgramProposer, policy: str = "prefer") -> None:
        if policy not in POLICIES:
            raise ValueError(f"spec.ngram_policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        if not drafter.mergeable:
            raise ValueError(
                "spec.ngram_tokens pairs n-gram lookup with drafters that rebuild their state from the target "
                f"(EAGLE heads, Medusa) only, not {drafter.name} (its cache follows its own chain); use spec=ngram "
                "alone or set spec.ngram_tokens=0"
            )
        self.drafter, self.ngram, self.policy = drafter, ngram, policy
        self.name = f"{drafter.name}+ngram"
        self.aux_layers = drafter.aux_layers
        self.max_tree_size = drafter.max_tree_size + ngram.max_tree_size
        self.merged = 0  # proposals where the lookup found a chain

    @property
    def gen(self) -> torch.Generator | None:
        return self.drafter.gen

    @gen.setter
    def gen(self, g: torch.Generator | None) -> None:
        self.drafter.gen = g

    @property
    def kv_caches(self) -> list[KVCache]:
        return self.drafter.kv_caches

    def reserve(self, max_len: int) -> None:
        self.drafter.reserve(max_len)

    def prefill(self, tokens: Tensor, start: int, target: ForwardOut) -> None:
        self.drafter.prefill(tokens, start, target)

    def accept(self, tokens: Tensor, tree: DraftTree, path: list[int], target: ForwardOut) -> None:
        self.drafter.accept(tokens, tree, path, target)

    def propose(self, tokens: Tensor, sp: SamplingParams, budget: int) -> DraftTree:
        chain = self.ngram.propose(tokens, sp, budget)
        if self.policy == "prefer" and len(chain):
            self.merged += 1
            return chain
        tree = self.drafter.propose(tokens, sp, budget)
        if tree.draft_probs is not None or not len(chain):
            return tree
        self.merged += 1
        return merge_chain(tree, chain.tokens)


def merge_chain(tree: DraftTree, chain: Tensor) -> DraftTree:
    """The tree plus a chain from the root: follow the tree while it holds the chain's tokens, then append the
    rest as new nodes (after every old one, so the order stays topological)."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    kids = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens, strict=True))}  # (parent, token) -> node
    node = -1
    for t in chain.tolist():
        child = kids.get((node, t))
        if child is None:
            tokens.append(t)
            parents.append(node)
            child = len(tokens) - 1
            kids[(node, t)] = child
        node = child
    as_tensor = partial(torch.tensor, dtype=torch.long, device=tree.tokens.device)
    return DraftTree(as_tensor(tokens), as_tensor(parents))
