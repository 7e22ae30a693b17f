"""DFlash's loss: blocks at anchors sampled from the loss-masked positions, soft CE per slot, weights decaying
with the slot's distance from the anchor.

The block of anchor a drafts the tokens a+1 .. a+B-1 (B = block_size): slot i's soft target is the target's
distribution of token a+i (its lm_head on hidden[a+i-1], restricted to the draft vocabulary), weighted by
loss_mask[a+i] * exp(-(i-1) / decay_gamma), as speculators' DFlash weights slot i. An anchor is an answer token
(loss_mask[a] = 1) with at least one position after it: the pending token drafting starts from is one too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from draftsmith.heads.dflash import DFlashHead

from .batch import FeatureBatch
from .losses import agreement, decay_weights, dpace_weights, sharpened, weighted_mean

SLOT_WEIGHTS = ("decay", "dpace")


def sample_anchors(loss_mask: Tensor, count: int) -> tuple[Tensor, Tensor]:
    """Up to `count` distinct anchors per row, drawn uniformly from the positions a >= 1 with loss_mask[a] > 0
    and a token after them (the global RNG: seeded, restored on resume). Returns anchors [b, A] and which of them
    are real [b, A] (a row with fewer candidates pads with weight-0 anchors)."""
    b, n = loss_mask.shape
    pos = torch.arange(n, device=loss_mask.device)
    ok = (loss_mask > 0) & (pos >= 1) & (pos < n - 1)
    scores = torch.rand(b, n, device=loss_mask.device).masked_fill(~ok, -1.0)
    top = scores.topk(min(count, n), dim=1)
    return top.indices, top.values >= 0


def dflash_loss(
    head: DFlashHead,
    batch: FeatureBatch,
    anchors: int = 64,
    decay_gamma: float = 4.0,
    target_temperature: float = 1.0,
    slot_weights: str = "decay",
    dpace_alpha: float = 0.5,
) -> tuple[Tensor, dict[str, float]]:
    """anchors: blocks per sequence; slot_weights: decay, slot i's weight exp(-(i-1) / decay_gamma), or dpace
    (losses.dpace_weights, smoothing dpace_alpha); target_temperature < 1 sharpens the target's distribution toward
    its top token, 0 is that token alone."""
    check_block_options(anchors, decay_gamma, target_temperature, slot_weights, dpace_alpha)
    if batch.aux is None:
        raise ValueError(f"dflash_loss needs batch.aux: the target's inputs to layers {head.target_layers}")
    ids, n, s = batch.input_ids, batch.input_ids.shape[1], head.config.block_size
    if n < 3:
        raise ValueError(f"DFlash needs sequences of >= 3 tokens (context, an anchor and a token after), got {n}")
    anchor, real = sample_anchors(batch.loss_mask, anchors)
    out = head.anchored(head.target_features(batch.hidden, batch.aux), ids, anchor)[:, :, 1:]  # [b, A, B-1, H]
    at, mask = slot_targets(batch, anchor, real, s - 1)  # [b, A, B-1]: slot i drafts token a+i
    sel = mask > 0
    target = sharpened(target_logits(head, batch, at, sel), target_temperature)
    logits = head.logits(out[sel]).float()
    ce = F.cross_entropy(logits, target, reduction="none")
    w = block_weights(ce, mask, sel, slot_weights, decay_gamma, dpace_alpha)
    loss = weighted_mean(ce, w[sel])
    slot = torch.arange(1, s, device=ids.device).expand_as(at)[sel]
    logs = {f"acc_{i}": agreement(logits[slot == i], target[slot == i], w[sel][slot == i]) for i in range(1, s)}
    return loss, {"loss": loss.item(), **logs}


def slot_targets(batch: FeatureBatch, anchor: Tensor, real: Tensor, slots: int) -> tuple[Tensor, Tensor]:
    """Where the tokens 1..slots after each anchor [b, A] sit (clamped into the sequence) and which of them count:
    at [b, A, slots], and their mask (loss_mask there, inside the sequence, of a real anchor)."""
    n = batch.loss_mask.shape[1]
    predicted = anchor[..., None] + torch.arange(1, slots + 1, device=anchor.device)
    at = predicted.clamp(max=n - 1)
    return at, batch.loss_mask.gather(1, at.flatten(1)).view_as(at) * (predicted < n) * real[..., None]


@torch.no_grad()
def target_logits(head: DFlashHead, batch: FeatureBatch, at: Tensor, sel: Tensor) -> Tensor:
    """The target's logits over the draft vocabulary of the selected tokens at positions at [.., slots] (its lm_head
    on hidden[at - 1]): [sel.sum(), draft vocab], float."""
    rows = head.target_lm_head.weight[head.vocab_ids]  # [draft vocab, H]: never the full vocabulary
    source = batch.hidden.gather(1, (at - 1).flatten(1)[..., None].expand(-1, -1, batch.hidden.shape[-1]))
    return (source.view(*at.shape, -1)[sel].to(rows.dtype) @ rows.T).float()


def check_block_options(anchors: int, decay_gamma: float, target_temperature: float, slots: str, alpha: float) -> None:
    """What DFlash's and DSpark's losses take."""
    if anchors < 1 or decay_gamma <= 0 or target_temperature < 0 or not 0 <= alpha <= 1:
        raise ValueError(
            f"head.loss options: anchors >= 1, decay_gamma > 0, target_temperature >= 0 and dpace_alpha in [0, 1], got "
            f"{anchors}, {decay_gamma}, {target_temperature} and {alpha}"
        )
    if slots not in SLOT_WEIGHTS:
        raise ValueError(f"head.loss.slot_weights must be one of {', '.join(SLOT_WEIGHTS)}, got {slots!r}")


def block_weights(ce: Tensor, mask: Tensor, sel: Tensor, slots: str, gamma: float, alpha: float) -> Tensor:
    """Per-slot weights [.., B] of a block loss: the mask times exp(-k / gamma) (decay) or D-PACE's weights from
    the selected slots' CE ce [sel.sum()] (dpace)."""
    if slots == "decay":
        return mask * decay_weights(mask.shape[-1], gamma, mask.device)
    full = torch.zeros_like(mask, dtype=ce.dtype)
    full[sel] = ce.detach()
    return dpace_weights(full, mask, alpha)
