"""The adaptation trainer's judgment: an offline acceptance estimate on held-back captured requests, the same for a
candidate head and the live one. The head is unrolled teacher-forced on the real tokens (as its loss unrolls it);
from each answer position, the run of consecutive depths j = 0..D-1 at which the target's top-1 token (its lm_head
on its own hidden state) is among the head's top-k drafts is what a chain (k = 1) or a tree of k children per node
would get accepted there; tau_offline = 1 + the mean run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from draftsmith.train.batch import FeatureBatch


@dataclass
class Shape:
    """The draft judged: depth D (the folder's draft num_tokens) and children per node k (its topk, 1: a chain)."""

    depth: int
    topk: int

    @classmethod
    def of(cls, draft: dict) -> Shape:
        return cls(max(1, int(draft.get("num_tokens") or 1)), max(1, int(draft.get("topk") or 1)))


def run_lengths(hits: Tensor) -> Tensor:
    """hits [..., D] bool -> [...] the number of leading True values (a draft is accepted up to its first miss)."""
    return hits.long().cumprod(-1).sum(-1)


def offline_tau(runs: Tensor, starts: Tensor) -> float:
    """1 + the mean run over the positions drafting starts from (starts: bool, runs' shape)."""
    if not bool(starts.any()):
        return 1.0
    return 1.0 + runs[starts].float().mean().item()


def target_top1(head: Any, hidden: Tensor) -> Tensor:
    """[b, n] the target's greedy token after each position: its lm_head (borrowed by the head) on hidden."""
    lm_head: torch.nn.Linear = head.target_lm_head if hasattr(head, "target_lm_head") else head.lm_head
    return (hidden.to(lm_head.weight.dtype) @ lm_head.weight.T).argmax(-1)


def drafted(head: Any, batch: FeatureBatch, depth: int) -> list[Tensor]:
    """Per depth j, the head's outputs [b, m, H] at each pair i (m = n - 1), teacher-forced: an EAGLE-3 head
    unrolled (train-time test); a head without unroll (EAGLE-1/2) is judged at depth 1 only."""
    m = batch.input_ids.shape[1] - 1
    feature = head.target_features(batch.hidden[:, :m], None if batch.aux is None else batch.aux[:, :m])
    if hasattr(head, "unroll"):
        return head.unroll(feature, batch.input_ids[:, 1:], depth)
    return [head(feature, batch.input_ids[:, 1:], torch.arange(1, m + 1, device=feature.device))]


def draft_topk(head: Any, out: Tensor, k: int) -> Tensor:
    """[b, m, k] target ids of the head's k likeliest next tokens (a draft vocabulary mapped to target ids)."""
    logits = head.logits(out)
    top = logits.topk(min(k, logits.shape[-1]), dim=-1).indices
    vocab_ids = getattr(head, "vocab_ids", None)
    return vocab_ids[top] if vocab_ids is not None else top


def position_runs(head: Any, batch: FeatureBatch, shape: Shape) -> tuple[Tensor, Tensor]:
    """(runs [b, m], starts [b, m]): from pair i the draft's depth j predicts token i+2+j, which greedy
    verification accepts when it is the target's top-1 from hidden[i+1+j] and an answer token (loss_mask)."""
    b, n = batch.input_ids.shape
    m = n - 1
    top1 = target_top1(head, batch.hidden)
    outs = drafted(head, batch, shape.depth)
    mask = torch.nn.functional.pad(batch.loss_mask > 0, (0, len(outs) + 1))
    hits = []
    for j, out in enumerate(outs):
        want = torch.nn.functional.pad(top1, (0, j + 1))[:, 1 + j : 1 + j + m]
        found = (draft_topk(head, out, shape.topk) == want[..., None]).any(-1)
        hits.append(found & mask[:, 2 + j : 2 + j + m])
    return run_lengths(torch.stack(hits, -1)), mask[:, 2 : 2 + m]


@torch.no_grad()
def judge(head: Any, batches: list[FeatureBatch], shape: Shape) -> float:
    """tau_offline of `head` over the held-back batches (every answer position weighs the same)."""
    was_training = head.training
    head.eval()
    runs, starts = [], []
    for batch in batches:
        r, s = position_runs(head, batch, shape)
        runs.append(r.flatten())
        starts.append(s.flatten())
    head.train(was_training)
    if not runs:
        return 1.0
    return offline_tau(torch.cat(runs), torch.cat(starts))
