"""Dynamic draft trees from top-k candidates (EAGLE-2's expand-and-rerank), shared by the EAGLE proposers and the
parallel drafters."""

from __future__ import annotations

import torch
from torch import Tensor

from draftsmith.serve.engine.tree import DraftTree, TreeConfig


def rerank(tree: DraftTree, scores: Tensor, keep: int) -> DraftTree:
    """Keep the `keep` best nodes by cumulative log-prob. A child never scores above its parent and comes
    later, so with ties broken by index a kept node's ancestors are kept too; index order stays topological."""
    if len(tree) <= keep:
        return tree
    return tree.subtree(torch.sort(scores, descending=True, stable=True).indices[:keep].sort().values)


def tree_size(tree: TreeConfig, depth: int, vocab: int) -> int:
    """The most nodes a draft of `depth` levels holds: topk children of the root and of each level's topk best
    nodes, capped at tree.total_tokens. Refused: a topk past the drafter's vocabulary."""
    k = tree.width
    if k > vocab:
        raise ValueError(f"spec.tree.topk={k} exceeds the drafter's vocabulary of {vocab}")
    drafted = k + (depth - 1) * k * k
    return min(tree.total_tokens or drafted, drafted)


def slot_tree(ids: Tensor, logp: Tensor, max_tree_size: int) -> DraftTree:
    """A parallel drafter's tree: ids, logp [depth, k] are each slot's k best tokens (one forward drafts every
    level); level d's candidates are expanded under the level above's k best nodes, then reranked. A node's accept
    probability is its slot's probability of its token."""
    k = ids.shape[1]
    toks, parents, cum, own, first = [ids[0]], [torch.full((k,), -1, device=ids.device)], [logp[0]], [logp[0]], 0
    for d in range(1, ids.shape[0]):
        best = cum[-1].topk(min(k, cum[-1].numel())).indices
        toks.append(ids[d].repeat(best.numel()))
        own.append(logp[d].repeat(best.numel()))
        parents.append((first + best).repeat_interleave(k))
        cum.append((cum[-1][best][:, None] + logp[d][None]).flatten())
        first += toks[-2].numel()
    tree = DraftTree(torch.cat(toks), torch.cat(parents), accept_probs=torch.cat(own).exp())
    return rerank(tree, torch.cat(cum), max_tree_size)
