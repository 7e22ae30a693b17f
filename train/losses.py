"""Training losses, one per drafter kind (named by its registry record, heads/kinds.py):
loss(head, batch, **options) -> (loss, logs of floats).

Shifts: the target's hidden state at t is what its lm_head turns into the distribution of token t+1. An EAGLE
pair (feature_i, token_{i+1}) predicts feature_{i+1} and token_{i+2}, so its soft target comes from hidden[i+1]
and it is weighted by loss_mask[i+2], the mask of the token it predicts. Logits are computed only for rows
with weight: on a CPU the lm_head and its softmax dominate a step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from draftsmith.heads.draft_model import DraftModel
from draftsmith.heads.eagle import EagleHead
from draftsmith.heads.eagle3 import Eagle3Head
from draftsmith.heads.medusa import MedusaHeads

from .batch import FeatureBatch


def weighted_mean(x: Tensor, w: Tensor) -> Tensor:
    return (x * w).sum() / w.sum().clamp_min(1e-6)


def agreement(logits: Tensor, target: Tensor, w: Tensor) -> float:
    """Weighted top-1 agreement; target: ids [r] or a distribution [r, vocab]."""
    if not w.numel():
        return 0.0
    ids = target.argmax(-1) if target.dim() == 2 else target
    return weighted_mean((logits.argmax(-1) == ids).float(), w).item()


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


def eagle3_loss(
    head: Eagle3Head,
    batch: FeatureBatch,
    ttt_steps: int = 7,
    decay: float = 0.8,
    target_temperature: float = 1.0,
    mask_outside_vocab: bool = False,
    feature_noise: float = 0.0,
) -> tuple[Tensor, dict[str, float]]:
    """EAGLE-3: soft CE against the target's next-token distribution restricted to the draft vocabulary (the
    target lm_head's draft-token rows only), over ttt_steps steps of training-time test weighted decay**j.
    Step j at index i has seen pair i's real feature then j of its own outputs; it predicts token i+2+j
    (soft target from hidden[i+1+j]) and is weighted by loss_mask[i+2+j].
    target_temperature < 1 sharpens the target's distribution toward its top token (what greedy verification
    accepts); 0 trains on that token alone. mask_outside_vocab drops rows whose next token is outside the draft
    vocabulary, which the head can never draft (EAGLE-3 and SpecForge mask the target's argmax; the data's token
    is that argmax in greedy regenerated answers, and needs no full-vocabulary GEMM). feature_noise: uniform noise
    in [-a, a] on the target features the head reads (EAGLE's robustness to its own imprecise features)."""
    if target_temperature < 0:
        raise ValueError(
            f"head.loss.target_temperature must be >= 0 (0 = the target's top token), got {target_temperature}"
        )
    if batch.aux is None:
        raise ValueError(f"eagle3_loss needs batch.aux: the target's inputs to layers {head.target_layers}")
    ids, n = batch.input_ids, batch.input_ids.shape[1]
    if n < 3:
        raise ValueError(f"EAGLE needs sequences of >= 3 tokens (a pair and the token it predicts), got {n}")
    m = n - 1
    rows = head.target_lm_head.weight[head.vocab_ids]  # [draft vocab, H]: never the full vocabulary
    mask = F.pad(batch.loss_mask.float(), (0, ttt_steps))  # shifts past the end read weight 0
    if mask_outside_vocab:
        mask = mask * F.pad(head.t2d[ids].float(), (0, ttt_steps))
    hidden = F.pad(batch.hidden, (0, 0, 0, ttt_steps))
    with torch.no_grad():  # the target's distribution of every token 1.., computed once: step j reads it j later
        probs = sharpened((hidden[:, 1:].to(rows.dtype) @ rows.T).float(), target_temperature)
    aux = batch.aux[:, :m]
    if feature_noise:
        aux = aux + (torch.rand_like(aux) * 2 - 1) * feature_noise
    outs = head.unroll(head.target_features(batch.hidden[:, :m], aux), ids[:, 1:], ttt_steps)
    loss, logs = 0.0, {}
    for j, h in enumerate(outs):
        w = mask[:, 2 + j : 2 + j + m]
        sel = w > 0
        logits = head.logits(h[sel]).float()
        target = probs[:, j : j + m][sel]
        ce = weighted_mean(F.cross_entropy(logits, target, reduction="none"), w[sel])
        loss = loss + decay**j * ce
        logs[f"acc_{j}"] = agreement(logits, target, w[sel])
    return loss, {"loss": loss.item(), **logs}


def sharpened(logits: Tensor, temperature: float) -> Tensor:
    if temperature == 0:
        return F.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    return F.softmax(logits / temperature, dim=-1)


def medusa_loss(head: MedusaHeads, batch: FeatureBatch, decay: float = 0.8) -> tuple[Tensor, dict[str, float]]:
    """Medusa-1: sum over heads k of decay**k * CE(head k(hidden[t]), token t+k+2), weighted by loss_mask[t+k+2]
    (the target's own lm_head covers token t+1)."""
    loss, logs = 0.0, {}
    for k in range(head.config.num_heads):
        shift = k + 2
        w = batch.loss_mask[:, shift:]
        sel = w > 0  # a head with no rows still joins the graph (zero grads), as DDP wants
        logits = head.head_logits(k, batch.hidden[:, :-shift][sel].to(head.lm_heads[k].weight.dtype)).float()
        labels = batch.input_ids[:, shift:][sel]
        ce = weighted_mean(F.cross_entropy(logits, labels, reduction="none"), w[sel])
        loss = loss + decay**k * ce
        logs[f"ce_{k}"], logs[f"acc_{k}"] = ce.item(), agreement(logits, labels, w[sel])
    return loss, {"loss": loss.item(), **logs}


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
