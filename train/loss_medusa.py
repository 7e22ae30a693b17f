"""Medusa's loss: head k's CE on token t+k+2, weighted decay^k."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from draftsmith.heads.medusa import MedusaHeads
from draftsmith.train.batch import FeatureBatch
from draftsmith.train.losses import agreement, weighted_mean


def medusa_loss(head: MedusaHeads, batch: FeatureBatch, decay: float = 0.8) -> tuple[Tensor, dict[str, float]]:
    """Medusa-1: sum over heads k of decay**k * CE(head k(hidden[t]), token t+k+2), weighted by loss_mask[t+k+2]
    (the target's own lm_head covers token t+1)."""
    loss: Tensor | float = 0.0
    logs: dict[str, float] = {}
    for k in range(head.config.num_heads):
        shift = k + 2
        w = batch.loss_mask[:, shift:]
        sel = w > 0  # a head with no rows still joins the graph (zero grads), as DDP wants
        logits = head.head_logits(k, batch.hidden[:, :-shift][sel].to(head.linears()[k].weight.dtype)).float()
        labels = batch.input_ids[:, shift:][sel]
        ce = weighted_mean(F.cross_entropy(logits, labels, reduction="none"), w[sel])
        loss = loss + decay**k * ce
        logs[f"ce_{k}"], logs[f"acc_{k}"] = ce.item(), agreement(logits, labels, w[sel])
    assert isinstance(loss, Tensor), "at least one term"
    return loss, {"loss": loss.item(), **logs}
