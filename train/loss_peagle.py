"""P-EAGLE's loss (arXiv 2602.01469): soft CE against the target at every draft depth, over COD-sampled depths.

Depth 0 is every pair (feature_i, token_{i+1}): it predicts token i+2 as EAGLE-3's first step does. Depth d at
anchor a is the d-th mask slot after pair a: it predicts token a+2+d (soft target from hidden[a+1+d]), weighted by
loss_mask[a+2+d]. COD sampling keeps a shrinking share of the anchors per depth, max(ratio**d, ratio_min) of the
row's answer positions (speculators' defaults 0.7 and 0.2), each depth's anchors drawn from the previous depth's,
so every kept chain is whole. The loss is the mean over all kept elements (decay**d weights the depths; 1: the
pooled mean speculators takes). Soft CE differs from KL(target || draft) by the target's entropy only: the same
gradient.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from draftsmith.heads.peagle import PEagleHead

from .batch import FeatureBatch
from .losses import agreement, sharpened


def cod_anchors(loss_mask: Tensor, m: int, depths: int, ratio: float, ratio_min: float) -> list[Tensor]:
    """anchors[d-1] [b, s_d] (ascending) for depths 1..depths-1 of m pairs. s_d is the share of the answer tokens
    depth d can predict in the fullest row (never more than depth d-1 kept); a row takes its anchors among its
    depth-(d-1) anchors, those whose depth-d token is an answer token first, at random. Stops at a depth no row
    can train."""
    b, dev = loss_mask.shape[0], loss_mask.device
    w = F.pad(loss_mask, (0, depths + 2))
    member, keep, anchors = torch.ones(b, m, dtype=torch.bool, device=dev), m, []
    for d in range(1, depths):
        valid = w[:, 2 + d : 2 + d + m] > 0
        keep = min(keep, math.ceil(max(ratio**d, ratio_min) * int(valid.sum(1).max())))
        if keep == 0:
            break
        key = (torch.rand(b, m, device=dev) + 2 * (valid & member)).masked_fill(~member, -1.0)
        idx = key.topk(keep, dim=1).indices.sort(dim=1).values
        anchors.append(idx)
        member = torch.zeros_like(member).scatter_(1, idx, True)
    return anchors


def peagle_loss(
    head: PEagleHead,
    batch: FeatureBatch,
    ratio: float = 0.7,
    ratio_min: float = 0.2,
    decay: float = 1.0,
    target_temperature: float = 1.0,
) -> tuple[Tensor, dict[str, float]]:
    """Soft CE at depths 0..num_depths-1 (head.config.num_depths), COD-sampled; target_temperature as
    eagle3_loss's. Logs acc_d: top-1 agreement with the target per depth."""
    if not (0 < ratio <= 1 and 0 <= ratio_min <= 1):
        raise ValueError(f"head.loss.ratio must be in (0, 1] and ratio_min in [0, 1], got {ratio} and {ratio_min}")
    if target_temperature < 0:
        raise ValueError(
            f"head.loss.target_temperature must be >= 0 (0 = the target's top token), got {target_temperature}"
        )
    if batch.aux is None:
        raise ValueError(f"peagle_loss needs batch.aux: the target's inputs to layers {head.target_layers}")
    ids, depths = batch.input_ids, head.config.num_depths
    b, n = ids.shape
    if n < 3:
        raise ValueError(f"P-EAGLE needs sequences of >= 3 tokens (a pair and the token it predicts), got {n}")
    m = n - 1
    anchors = cod_anchors(batch.loss_mask, m, depths, ratio, ratio_min)
    outs = head.cod_forward(head.target_features(batch.hidden[:, :m], batch.aux[:, :m]), ids[:, 1:], anchors)
    rows = head.target_lm_head.weight[head.vocab_ids]  # [draft vocab, H]: never the full vocabulary
    mask = F.pad(batch.loss_mask.float(), (0, depths + 2))
    hidden = F.pad(batch.hidden, (0, 0, 0, depths + 2))
    batch_rows = torch.arange(b, device=ids.device)[:, None]
    total: Tensor | float = 0.0
    weight: Tensor | float = 0.0
    logs: dict[str, float] = {}
    for d, h in enumerate(outs):
        anchor = torch.arange(m, device=ids.device).expand(b, m) if d == 0 else anchors[d - 1]
        w = mask.gather(1, anchor + 2 + d)
        sel = w > 0
        logits = head.logits(h[sel]).float()
        with torch.no_grad():
            target = sharpened(
                (hidden[batch_rows, anchor + 1 + d][sel].to(rows.dtype) @ rows.T).float(), target_temperature
            )
        ce = F.cross_entropy(logits, target, reduction="none")
        total = total + decay**d * (ce * w[sel]).sum()
        weight = weight + w[sel].sum()
        logs[f"acc_{d}"] = agreement(logits, target, w[sel])
    assert isinstance(weight, Tensor), "at least one depth"
    loss = total / weight.clamp_min(1e-6)
    return loss, {"loss": loss.item(), **logs}
