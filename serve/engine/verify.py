"""Verification of a draft tree against the target's logits: lossless by construction.

Row 0 of `logits` is the root (the pending token), row i+1 is tree node i.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from draftsmith.serve.engine.sampling import SamplingParams, probs_from_logits, sample
from draftsmith.serve.engine.tree import DraftTree


@dataclass
class Verdict:
    path: list[int]  # accepted node indices, root to leaf
    next_token: int  # the target's own token after the path: a correction, or the bonus token


def verify(tree: DraftTree, logits: Tensor, sp: SamplingParams, gen: torch.Generator | None) -> Verdict:
    if sp.greedy:
        return verify_greedy(tree, logits)
    return verify_sampling(tree, probs_from_logits(logits, sp), gen)


def verify_greedy(tree: DraftTree, logits: Tensor) -> Verdict:
    """Follow the target's argmax down the tree for as long as a child drafted it."""
    target = logits.argmax(-1).tolist()
    if not len(tree):
        return Verdict([], target[0])
    tokens, kids = tree.tokens.tolist(), tree.children()
    path: list[int] = []
    row = 0
    while True:
        match = next((c for c in kids[row] if tokens[c] == target[row]), None)
        if match is None:
            return Verdict(path, target[row])
        path.append(match)
        row = match + 1


def verify_sampling(tree: DraftTree, probs: Tensor, gen: torch.Generator | None) -> Verdict:
    """Recursive rejection sampling over each node's children (SpecInfer / EAGLE multi-candidate).

    q: target prob, p: draft prob of the child's token. A child is accepted with min(1, q/p);
    on rejection q becomes norm(max(q - p, 0)) and the next sibling is tried; when all fail the
    token comes from the residual q. Each child's p is the distribution it was drawn from given
    its earlier siblings, so the emitted token is distributed exactly as q.
    """
    tokens, kids = tree.tokens.tolist(), tree.children()
    path: list[int] = []
    row = 0
    while True:
        q = probs[row]
        accepted = None
        for c in kids[row]:
            x = tokens[c]
            p = None if tree.draft_probs is None else tree.draft_probs[c]
            px = 1.0 if p is None else float(p[x])
            if px > 0 and uniform(gen, q.device) * px < float(q[x]):
                accepted = c
                break
            q = residual(q, x, p)
        if accepted is None:
            return Verdict(path, sample(q, gen))
        path.append(accepted)
        row = accepted + 1


def uniform(gen: torch.Generator | None, device: torch.device) -> float:
    """One U[0, 1) draw, made on the generator's device: the engine's lives on the model's (a CUDA generator
    cannot draw a CPU tensor)."""
    return float(torch.rand((), generator=gen, device=gen.device if gen is not None else device))


def residual(q: Tensor, x: int, p: Tensor | None) -> Tensor:
    """norm(max(q - p, 0)); p None means one-hot at x."""
    if p is None:
        r = q.clone()
        r[x] = 0.0
    else:
        r = (q - p).clamp_min(0.0)
    total = r.sum()
    return q if total <= 0 else r / total
