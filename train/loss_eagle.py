"""EAGLE-1/2's loss: SmoothL1 on the next feature plus a weighted soft CE against the target's distribution."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from draftsmith.heads.eagle import EagleHead
from draftsmith.train.batch import FeatureBatch
from draftsmith.train.losses import agreement, weighted_mean


def eagle_loss(
    head: EagleHead, batch: FeatureBatch, ce_weight: float = 0.1, soft: bool = True
) -> tuple[Tensor, dict[str, float]]:
    """EAGLE-1: SmoothL1(predicted feature, target feature_{i+1}) + ce_weight * CE(target lm_head(prediction),
    the target's own distribution of token i+2 (soft) or token i+2 itself (soft=False))."""
    ids, hidden = batch.input_ids, batch.hidden
    n = ids.shape[1]
    if n < 3:
        raise ValueError(f"EAGLE needs sequences of >= 3 tokens (a pair and the token it predicts), got {n}")
    pred = head(hidden[:, : n - 2], ids[:, 1 : n - 1], torch.arange(1, n - 1, device=ids.device))
    w = batch.loss_mask[:, 2:].to(pred.dtype)
    sel = w > 0
    p, f, w = pred[sel], hidden[:, 1 : n - 1][sel].to(pred.dtype), w[sel]
    logits = head.logits(p).float()
    with torch.no_grad():
        target = F.softmax(head.logits(f).float(), dim=-1) if soft else ids[:, 2:][sel]
    l1 = weighted_mean(F.smooth_l1_loss(p, f, reduction="none").mean(-1), w)
    ce = weighted_mean(F.cross_entropy(logits, target, reduction="none"), w)
    loss = l1 + ce_weight * ce
    return loss, {"loss": loss.item(), "l1": l1.item(), "ce": ce.item(), "acc": agreement(logits, target, w)}
