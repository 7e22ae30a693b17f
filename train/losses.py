"""What the kinds' losses share (each kind's loss is train/loss_<kind>.py, named by its registry record, heads/kinds.py:
loss(head, batch, **options) -> (loss, logs of floats)).

Shifts: the target's hidden state at t is what its lm_head turns into the distribution of token t+1. An EAGLE
pair (feature_i, token_{i+1}) predicts feature_{i+1} and token_{i+2}, so its soft target comes from hidden[i+1]
and it is weighted by loss_mask[i+2], the mask of the token it predicts. Logits are computed only for rows
with weight: on a CPU the lm_head and its softmax dominate a step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def weighted_mean(x: Tensor, w: Tensor) -> Tensor:
    return (x * w).sum() / w.sum().clamp_min(1e-6)


def agreement(logits: Tensor, labels: Tensor, w: Tensor) -> float:
    """Weighted top-1 agreement; target: ids [r] or a distribution [r, vocab]."""
    if not w.numel():
        return 0.0
    ids = labels.argmax(-1) if labels.dim() == 2 else labels
    return weighted_mean((logits.argmax(-1) == ids).float(), w).item()


def sharpened(logits: Tensor, temperature: float) -> Tensor:
    if temperature == 0:
        return F.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    return F.softmax(logits / temperature, dim=-1)


def decay_weights(slots: int, gamma: float, device) -> Tensor:
    """Slot k's weight exp(-k / gamma), k = 0 for a block's first draft (DFlash's and DSpark's default)."""
    return torch.exp(-torch.arange(slots, device=device) / gamma)


def dpace_weights(ce: Tensor, mask: Tensor, alpha: float) -> Tensor:
    """D-PACE (arXiv 2605.18810, speculators' DFlash default) slot weights [.., B] from each slot's CE [.., B]:
    slot k weighs the expected accepted drafts it enables, sum_{j >= k} prod_{l <= j} ((1 - alpha) q_l + alpha)
    with q = exp(-CE) the draft's confidence in the target, so slots behind a likely rejection count less.
    Masked slots count as certain (a factor of 1) and get weight 0. No gradient flows through the weights."""
    with torch.no_grad():
        m = mask.to(ce.dtype)
        smooth = torch.where(m > 0, (1 - alpha) * torch.exp(-ce) + alpha, torch.ones_like(ce))
        prefix = torch.cumprod(smooth, dim=-1) * m
        return prefix.flip(-1).cumsum(-1).flip(-1) * m
