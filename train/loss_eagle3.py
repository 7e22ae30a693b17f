"""EAGLE-3's loss: the training-time test unrolled ttt_steps steps, step j weighted decay^j, each step's term one of
OBJECTIVES: soft CE against the target's distribution over the draft vocabulary (the default), CE against the
target's full-vocabulary distribution (kl_full), or an LK loss, which aims at the expected acceptance itself."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from draftsmith.heads.eagle3 import Eagle3Head
from draftsmith.train.batch import FeatureBatch
from draftsmith.train.losses import agreement, sharpened, weighted_mean

OBJECTIVES = ("soft_ce", "kl_full", "lk", "lk_alpha")
FULL_VOCAB_CHUNK = 8192  # target vocabulary rows per GEMM of the full-vocabulary softmax (fp32 rows x this at a time)


def eagle3_loss(
    head: Eagle3Head,
    batch: FeatureBatch,
    ttt_steps: int = 7,
    decay: float = 0.8,
    target_temperature: float = 1.0,
    mask_outside_vocab: bool = False,
    feature_noise: float = 0.0,
    objective: str = "soft_ce",
    lk_kl_scale: float = 1.0,
    lk_kl_decay: float = 3.0,
) -> tuple[Tensor, dict[str, float]]:
    """EAGLE-3 over ttt_steps steps of training-time test weighted decay**j (1.0: equal weights), each step's term
    the objective's (objective_term). Step j at index i has seen pair i's real feature then j of its own outputs;
    it predicts token i+2+j (soft target from hidden[i+1+j]) and is weighted by loss_mask[i+2+j].
    target_temperature < 1 sharpens the target's distribution toward its top token (what greedy verification
    accepts); 0 trains on that token alone. mask_outside_vocab drops rows whose next token is outside the draft
    vocabulary, which the head can never draft (EAGLE-3 and SpecForge mask the target's argmax; the data's token
    is that argmax in greedy regenerated answers, and needs no full-vocabulary GEMM). feature_noise: uniform noise
    in [-a, a] on the target features the head reads (EAGLE's robustness to its own imprecise features).
    objective: soft_ce (the target lm_head's draft-vocabulary rows only), or kl_full, lk, lk_alpha, which read the
    target's full-vocabulary distribution: one full-vocabulary GEMM per row, without gradient, FULL_VOCAB_CHUNK
    target rows at a time. lk_kl_scale, lk_kl_decay: lk's KL weight (objective_term).
    Logs per step: acc_j, top-1 agreement with the target over the draft vocabulary; accept_j, the expected
    acceptance sum_x min(p_D(x), q(x)) against the target renormalised over the draft vocabulary (the same measure in
    every objective; above the true one by at most the target's mass outside the draft vocabulary); and where the
    objective reads the full distribution, accept_full_j, the true expected acceptance of sampling verification."""
    if objective not in OBJECTIVES:
        raise ValueError(f"head.loss.objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    if not 0 <= lk_kl_scale <= 1 or lk_kl_decay < 0:
        raise ValueError(
            f"head.loss.lk_kl_scale must be in [0, 1] and lk_kl_decay >= 0, got {lk_kl_scale} and {lk_kl_decay}"
        )
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
    full: Tensor | None = None
    with torch.no_grad():  # the target's distribution of every token 1.., computed once: step j reads it j later
        probs = sharpened((hidden[:, 1:].to(rows.dtype) @ rows.T).float(), target_temperature)
        if objective != "soft_ce":  # only the rows some step reads with weight: row r is weighted by mask[r + 2]
            need = F.pad(mask[:, 2:] > 0, (0, 1))
            full = torch.zeros_like(probs)
            full[need] = full_vocab_probs(
                hidden[:, 1:][need], head.target_lm_head.weight, head.vocab_ids, target_temperature
            )
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
        on_full = None if full is None else full[:, j : j + m][sel]
        term, step_logs = objective_term(objective, logits, target, on_full, w[sel], lk_kl_scale, lk_kl_decay)
        loss = loss + decay**j * term
        logs[f"acc_{j}"] = agreement(logits, target, w[sel])
        with torch.no_grad():
            logs[f"accept_{j}"] = weighted_mean(acceptance(target, logits.softmax(-1)), w[sel]).item()
        logs.update({f"{k}_{j}": v for k, v in step_logs.items()})
    assert isinstance(loss, Tensor), "at least one term"
    return loss, {"loss": loss.item(), **logs}


def objective_term(
    objective: str,
    logits: Tensor,
    target: Tensor,
    full: Tensor | None,
    w: Tensor,
    lk_kl_scale: float = 1.0,
    lk_kl_decay: float = 3.0,
) -> tuple[Tensor, dict[str, float]]:
    """One step's term over its weighted rows, and what it logs. logits [r, D]: the head's over the draft vocabulary
    D, q = their softmax; target [r, D]: p_D, the target's distribution renormalised over D; full [r, D]: p, the
    target's full-vocabulary distribution read at D (rows sum to the target's mass on D, <= 1; None for soft_ce);
    w [r]: the rows' weights (means below are weighted by w).
    - soft_ce: mean of -sum_x p_D(x) log q(x) (EAGLE-3's and SpecForge's CE over the draft vocabulary).
    - kl_full: mean of -sum_x p(x) log q(x): KL(p || q) up to a constant, the target's mass outside D being
      unreachable; each row's soft CE scaled by the target's mass on D.
    - lk: LK losses (Samarin et al., "LK Losses: Direct Acceptance Rate Optimization for Speculative Decoding",
      arXiv 2602.23881), their hybrid L_LK^lambda as the authors implemented it in SpecForge (core/lk_loss.py,
      lk_loss_type=lambda): with alpha = sum_x min(p(x), q(x)) per row, the expected acceptance of sampling
      verification, and abar its mean, lam = lk_kl_scale * exp(-lk_kl_decay * abar) (no gradient through lam), the
      term is lam * soft_ce + (1 - lam) * mean(1 - alpha): the KL leads while acceptance is low, the total variation
      1 - alpha as it rises. lk_kl_decay 3.0: the paper's best hybrid setting, the authors' default in that pull
      request (SpecForge's config now defaults to 1.0). speculators' lk_hybrid_loss differs: lam per row, and alpha
      against p_D. Logs lam.
    - lk_alpha: LK's L_LK^alpha, mean of -log alpha (a row with alpha = 0 counts 0, as in SpecForge).
    The objectives that read p log accept_full, the mean alpha."""
    if objective == "soft_ce":
        return weighted_mean(F.cross_entropy(logits, target, reduction="none"), w), {}
    if full is None:
        raise ValueError(f"objective {objective} reads the target's full-vocabulary distribution: pass full")
    logs: dict[str, float] = {}
    if objective == "kl_full":
        term = weighted_mean(-(full * F.log_softmax(logits, dim=-1)).sum(-1), w)
    else:
        alpha = acceptance(full, logits.softmax(-1))
        if objective == "lk":
            lam = lk_kl_scale * torch.exp(-lk_kl_decay * weighted_mean(alpha, w).detach())
            ce = weighted_mean(F.cross_entropy(logits, target, reduction="none"), w)
            term = lam * ce + (1 - lam) * weighted_mean(1 - alpha, w)
            logs["lam"] = lam.item()
        else:  # lk_alpha
            term = weighted_mean(-torch.log(torch.where(alpha > 0, alpha, torch.ones_like(alpha))), w)
    with torch.no_grad():
        logs["accept_full"] = weighted_mean(acceptance(full, logits.softmax(-1)), w).item()
    return term, logs


def acceptance(p: Tensor, q: Tensor) -> Tensor:
    """Per row, sum_x min(p(x), q(x)): the chance that sampling verification against p accepts a token drawn from
    q (1 - TV(p, q) where both sum to 1)."""
    return torch.minimum(p, q).sum(-1)


def full_vocab_probs(hidden: Tensor, weight: Tensor, vocab_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """hidden [r, H] -> [r, D]: the target's full-vocabulary distribution (softmax over every row of its lm_head
    `weight` [V, H], sharpened as losses.sharpened: T = 0 is its top token) read at the draft vocabulary's target ids
    vocab_ids [D]; a row sums to the target's mass on them. One full-vocabulary GEMM per row, without gradient,
    FULL_VOCAB_CHUNK target rows at a time (a running logsumexp, or argmax at T = 0)."""
    with torch.no_grad():
        h = hidden.to(weight.dtype)
        r, vocab = h.shape[0], weight.shape[0]
        draft = torch.empty(r, vocab_ids.numel(), device=h.device)
        lse = torch.full((r,), float("-inf"), device=h.device)
        top_val = torch.full((r,), float("-inf"), device=h.device)
        top = torch.zeros(r, dtype=torch.long, device=h.device)
        for start in range(0, vocab, FULL_VOCAB_CHUNK):
            z = (h @ weight[start : start + FULL_VOCAB_CHUNK].T).float()
            inside = (vocab_ids >= start) & (vocab_ids < start + z.shape[1])
            draft[:, inside] = z[:, vocab_ids[inside] - start]
            if temperature == 0:
                val, idx = z.max(-1)
                better = val > top_val  # strictly: ties keep the lower id, as argmax
                top_val, top = torch.where(better, val, top_val), torch.where(better, idx + start, top)
            else:
                lse = torch.logaddexp(lse, torch.logsumexp(z / temperature, dim=-1))
        if temperature == 0:
            return (vocab_ids[None, :] == top[:, None]).float()
        return torch.exp(draft / temperature - lse[:, None])
