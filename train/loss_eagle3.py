"""EAGLE-3's loss: soft CE against the target's distribution over the draft vocabulary, the training-time test
unrolled ttt_steps steps, step j weighted decay^j."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from draftsmith.heads.eagle3 import Eagle3Head
from draftsmith.train.batch import FeatureBatch
from draftsmith.train.losses import agreement, sharpened, weighted_mean


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
    loss: Tensor | float = 0.0
    logs: dict[str, float] = {}
    for j, h in enumerate(outs):
        w = mask[:, 2 + j : 2 + j + m]
        sel = w > 0
        logits = head.logits(h[sel]).float()
        target = probs[:, j : j + m][sel]
        ce = weighted_mean(F.cross_entropy(logits, target, reduction="none"), w[sel])
        loss = loss + decay**j * ce
        logs[f"acc_{j}"] = agreement(logits, target, w[sel])
    assert isinstance(loss, Tensor), "at least one term"
    return loss, {"loss": loss.item(), **logs}
