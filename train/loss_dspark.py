"""DSpark's loss (arXiv 2607.05147, DeepSpec's dspark/loss.py): blocks at random answer anchors as DFlash's, every
slot a draft, the sequential head teacher-forced on the true previous tokens.

Slot k of anchor a drafts token a+k+1. Its distribution is the backbone's logits plus the Markov bias of token
a+k; the target's is its lm_head on hidden[a+k] over the draft vocabulary. Per slot (weights exp(-k / gamma), or
D-PACE's):
- ce_weight x soft CE against the target's distribution (DeepSpec: hard CE on the data's token; the target's
  own distribution holds that token and what it nearly chose, at no extra cost here);
- tv_weight x total variation 1/2 |q - p|, DeepSpec's L1 term (defaults 0.1 and 0.9 are DeepSpec's);
- confidence_weight x BCE of the confidence head against the slot's acceptance. DeepSpec's target is the
  sampling acceptance rate 1 - TV (`confidence_target=overlap`). The default here is the greedy one,
  1[argmax q = argmax p] (`greedy`), because this engine decodes greedy by default and 1 - TV understates
  greedy acceptance (both 50% sure of the same token: overlap 0.5, greedy acceptance 1). Its weights always
  decay, as speculators keeps them (D-PACE reads a token CE).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from draftsmith.heads.dspark import DSparkHead

from .batch import FeatureBatch
from .loss_dflash import block_weights, check_block_options, sample_anchors, slot_targets, target_logits
from .losses import agreement, decay_weights, sharpened, weighted_mean

CONFIDENCE_TARGETS = ("greedy", "overlap")


def dspark_loss(
    head: DSparkHead,
    batch: FeatureBatch,
    anchors: int = 64,
    decay_gamma: float = 4.0,
    target_temperature: float = 1.0,
    slot_weights: str = "decay",
    dpace_alpha: float = 0.5,
    ce_weight: float = 0.1,
    tv_weight: float = 0.9,
    confidence_weight: float = 1.0,
    confidence_target: str = "greedy",
) -> tuple[Tensor, dict[str, float]]:
    """Options as dflash_loss's, plus the three terms' weights and what the confidence head learns."""
    check_block_options(anchors, decay_gamma, target_temperature, slot_weights, dpace_alpha)
    if min(ce_weight, tv_weight, confidence_weight) < 0 or ce_weight + tv_weight <= 0:
        raise ValueError(
            f"head.loss weights must be >= 0 with ce_weight + tv_weight > 0, got ce {ce_weight}, tv {tv_weight}, "
            f"confidence {confidence_weight}"
        )
    if confidence_target not in CONFIDENCE_TARGETS:
        raise ValueError(f"head.loss.confidence_target must be one of {', '.join(CONFIDENCE_TARGETS)}")
    if batch.aux is None:
        raise ValueError(f"dspark_loss needs batch.aux: the target's inputs to layers {head.target_layers}")
    ids, n, s = batch.input_ids, batch.input_ids.shape[1], head.config.block_size
    if n < 3:
        raise ValueError(f"DSpark needs sequences of >= 3 tokens (context, an anchor and a token after), got {n}")
    anchor, real = sample_anchors(batch.loss_mask, anchors)
    out = head.anchored(head.target_features(batch.hidden, batch.aux), ids, anchor)  # [b, A, B, H]
    at, mask = slot_targets(batch, anchor, real, s)  # [b, A, B]: slot k drafts token a+k+1
    sel = mask > 0
    prev = ids.gather(1, (at - 1).flatten(1)).view_as(at)  # the true token before each slot
    logits, conf = head.teacher_forced(out, prev)
    logits, conf = logits[sel].float(), conf[sel]
    with torch.no_grad():
        scores = target_logits(head, batch, at, sel)
        target, p = sharpened(scores, target_temperature), F.softmax(scores, dim=-1)
    ce = F.cross_entropy(logits, target, reduction="none")
    tv = 0.5 * (F.softmax(logits, dim=-1) - p).abs().sum(-1)
    with torch.no_grad():
        accepted = (logits.argmax(-1) == p.argmax(-1)).float() if confidence_target == "greedy" else 1 - tv
    bce = F.binary_cross_entropy_with_logits(conf, accepted.clamp(0, 1), reduction="none")
    w = block_weights(ce, mask, sel, slot_weights, decay_gamma, dpace_alpha)[sel]
    wc = (mask * decay_weights(s, decay_gamma, mask.device))[sel]
    fit = ce_weight * weighted_mean(ce, w) + tv_weight * weighted_mean(tv, w)
    loss = fit + confidence_weight * weighted_mean(bce, wc)
    slot = torch.arange(1, s + 1, device=ids.device).expand_as(at)[sel]  # draft position: slot k drafts position k+1
    logs = {f"acc_{i}": agreement(logits[slot == i], target[slot == i], w[slot == i]) for i in range(1, s + 1)}
    with torch.no_grad():
        logs["conf_err"] = weighted_mean((torch.sigmoid(conf) - accepted).abs(), wc).item()
        logs["tv"] = weighted_mean(tv, w).item()
    return loss, {"loss": loss.item(), **logs}
