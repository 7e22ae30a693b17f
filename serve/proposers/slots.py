"""The base of the parallel drafters' proposers: one head forward drafts every depth's logits at once."""

from __future__ import annotations

import torch
from torch import Tensor

from draftsmith.heads.dflash import DFlashHead
from draftsmith.heads.kv_cache import KVCache
from draftsmith.heads.peagle import PEagleHead
from draftsmith.serve.engine.sampling import SamplingParams, probs_from_logits, widen
from draftsmith.serve.engine.tree import DraftTree, TreeConfig
from draftsmith.serve.proposers.base import Proposer
from draftsmith.serve.proposers.topk_trees import slot_tree, tree_size


class SlotProposer(Proposer):
    """What the parallel drafters' proposers (P-EAGLE, DFlash) share: one head forward leaves `logits`
    [>= depth, draft vocab], row d-1 drafting depth d, and a draft is made from those rows alone."""

    head: PEagleHead | DFlashHead  # each subclass narrows it to its own

    def __init__(self, head: PEagleHead | DFlashHead, depth: int, tree: TreeConfig | None, generator) -> None:
        self.head, self.depth, self.tree, self.gen = head, depth, tree or TreeConfig(), generator
        self.target_layers = tuple(head.target_layers)
        self.vocab_ids = head.vocab_ids  # target id of each draft id
        self.max_tree_size = tree_size(self.tree, depth, head.lm_head.out_features)
        self.cache: KVCache | None = None
        self.logits: Tensor | None = None

    def draft_slots(self, sp: SamplingParams, budget: int) -> DraftTree:
        """Level d takes slot d's top-k under the level above's topk best nodes (by cumulative log-prob): a slot's
        distribution does not depend on the tokens drafted before it. topk=1 is a chain; a sampled chain draws
        depth d from slot d's distribution, which verification needs."""
        assert self.logits is not None, "a draft follows a forward"
        logits, k = self.logits[: min(self.depth, budget)], self.tree.width
        if k == 1 and not sp.greedy:
            p = probs_from_logits(logits, sp)
            ids = torch.multinomial(p, 1, generator=self.gen)
            draft = widen(p, self.vocab_ids, self.head.config.vocab_size)
            return DraftTree.chain(self.vocab_ids[ids[:, 0]], draft, p.gather(-1, ids)[:, 0])
        top = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)  # [depth, k]
        return slot_tree(self.vocab_ids[top.indices], top.values, self.max_tree_size)
