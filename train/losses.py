"""What the kinds' losses share (each kind's loss is train/loss_<kind>.py, named by its registry record, heads/kinds.py:
loss(head, batch, **options) -> (loss, logs of floats)).

Shifts: the target's hidden state at t is what its lm_head turns into the distribution of token t+1. An EAGLE
pair (feature_i, token_{i+1}) predicts feature_{i+1} and token_{i+2}, so its soft target comes from hidden[i+1]
and it is weighted by loss_mask[i+2], the mask of the token it predicts. Logits are computed only for rows
with weight: on a CPU the lm_head and its softmax dominate a step.
"""

from __future__ import annotations

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
