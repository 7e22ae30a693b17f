"""A model drafter plus a lookup drafter: n-gram prompt lookup (spec.ngram_tokens) or suffix decoding
(spec.suffix_tokens, serve/proposers/propose_suffix.py).

Small targets repeat themselves and their prompts (SmolLM2's MT-bench answers: n-gram tau ~3), which a
one-layer head trained on a few hundred thousand tokens rarely predicts, and the lookup costs nothing to
draft (Arctic Inference pairs suffix decoding with its speculators for the same reason). Two policies:
`prefer` (the default) verifies the lookup's draft alone when it finds one and the drafter's tree otherwise,
so a step pays for one of them, never both (a suffix draft counts as found when its score, the expected
accepted length by its counts, reaches the drafter's spec.num_tokens: ArcticInference's rule); `merge` puts the
lookup's draft into the drafter's tree (sharing the nodes where the draft repeats them), so the target keeps
whichever path it accepts and verification pays at most the draft's extra rows.

Only drafters that rebuild their state from the target's outputs after each step (EAGLE heads, Medusa) can
take a path through nodes they did not draft. Under `merge`, a sampled chain (topk 1, T > 0) carries draft
probabilities that a merged one-hot sibling would change, so there the drafter's own tree is used unchanged.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor

from draftsmith.runtime.kv_cache import SlotCache
from draftsmith.runtime.llama import ForwardOut
from draftsmith.serve.engine.sampling import SamplingParams
from draftsmith.serve.engine.tree import DraftTree
from draftsmith.serve.proposers.base import Proposer
from draftsmith.serve.proposers.propose_ngram import NgramProposer
from draftsmith.serve.proposers.propose_suffix import SuffixProposer

POLICIES = ("prefer", "merge")


class HybridProposer(Proposer):
    def __init__(self, drafter: Proposer, lookup: NgramProposer | SuffixProposer, policy: str = "prefer") -> None:
        if policy not in POLICIES:
            raise ValueError(f"spec.ngram_policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        if not drafter.mergeable:
            what = "n-gram lookup" if lookup.name == "ngram" else f"{lookup.name} decoding"
            raise ValueError(
                f"spec.{lookup.name}_tokens pairs {what} with drafters that rebuild their state from the target "
                f"(EAGLE heads, Medusa) only, not {drafter.name} (its cache follows its own chain); use "
                f"spec={lookup.name} alone or set spec.{lookup.name}_tokens=0"
            )
        self.drafter, self.lookup, self.policy = drafter, lookup, policy
        self.name = f"{drafter.name}_{lookup.name}"  # as its methods/ entry is named, e.g. eagle3_ngram
        self.target_layers = drafter.target_layers
        self.max_tree_size = drafter.max_tree_size + lookup.max_tree_size
        self.merged = 0  # proposals where the lookup found a draft

    @property
    def gen(self) -> torch.Generator | None:
        return self.drafter.gen

    @gen.setter
    def gen(self, g: torch.Generator | None) -> None:
        self.drafter.gen = g

    @property
    def slot_caches(self) -> list[SlotCache]:
        return self.drafter.slot_caches

    def reserve(self, max_len: int) -> None:
        self.drafter.reserve(max_len)

    def prefill(self, tokens: Tensor, start: int, out: ForwardOut) -> None:
        self.drafter.prefill(tokens, start, out)
        self.lookup.prefill(tokens, start, out)

    def accept(self, tokens: Tensor, tree: DraftTree, path: list[int], out: ForwardOut) -> None:
        if not self.drafter.benched:  # one sitting the request out is asked nothing in it: the next prefill resets it
            self.drafter.accept(tokens, tree, path, out)
        self.lookup.accept(tokens, tree, path, out)

    def parts(self) -> list[Proposer]:
        return [self.lookup, self.drafter]

    def forget(self) -> None:
        self.drafter.forget()
        self.lookup.forget()

    def set_client(self, client: str) -> None:
        self.drafter.set_client(client)
        self.lookup.set_client(client)

    def propose(self, tokens: Tensor, sp: SamplingParams, budget: int) -> DraftTree:
        found = self.lookup.propose(tokens, sp, budget)
        if self.policy == "prefer" and len(found):
            self.merged += 1
            return found
        tree = self.drafter.propose(tokens, sp, budget)
        if tree.draft_probs is not None or not len(found):
            return tree
        self.merged += 1
        return merge_tree(tree, found)


def merge_tree(tree: DraftTree, other: DraftTree) -> DraftTree:
    """The tree plus another from the same root: follow the tree while it holds the other's nodes, then append
    the rest as new nodes (after every old one, so the order stays topological)."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    kids = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens, strict=True))}  # (parent, token) -> node
    where: list[int] = []  # other's node i is merged node where[i]
    for t, p in zip(other.tokens.tolist(), other.parents.tolist(), strict=True):
        parent = -1 if p < 0 else where[p]
        child = kids.get((parent, t))
        if child is None:
            tokens.append(t)
            parents.append(parent)
            child = kids[(parent, t)] = len(tokens) - 1
        where.append(child)
    as_tensor = partial(torch.tensor, dtype=torch.long, device=tree.tokens.device)
    return DraftTree(as_tensor(tokens), as_tensor(parents))
