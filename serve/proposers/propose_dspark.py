"""DSpark proposer: DFlash's block forward (propose_dflash.py: context cache, prefix cache, scratch block), then
the sequential head walks the block left to right, each token biased by the one drafted before it.

The block [pending token, mask x (B-1)] leaves each slot's normed output h_k and base logits; slot k drafts the
token after the pending one's k-th successor. A chain: x_k = argmax(base_k + bias(x_{k-1}, h_k)) (sampled: drawn
from that distribution, which verification is told); each token's confidence sigmoid(conf(h_k, W1[x_{k-1}])) goes
to the engine as the node's accept_probs, for spec.verify=cost. A tree (topk > 1): each level expands its topk
best nodes (cumulative log-prob) into their topk children under their own bias, then the best
tree.total_tokens nodes are kept, as EAGLE-2's; a tree node's accept estimate is its draft probability (the
confidence head judges a slot's top token, not its runners-up).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import Tensor

from draftsmith.heads.dflash import DFlashHead
from draftsmith.heads.dspark import DSparkHead
from draftsmith.serve.drafters import load_drafter
from draftsmith.serve.engine.sampling import SamplingParams, probs_from_logits, widen
from draftsmith.serve.engine.tree import DraftTree
from draftsmith.serve.models.target import LoadedTarget
from draftsmith.serve.proposers.propose_dflash import DFlashProposer
from draftsmith.serve.proposers.topk_trees import rerank
from draftsmith.serve.spec import SpecConfig


class DSparkProposer(DFlashProposer):
    head: DSparkHead
    name = "dspark"
    hidden: Tensor | None = None  # [B, H]: the block's normed outputs, h_k

    @staticmethod
    def block_drafts(head: DFlashHead) -> int:
        """Anchor-first: every slot drafts, the pending token's the first token."""
        return head.config.block_size

    def draft_block(self, pending: Tensor) -> None:
        assert self.cache is not None, "reserve() comes first"
        out = self.head.draft(self.head.block_tokens(pending), self.cached, self.cache)
        self.hidden = self.head.normed(out)
        self.logits = self.head.base_logits(self.hidden).float()

    def draft(self, tokens: Tensor, sp: SamplingParams, budget: int) -> DraftTree:
        depth = min(self.depth, budget)
        if self.tree.width == 1:
            return self.chain(tokens[-1], depth, sp)
        return self.topk_tree(tokens[-1], depth)

    def slot(self, k: int, prev: Tensor, state: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None]:
        """Slot k after token prev: (corrected logits [V], W1[prev] [r], the rnn state after it)."""
        assert self.logits is not None and self.hidden is not None, "a draft follows a forward"
        markov = self.head.markov_head
        e = markov.embed(prev)
        bias, state = markov.step(e, self.hidden[k], state)
        return self.logits[k] + bias.float(), e, state

    def chain(self, pending: Tensor, depth: int, sp: SamplingParams) -> DraftTree:
        assert self.hidden is not None, "a draft follows a forward"
        ids, rows, embeds = [], [], []
        prev, state = pending, None
        for k in range(depth):
            logits, e, state = self.slot(k, prev, state)
            embeds.append(e)
            if sp.greedy:
                d = logits.argmax()
            else:
                p = probs_from_logits(logits[None], sp)[0]
                rows.append(p)
                d = torch.multinomial(p, 1, generator=self.gen)[0]
            prev = self.vocab_ids[d]
            ids.append(prev)
        if not ids:
            return DraftTree.empty(pending.device)
        probs = widen(torch.stack(rows), self.vocab_ids, self.head.config.vocab_size) if rows else None
        confidence = torch.sigmoid(self.head.confidence(self.hidden[:depth], torch.stack(embeds)))
        return DraftTree.chain(torch.stack(ids), probs, confidence)

    def topk_tree(self, pending: Tensor, depth: int) -> DraftTree:
        """EAGLE-2's expand-and-rerank with each node's children under its own Markov bias."""
        k = self.tree.width
        frontier: list[tuple[int, Tensor, Tensor | None, float]] = [(-1, pending, None, 0.0)]
        toks: list[Tensor] = []
        parents: list[int] = []
        cum: list[float] = []
        own: list[float] = []  # each node's probability under its parent's distribution: its accept estimate
        for d in range(depth):
            children = []
            for node, prev, state, score in frontier:
                logits, _, after = self.slot(d, prev, state)
                top = torch.log_softmax(logits, dim=-1).topk(k)
                for logp, i in zip(top.values.tolist(), top.indices, strict=True):
                    children.append((len(toks), self.vocab_ids[i], after, score + logp))
                    toks.append(self.vocab_ids[i])
                    parents.append(node)
                    cum.append(score + logp)
                    own.append(logp)
            frontier = sorted(children, key=lambda c: -c[3])[:k]
        if not toks:
            return DraftTree.empty(pending.device)
        dev = pending.device
        own_p = torch.tensor(own, device=dev).exp()
        tree = DraftTree(torch.stack(toks), torch.tensor(parents, device=dev), None, own_p)
        return rerank(tree, torch.tensor(cum, device=dev), self.max_tree_size)


def dspark_proposer(spec: SpecConfig, target: LoadedTarget) -> DSparkProposer:
    """spec=dspark: the head borrows the target's embedding; num_tokens and tree come resolved (serve/build.py)."""
    assert spec.num_tokens is not None, "serve/build.py resolves it"
    return DSparkProposer(cast(DSparkHead, load_drafter(spec, target, target.model)), spec.num_tokens, spec.tree)
