"""The base of the parallel drafters' proposers: one head forward drafts every depth's logits at once.

The target's outputs for the tokens each step verified wait for the next draft: a step the draft policy
(serve/engine/policy.py) leaves plain costs the head nothing, and the tokens it skipped are taken in by one forward
(or once base.BACKLOG of them pile up)."""

from __future__ import annotations

import torch
from torch import Tensor

from draftsmith.heads.dflash import DFlashHead
from draftsmith.heads.peagle import PEagleHead
from draftsmith.runtime.kv_cache import KVCache
from draftsmith.runtime.llama import ForwardOut
from draftsmith.serve.engine.sampling import SamplingParams, probs_from_logits, widen
from draftsmith.serve.engine.tree import DraftTree, TreeConfig
from draftsmith.serve.proposers import base
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
        self.known = 0  # tokens the engine holds (the last one pending)
        self.waiting: list[ForwardOut] = []  # the target's outputs for verified tokens, not yet taken in
        self.drafted_for = 0  # tokens the logits were drafted after

    def prefill(self, tokens: Tensor, start: int, out: ForwardOut) -> None:
        """Slots [0, start) came from the prefix cache; out covers tokens [start, n-1)."""
        self.begin(start)
        self.waiting, self.known, self.drafted_for = [out], tokens.numel(), 0  # the last request's logits are stale
        self.catch_up(tokens)

    def accept(self, tokens: Tensor, tree: DraftTree, path: list[int], out: ForwardOut) -> None:
        self.waiting.append(out)
        self.known = tokens.numel()
        if sum(o.hidden.shape[0] for o in self.waiting) > base.BACKLOG:
            self.take_waiting()

    def propose(self, tokens: Tensor, sp: SamplingParams, budget: int) -> DraftTree:
        if tokens.numel() != self.known:
            raise RuntimeError(f"the drafter holds {self.known} tokens, the engine passed {tokens.numel()}")
        self.catch_up(tokens)
        return self.draft(tokens, sp, budget)

    def catch_up(self, tokens: Tensor) -> None:
        """The waiting outputs taken in, then the forward that drafts after the pending token (once per step)."""
        self.take_waiting()
        if self.drafted_for != tokens.numel():
            self.forward(tokens)
            self.drafted_for = tokens.numel()

    def take_waiting(self) -> None:
        if self.waiting:
            outs, self.waiting = self.waiting, []
            self.take_in(ForwardOut(outs[-1].logits, *base.joined([(o.hidden, o.aux) for o in outs])))

    def begin(self, start: int) -> None:
        """A new sequence whose first `start` slots came from the prefix cache."""
        raise NotImplementedError

    def take_in(self, out: ForwardOut) -> None:
        """The target's outputs for the next tokens the drafter has not taken in."""
        raise NotImplementedError

    def forward(self, tokens: Tensor) -> None:
        """The head's forward after tokens (every output taken in): the logits a draft is made from."""
        raise NotImplementedError

    def draft(self, tokens: Tensor, sp: SamplingParams, budget: int) -> DraftTree:
        return self.draft_slots(sp, budget)

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
