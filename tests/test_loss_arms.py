"""EAGLE-3's loss objectives (head.loss.objective) on a tiny random target (fp32, CPU): soft CE keeps its bits,
kl_full is soft CE weighted by the target's mass on the draft vocabulary (and is soft CE where that vocabulary is
the whole one), the LK losses' acceptance term on hand-made distributions, the per-step acceptance every objective
logs, equal step weights at decay 1, and the refusals."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from draftsmith.serve.models.loader import load_model
from draftsmith.train import loss_eagle3
from draftsmith.train.loss_eagle3 import OBJECTIVES, acceptance, eagle3_loss, full_vocab_probs, objective_term
from draftsmith.train.losses import sharpened, weighted_mean
from draftsmith.train.trainer import check_loss_options
from helpers import eagle_head, head_features

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target(tiny_llama_dir):
    return load_model(tiny_llama_dir("llama"), torch.float32, "cpu")


def part_vocab_head(target, size: int, seed: int = 0):
    """An EAGLE-3 head over `size` of the target's ids, not its first ones."""
    head = eagle_head("eagle3", target, seed=seed, draft_vocab_size=size)
    head.set_vocab(torch.rand(target.config.vocab_size, generator=torch.Generator().manual_seed(seed)))
    return head


def random_batch(target, head, b: int = 2, n: int = 12, seed: int = 0, mask=None):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.config.vocab_size, (b, n), generator=g)
    return head_features(target, head, ids, torch.ones(b, n) if mask is None else mask)


def grads(head, loss) -> list[torch.Tensor]:
    params = [p for p in head.parameters() if p.requires_grad]
    return list(torch.autograd.grad(loss, params))


def loss_before_objectives(head, batch, ttt_steps=7, decay=0.8, target_temperature=1.0, mask_outside_vocab=False):
    """eagle3_loss as it was before it had objectives (soft CE only), kept to pin the default's bits."""
    ids, n = batch.input_ids, batch.input_ids.shape[1]
    m = n - 1
    rows = head.target_lm_head.weight[head.vocab_ids]
    mask = F.pad(batch.loss_mask.float(), (0, ttt_steps))
    if mask_outside_vocab:
        mask = mask * F.pad(head.t2d[ids].float(), (0, ttt_steps))
    hidden = F.pad(batch.hidden, (0, 0, 0, ttt_steps))
    with torch.no_grad():
        probs = sharpened((hidden[:, 1:].to(rows.dtype) @ rows.T).float(), target_temperature)
    outs = head.unroll(head.target_features(batch.hidden[:, :m], batch.aux[:, :m]), ids[:, 1:], ttt_steps)
    loss = 0.0
    for j, h in enumerate(outs):
        w = mask[:, 2 + j : 2 + j + m]
        sel = w > 0
        logits = head.logits(h[sel]).float()
        loss = loss + decay**j * weighted_mean(
            F.cross_entropy(logits, probs[:, j : j + m][sel], reduction="none"), w[sel]
        )
    return loss


@pytest.mark.parametrize(
    "options",
    [{}, {"objective": "soft_ce"}, {"target_temperature": 0.5, "decay": 1.0}, {"mask_outside_vocab": True}],
    ids=["defaults", "named", "sharpened-equal-steps", "masked"],
)
def test_soft_ce_keeps_its_bits(target, options):
    head = part_vocab_head(target, 64)
    batch = random_batch(target, head)
    old_options = {k: v for k, v in options.items() if k != "objective"}
    want = loss_before_objectives(head, batch, ttt_steps=3, **old_options)
    got, logs = eagle3_loss(head, batch, ttt_steps=3, **options)
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(grads(head, got), grads(head, want), strict=True))
    assert set(logs) == {"loss", *(f"{k}_{j}" for k in ("acc", "accept") for j in range(3))}


@pytest.mark.parametrize("temperature", [1.0, 0.5, 0.0])
def test_kl_full_is_soft_ce_where_the_draft_vocabulary_is_the_whole_one(target, temperature, monkeypatch):
    """With every target id drafted, the full distribution is the renormalised one: the same loss and acceptance,
    here with the vocabulary's softmax streamed over chunks that do not divide it."""
    monkeypatch.setattr(loss_eagle3, "FULL_VOCAB_CHUNK", 24)
    head = eagle_head("eagle3", target, draft_vocab_size=target.config.vocab_size)
    batch = random_batch(target, head)
    soft, soft_logs = eagle3_loss(head, batch, ttt_steps=2, target_temperature=temperature)
    full, full_logs = eagle3_loss(head, batch, ttt_steps=2, target_temperature=temperature, objective="kl_full")
    assert full.item() == pytest.approx(soft.item(), rel=1e-5)
    for j in range(2):
        assert full_logs[f"accept_full_{j}"] == pytest.approx(soft_logs[f"accept_{j}"], abs=1e-5)


def test_full_vocab_probs_are_the_targets_softmax_read_at_the_draft_ids(target, monkeypatch):
    monkeypatch.setattr(loss_eagle3, "FULL_VOCAB_CHUNK", 40)
    head = part_vocab_head(target, 48)
    hidden = random_batch(target, head).hidden.flatten(0, 1)
    logits = hidden @ target.lm_head.weight.T
    for t in (1.0, 0.7):
        want = torch.softmax(logits / t, dim=-1)[:, head.vocab_ids]
        assert torch.allclose(full_vocab_probs(hidden, target.lm_head.weight, head.vocab_ids, t), want, atol=1e-6)
    top = full_vocab_probs(hidden, target.lm_head.weight, head.vocab_ids, 0.0)
    inside = head.t2d[logits.argmax(-1)]
    assert torch.equal(top.sum(-1), inside.float())  # a one-hot where the top token is drafted, else nothing
    assert torch.equal(head.vocab_ids[top[inside].argmax(-1)], logits.argmax(-1)[inside])


def test_kl_full_is_soft_ce_weighted_by_the_targets_mass_on_the_draft_vocabulary(target, monkeypatch):
    """Per row -sum p log q = mass(D) * soft CE, so kl_full under a loss mask is soft CE under that mask times each
    row's mass, rescaled by the masks' sums: loss and gradients both."""
    monkeypatch.setattr(loss_eagle3, "FULL_VOCAB_CHUNK", 40)
    head = part_vocab_head(target, 48)
    mask = torch.rand(2, 12, generator=torch.Generator().manual_seed(3)) * (torch.arange(12) >= 3)
    batch = random_batch(target, head, mask=mask)
    with torch.no_grad():  # the target's mass on the draft ids, by the plain full softmax; token t reads hidden t-1
        mass = torch.softmax(batch.hidden @ target.lm_head.weight.T, dim=-1)[..., head.vocab_ids].sum(-1)
    assert 0.2 < mass.min() and mass.max() < 0.8  # a part of the vocabulary: the weighting is visible
    weighted = mask * F.pad(mass[:, :-1], (1, 0))
    scale = weighted[:, 2:].sum() / mask[:, 2:].sum()
    full, _ = eagle3_loss(head, batch, ttt_steps=1, objective="kl_full")
    soft, _ = eagle3_loss(head, replace(batch, loss_mask=weighted), ttt_steps=1)
    assert full.item() == pytest.approx((soft * scale).item(), rel=1e-5)
    for a, b in zip(grads(head, full), grads(head, soft * scale), strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-7)


def target_logits(vocab: int = 10, rows: int = 3, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2


def hand_made(vocab: int = 10, drafted=(0, 2, 3, 7), rows: int = 3, seed: int = 0):
    """Target logits over `vocab` ids, the draft vocabulary `drafted`: p_D (renormalised over it) and p (the full
    distribution read at it)."""
    z = target_logits(vocab, rows, seed)
    ids = torch.tensor(drafted)
    return torch.softmax(z[:, ids], dim=-1), torch.softmax(z, dim=-1)[:, ids]


def term_and_grad(objective, logits, target, full, w, **options):
    logits = logits.clone().requires_grad_(True)
    term, logs = objective_term(objective, logits, target, full, w, **options)
    (grad,) = torch.autograd.grad(term, logits)
    return term.item(), grad, logs


def test_kl_full_is_least_where_the_draft_is_the_renormalised_target():
    p_d, p = hand_made()
    w = torch.tensor([1.0, 2.0, 0.5])
    best, grad, logs = term_and_grad("kl_full", p_d.log(), p_d, p, w)
    assert grad.abs().max() < 1e-6
    mass = p.sum(-1)
    entropy = -(p_d * p_d.log()).sum(-1)
    assert best == pytest.approx(weighted_mean(mass * entropy, w).item(), rel=1e-6)
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        worse, grad, _ = term_and_grad("kl_full", p_d.log() + 0.3 * torch.randn(p_d.shape, generator=g), p_d, p, w)
        assert worse > best and grad.abs().max() > 1e-3
    assert logs["accept_full"] == pytest.approx(weighted_mean(mass, w).item(), rel=1e-6)  # q >= p: all of p's


def test_lk_acceptance_term_by_hand():
    """p = (.5, .3, .2), q = (.2, .5, .3): sum min = .2 + .3 + .2 = .7, so 1 - alpha = .3 and -log alpha = -log .7;
    a second row with q = p accepts all, and weights 1 and 3 average the rows."""
    p = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]])
    q = torch.tensor([[0.2, 0.5, 0.3], [0.1, 0.6, 0.3]])
    w = torch.tensor([1.0, 3.0])
    assert torch.allclose(acceptance(p, q), torch.tensor([0.7, 1.0]))
    alpha = (0.7 + 3 * 1.0) / 4
    tv, _, logs = term_and_grad("lk", q.log(), p, p, w, lk_kl_scale=0.0)
    assert tv == pytest.approx(0.3 / 4, abs=1e-6) and logs == pytest.approx({"lam": 0.0, "accept_full": alpha})
    nll, _, _ = term_and_grad("lk_alpha", q.log(), p, p, w)
    assert nll == pytest.approx(-math.log(0.7) / 4, rel=1e-6)
    ce = -(p * q.log()).sum(-1)
    lam = math.exp(-3.0 * alpha)  # the defaults: scale 1, decay 3
    hybrid, grad, logs = term_and_grad("lk", q.log(), p, p, w)
    assert logs["lam"] == pytest.approx(lam, rel=1e-6)
    assert hybrid == pytest.approx(lam * (ce[0] + 3 * ce[1]).item() / 4 + (1 - lam) * 0.3 / 4, rel=1e-6)
    _, ce_grad, _ = term_and_grad("soft_ce", q.log(), p, None, w)
    _, tv_grad, _ = term_and_grad("lk", q.log(), p, p, w, lk_kl_scale=0.0)
    assert torch.allclose(grad, lam * ce_grad + (1 - lam) * tv_grad, atol=1e-7)  # no gradient through lam


@pytest.mark.parametrize("objective", ["lk", "lk_alpha"])
def test_lk_is_least_where_the_draft_is_the_target(objective):
    """Where the draft vocabulary is the whole one, q = p accepts everything: the acceptance term is 0, the
    gradient vanishes and any other q does worse. Over a part of it, q = p_D reaches the floor 1 - mass(D) (what
    lies outside is never accepted), and no q gets under it."""
    p_d, p = hand_made(drafted=range(10))
    w = torch.tensor([1.0, 2.0, 0.5])
    # the draft's logits are the target's own, so q = p_D to the bit: min(p, q) ties everywhere and its gradient
    # splits evenly (softmax(log p_D) rounds differently from p_D by CPU, which leaves a kink's one-sided gradient)
    best, grad, logs = term_and_grad(objective, target_logits(), p_d, p, w, lk_kl_scale=0.5)
    assert logs["accept_full"] == pytest.approx(1.0, abs=1e-6) and grad.abs().max() < 1e-6
    lam = 0.5 * math.exp(-3.0)  # scale 0.5, the default decay 3, full acceptance
    floor = lam * weighted_mean(-(p_d * p_d.log()).sum(-1), w).item() if objective == "lk" else 0.0
    assert best == pytest.approx(floor, abs=1e-6)  # lk: lam * entropy, the part of the CE no q removes
    g = torch.Generator().manual_seed(2)
    for _ in range(5):
        other = p_d.log() + 0.5 * torch.randn(p_d.shape, generator=g)
        assert term_and_grad(objective, other, p_d, p, w, lk_kl_scale=0.5)[0] > best
    p_d, p = hand_made()
    mass = weighted_mean(p.sum(-1), w).item()
    assert term_and_grad("lk", p_d.log(), p_d, p, w, lk_kl_scale=0.0)[0] == pytest.approx(1 - mass, abs=1e-6)
    for _ in range(5):
        q = torch.softmax(torch.randn(p_d.shape, generator=g) * 2, dim=-1)
        assert term_and_grad("lk", q.log(), p_d, p, w, lk_kl_scale=0.0)[0] >= 1 - mass - 1e-6


def test_every_objective_logs_the_expected_acceptance_per_step(target):
    """accept_j, against the renormalised target, is one measure whatever the objective; accept_full_j, the true
    one, can only be lower, by at most the target's mass outside the draft vocabulary."""
    head = part_vocab_head(target, 48)
    batch = random_batch(target, head)
    logs = {o: eagle3_loss(head, batch, ttt_steps=3, objective=o)[1] for o in OBJECTIVES}
    for j in range(3):
        accepts = {o: logs[o][f"accept_{j}"] for o in OBJECTIVES}
        assert len(set(accepts.values())) == 1 and 0 < accepts["soft_ce"] < 1, accepts
        for o in ("kl_full", "lk", "lk_alpha"):
            assert 0 < logs[o][f"accept_full_{j}"] < accepts[o]
    assert all(f"lam_{j}" in logs["lk"] for j in range(3)) and "accept_full_0" not in logs["soft_ce"]


@pytest.mark.parametrize("objective", ["lk", "lk_alpha"])
def test_lk_training_raises_the_expected_acceptance(target, objective):
    """Over the whole vocabulary (over a part, the tiny target's mass outside it caps acceptance at once)."""
    head = eagle_head("eagle3", target, draft_vocab_size=target.config.vocab_size)
    batch = random_batch(target, head, b=4, n=24, seed=1)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    seen = []
    for _ in range(20):
        loss, logs = eagle3_loss(head, batch, ttt_steps=1, objective=objective)
        opt.zero_grad()
        loss.backward()
        opt.step()
        seen.append(logs["accept_full_0"])
    assert seen[-1] > seen[0] + 0.15, seen


def test_decay_weighs_step_j_by_its_power_and_one_weighs_them_alike(target):
    head = part_vocab_head(target, 64)
    batch = random_batch(target, head)

    def at(decay, steps):
        return eagle3_loss(head, batch, ttt_steps=steps, decay=decay)[0].item()

    step = [at(1.0, 1), at(1.0, 2) - at(1.0, 1), at(1.0, 3) - at(1.0, 2)]  # each step's term, weight 1
    assert min(step) > 0
    for decay in (1.0, 0.8, 0.5):
        assert at(decay, 3) == pytest.approx(step[0] + decay * step[1] + decay**2 * step[2], rel=1e-5)


def test_unknown_objective_and_lk_weights_are_refused(target):
    head = part_vocab_head(target, 48)
    batch = random_batch(target, head)
    with pytest.raises(ValueError, match="must be one of soft_ce, kl_full, lk, lk_alpha, got 'kl'"):
        eagle3_loss(head, batch, ttt_steps=1, objective="kl")
    with pytest.raises(ValueError, match="lk_kl_scale must be in"):
        eagle3_loss(head, batch, ttt_steps=1, objective="lk", lk_kl_scale=1.5)
    with pytest.raises(ValueError, match="lk_kl_decay >= 0"):
        eagle3_loss(head, batch, ttt_steps=1, objective="lk", lk_kl_decay=-1.0)
    check_loss_options(eagle3_loss, {"objective": "lk", "lk_kl_scale": 1.0, "lk_kl_decay": 1.0}, "eagle3")
