"""The draft model's loss: T^2 KL(target || draft) of the next token."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from draftsmith.heads.draft_model import DraftModel
from draftsmith.train.batch import FeatureBatch
from draftsmith.train.losses import agreement, weighted_mean


def draft_model_loss(
    head: DraftModel, batch: FeatureBatch, temperature: float = 1.0
) -> tuple[Tensor, dict[str, float]]:
    """Draft model: T**2 * KL(target || draft) of the distributions of token t+1 at temperature T, weighted by
    loss_mask[t+1]. The target's logits are its lm_head on batch.hidden; the head holds that lm_head outside its
    module tree (heads/draft_model.py: not saved, not trained), so the target is not run again."""
    if not hasattr(head, "target_lm_head"):
        raise ValueError("draft_model_loss needs a head built with the target: DraftModel(cfg, target)")
    w = batch.loss_mask[:, 1:]
    sel = w > 0
    hidden, _ = head.hidden_states(batch.input_ids)
    log_q = F.log_softmax(head.lm_head(hidden[:, :-1][sel]).float() / temperature, dim=-1)
    with torch.no_grad():
        lm_head = head.target_lm_head
        log_p = F.log_softmax(lm_head(batch.hidden[:, :-1][sel].to(lm_head.weight.dtype)).float() / temperature, -1)
    kl = weighted_mean((log_p.exp() * (log_p - log_q)).sum(-1), w[sel])
    loss = temperature**2 * kl  # T**2 keeps the gradient scale comparable across temperatures (Hinton et al.)
    return loss, {"loss": loss.item(), "kl": kl.item(), "acc": agreement(log_q, log_p, w[sel])}
