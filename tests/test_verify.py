"""Verification: greedy on hand-made logits, the sampling transform, and a statistical test that
rejection sampling over chains and trees is lossless (with negative controls that show the test bites)."""

from __future__ import annotations

import math

import pytest
import torch

from draftsmith.serve.engine import verify as verify_mod
from draftsmith.serve.engine.sampling import SamplingParams, pick, probs_from_logits
from draftsmith.serve.engine.tree import DraftTree
from draftsmith.serve.engine.verify import Verdict, residual, verify, verify_greedy, verify_sampling
from helpers import DEVICES

pytestmark = pytest.mark.usefixtures("one_thread")


def onehot_logits(targets: list[int], vocab: int = 8) -> torch.Tensor:
    """Row r has its argmax at targets[r]."""
    logits = torch.zeros(len(targets), vocab)
    logits[torch.arange(len(targets)), torch.tensor(targets)] = 5.0
    return logits


# ---------------------------------------------------------------- greedy


def test_greedy_full_acceptance_gives_bonus():
    tree = DraftTree.chain(torch.tensor([3, 4, 5]))
    v = verify_greedy(tree, onehot_logits([3, 4, 5, 6]))
    assert v == Verdict([0, 1, 2], 6)


def test_greedy_first_mismatch_gives_correction():
    tree = DraftTree.chain(torch.tensor([3, 4, 5]))
    assert verify_greedy(tree, onehot_logits([3, 7, 5, 6])) == Verdict([0], 7)
    assert verify_greedy(tree, onehot_logits([1, 4, 5, 6])) == Verdict([], 1)


def test_greedy_branching_tree_follows_the_matching_branch():
    # root -> n0 (3) -> n2 (5)
    #      -> n1 (4) -> n3 (6) -> n4 (7)
    tree = DraftTree(torch.tensor([3, 4, 5, 6, 7]), torch.tensor([-1, -1, 0, 1, 3]))
    # rows: root, n0, n1, n2, n3, n4. Row n0 "wants" 5 (its child n2) but n0 is not on the path.
    logits = onehot_logits([4, 5, 6, 0, 2, 1])
    assert verify_greedy(tree, logits) == Verdict([1, 3], 2)
    logits = onehot_logits([4, 5, 6, 0, 7, 1])
    assert verify_greedy(tree, logits) == Verdict([1, 3, 4], 1)
    logits = onehot_logits([3, 5, 6, 0, 7, 1])
    assert verify_greedy(tree, logits) == Verdict([0, 2], 0)


def test_greedy_picks_second_sibling_when_first_misses():
    tree = DraftTree(torch.tensor([2, 3, 4]), torch.tensor([-1, -1, -1]))
    assert verify_greedy(tree, onehot_logits([4, 0, 0, 1])) == Verdict([2], 1)


def test_greedy_empty_tree_is_argmax_of_row_0():
    logits = torch.tensor([[0.1, 2.0, -1.0, 0.5]])
    assert verify_greedy(DraftTree.empty(), logits) == Verdict([], 1)
    assert verify(DraftTree.empty(), logits, SamplingParams(), None) == Verdict([], 1)


def test_verify_dispatches_on_temperature():
    tree = DraftTree.chain(torch.tensor([3]))
    logits = onehot_logits([3, 6]) * 100  # sampling at temperature 1 is then effectively greedy
    assert verify(tree, logits, SamplingParams(), None) == Verdict([0], 6)
    gen = torch.Generator().manual_seed(0)
    assert verify(tree, logits, SamplingParams(temperature=1.0), gen) == Verdict([0], 6)


# ---------------------------------------------------------------- sampling params and transform


def test_sampling_params_validation():
    for bad in (dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_p=-0.2), dict(top_k=-1)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
    assert SamplingParams().greedy and not SamplingParams(temperature=0.5).greedy
    SamplingParams(temperature=2.0, top_p=1.0, top_k=0)  # the edges are allowed


def test_temperature():
    logits = torch.tensor([1.0, 2.0, 3.0])
    probs = probs_from_logits(logits, SamplingParams(temperature=2.0))
    e = torch.tensor([math.exp(0.5), math.exp(1.0), math.exp(1.5)])
    assert torch.allclose(probs, e / e.sum(), atol=1e-6)


def test_top_k():
    logits = torch.tensor([1.0, 3.0, 2.0, 0.0])
    probs = probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    e3, e2 = math.exp(3.0), math.exp(2.0)
    assert torch.allclose(probs, torch.tensor([0.0, e3 / (e3 + e2), e2 / (e3 + e2), 0.0]), atol=1e-6)
    full = probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=99))  # k > vocab: no-op
    assert torch.allclose(full, torch.softmax(logits, -1), atol=1e-6)


def test_top_p_keeps_the_smallest_set_reaching_p():
    base = torch.tensor([0.15, 0.5, 0.05, 0.3])  # sorted: 0.5, 0.3, 0.15, 0.05
    logits = base.log()
    p07 = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert torch.allclose(p07, torch.tensor([0.0, 0.5, 0.0, 0.3]) / 0.8, atol=1e-6)
    p09 = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.9))
    assert torch.allclose(p09, torch.tensor([0.15, 0.5, 0.0, 0.3]) / 0.95, atol=1e-6)
    p01 = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.1))  # top token alone
    assert torch.allclose(p01, torch.tensor([0.0, 1.0, 0.0, 0.0]), atol=1e-6)


def test_temperature_top_k_top_p_together_and_batched():
    logits = torch.tensor([[2.0, 0.0, 4.0, 1.0, 3.0], [0.0, 0.0, 0.0, 0.0, 8.0]])
    sp = SamplingParams(temperature=2.0, top_k=3, top_p=0.6)
    probs = probs_from_logits(logits, sp)
    # row 0: /2 -> [1, 0, 2, .5, 1.5]; top-3 keeps 2, 1.5, 1 -> softmax; top-p 0.6 keeps the first two
    e = torch.tensor([math.exp(2.0), math.exp(1.5), math.exp(1.0)])
    s = e / e.sum()  # [0.506, 0.307, 0.186]: 0.506 < 0.6, 0.506 + 0.307 reaches it
    row0 = torch.zeros(5)
    row0[2], row0[4] = s[0] / (s[0] + s[1]), s[1] / (s[0] + s[1])
    assert torch.allclose(probs[0], row0, atol=1e-6)
    assert torch.allclose(probs[1], torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0]), atol=1e-6)  # 8/2=4 nats: > 0.6


def test_pick():
    logits = torch.tensor([0.0, 3.0, 1.0])
    assert pick(logits, SamplingParams(), None) == 1
    gen = torch.Generator().manual_seed(0)
    draws = [pick(torch.tensor([0.0, 0.0, -1e9]), SamplingParams(temperature=1.0), gen) for _ in range(200)]
    assert set(draws) == {0, 1}


def test_residual():
    q = torch.tensor([0.5, 0.3, 0.2])
    assert torch.allclose(residual(q, 0, None), torch.tensor([0.0, 0.6, 0.4]))
    p = torch.tensor([0.2, 0.6, 0.2])
    assert torch.allclose(residual(q, 1, p), torch.tensor([1.0, 0.0, 0.0]))
    assert torch.equal(residual(q, 1, q.clone()), q)  # q == p: nothing left over, q unchanged


# ---------------------------------------------------------------- losslessness, statistically
#
# A Markov "language": the target's next-token distribution depends on the previous token only,
# q(. | prev) = Q[prev] (hand-made logits, temperature 0.8, top-k 5: one token per row is impossible),
# and a deliberately different draft p(. | prev) = P[prev] that does put mass on those impossible tokens.
# A tree row's target distribution is Q[the token at that row] (the root's is Q[ROOT]).

V, ROOT = 6, 0
A = torch.tensor(
    [
        [1.0, 0.2, -0.5, 0.8, 0.0, -1.0],
        [0.3, 1.2, 0.1, -0.4, 0.6, -0.9],
        [-0.2, 0.5, 1.1, 0.0, -0.8, 0.4],
        [0.7, -0.6, 0.2, 0.9, 0.1, -0.3],
        [0.0, 0.4, -0.7, 0.3, 1.0, 0.2],
        [0.5, -0.1, 0.6, -0.9, 0.2, 0.8],
    ]
)
B = torch.tensor(
    [
        [-0.5, 1.0, 0.3, -0.2, 0.9, 0.6],
        [0.8, -0.3, 0.9, 0.5, -0.6, 0.7],
        [0.9, 0.0, -0.4, 0.6, 0.5, -0.2],
        [-0.3, 0.8, 0.4, -0.5, 0.7, 0.6],
        [0.6, -0.2, 0.9, 0.1, -0.5, 0.3],
        [-0.4, 0.7, -0.1, 0.8, 0.3, -0.6],
    ]
)
Q = probs_from_logits(A, SamplingParams(temperature=0.8, top_k=5)).double()
P = torch.softmax(B.double(), -1)
PARENTS = {
    "chain": torch.tensor([-1, 0, 1]),  # 3 tokens, each drawn from p given the previous
    "tree": torch.tensor([-1, -1, -1, 0, 0, 1, 1, 2, 2]),  # 3 siblings, then 2 under each, without replacement
    "onehot": torch.tensor([-1, -1, 0, 1]),  # deterministic: p's top 2, then each one's top 1; draft_probs None
    "onehot_rows": torch.tensor([-1, -1, 0, 1]),  # the same tree with explicit one-hot draft_probs rows
}
ALPHA = 1e-4  # false-alarm probability per statistic for a correct verifier


def without_replacement(probs: torch.Tensor, k: int, gen: torch.Generator) -> torch.Tensor:
    """[N, V] -> [N, k]: ordered draws without replacement (Gumbel-top-k, equal in law to drawing one at a
    time from probs with the earlier draws removed and the rest renormalised)."""
    u = torch.rand(probs.shape, generator=gen, dtype=torch.float64).clamp_min(1e-300)
    return (probs.log() - (-u.log()).log()).argsort(-1, descending=True)[:, :k]


def sibling_rows(probs: torch.Tensor, drawn: torch.Tensor) -> torch.Tensor:
    """[N, V], [N, k] -> [N, k, V]: the distribution sibling j was drawn from (earlier siblings removed)."""
    rows, p = [], probs.clone()
    for j in range(drawn.shape[1]):
        rows.append(p / p.sum(-1, keepdim=True))
        p = p.scatter(1, drawn[:, j : j + 1], 0.0)
    return torch.stack(rows, 1)


def sample_trees(kind: str, ctx: torch.Tensor, gen: torch.Generator, draft: torch.Tensor = P, renormalise: bool = True):
    """Trees for N contexts at once: tokens [N, n] and draft_probs [N, n, V] (or None); draft[prev] is p(. | prev)."""
    P = draft  # noqa: N806
    if kind == "chain":
        toks, rows, prev = [], [], ctx
        for _ in range(3):
            rows.append(P[prev])
            prev = torch.multinomial(P[prev], 1, generator=gen)[:, 0]
            toks.append(prev)
        return torch.stack(toks, 1), torch.stack(rows, 1)
    if kind == "tree":
        top = without_replacement(P[ctx], 3, gen)
        toks, rows = [top], [sibling_rows(P[ctx], top)]
        for j in range(3):
            kids = without_replacement(P[top[:, j]], 2, gen)
            toks.append(kids)
            rows.append(sibling_rows(P[top[:, j]], kids))
        rows = torch.cat(rows, 1)
        if not renormalise:  # a broken builder: every sibling claims the parent's full draft distribution
            rows = rows[:, [0, 0, 0, 3, 3, 5, 5, 7, 7]]
        return torch.cat(toks, 1), rows
    top = P[ctx].argsort(-1, descending=True)[:, :2]
    toks = torch.cat([top, P[top[:, 0]].argmax(-1, keepdim=True), P[top[:, 1]].argmax(-1, keepdim=True)], 1)
    return toks, (torch.nn.functional.one_hot(toks, V).double() if kind == "onehot_rows" else None)


def emitted(kind: str, ctx: torch.Tensor, gen: torch.Generator, vgen: torch.Generator | None = None, **kw):
    """One verification per context: the accepted path's tokens, then next_token. Trees are drawn with gen (CPU);
    verification runs on vgen's device with vgen's draws (default: gen), as the engine's on the model's."""
    vgen = vgen or gen
    tokens, dprobs = sample_trees(kind, ctx, gen, **kw)
    probs = Q.float()[torch.cat([ctx[:, None], tokens], 1)].to(vgen.device)  # [N, n + 1, V]: row 0 the root's
    dprobs = None if dprobs is None else dprobs.float().to(vgen.device)
    parents, nodes, out = PARENTS[kind].to(vgen.device), tokens.to(vgen.device), []
    for i, toks in enumerate(tokens.tolist()):
        v = verify_sampling(DraftTree(nodes[i], parents, None if dprobs is None else dprobs[i]), probs[i], vgen)
        out.append([toks[j] for j in v.path] + [v.next_token])
    return out


def first_two(kind: str, n: int, seed: int, device: str | None = None, **kw) -> torch.Tensor:
    """[n, 2]: the first two tokens emitted after ROOT. When a step emits only one, the next step
    (a fresh tree rooted at that token) gives the second, as the engine would. device: verify there, drawing
    from a generator on it (default: on the CPU, from the trees' generator)."""
    gen = torch.Generator().manual_seed(seed)
    kw["vgen"] = torch.Generator(device).manual_seed(seed) if device else None
    first = emitted(kind, torch.full((n,), ROOT), gen, **kw)
    short = [i for i, e in enumerate(first) if len(e) < 2]
    second = emitted(kind, torch.tensor([first[i][0] for i in short], dtype=torch.long), gen, **kw)
    for i, e in zip(short, second, strict=True):
        first[i] = first[i][:1] + e[:1]
    return torch.tensor([e[:2] for e in first])


def chi2_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson goodness of fit of integer samples (cells 0..k-1) to probs.

    Under H0 (the verifier is lossless) the cell counts are Multinomial(N, probs) and
    X^2 = sum (O - N p)^2 / (N p) over the cells with p > 0 tends to chi^2 with (cells - 1) degrees of
    freedom; with every expected count >= 5 (asserted) the approximation holds well. The p-value is the
    chi^2 survival function, the regularised upper incomplete gamma Q(df / 2, X^2 / 2). Rejecting at
    p < ALPHA fails a correct verifier with probability ~ALPHA per statistic (and the seeds are fixed,
    so a passing run stays passing). A cell with p = 0 must never be hit at all: that is checked exactly.
    """
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    n, live = counts.sum(), probs > 0
    assert counts[~live].sum() == 0, f"emitted a token the target gives probability 0: {counts[~live]}"
    expected = n * probs[live]
    assert expected.min() >= 5, "too few draws for the chi-square approximation"
    stat = ((counts[live] - expected) ** 2 / expected).sum()
    df = torch.tensor(live.sum().item() - 1.0, dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))


def l1_bound(cells: int, n: int) -> float:
    """Distribution-free cross-check (Bretagnolle-Huber-Carol): P(||p_hat - p||_1 >= eps) <= 2^k exp(-n eps^2 / 2),
    so eps = sqrt(2 (k ln 2 + ln(1 / ALPHA)) / n) is exceeded with probability <= ALPHA, for any n."""
    return math.sqrt(2 * (cells * math.log(2) + math.log(1 / ALPHA)) / n)


def check_lossless(pairs: torch.Tensor) -> None:
    n = len(pairs)
    q1 = Q[ROOT]
    q12 = (Q[ROOT][:, None] * Q).flatten()  # q(x1) q(x2 | x1), exactly
    first = pairs[:, 0]
    joint = pairs[:, 0] * V + pairs[:, 1]
    p1, p12 = chi2_pvalue(first, q1), chi2_pvalue(joint, q12)
    assert p1 > ALPHA, f"first token not distributed as the target: chi2 p={p1:.2e}"
    assert p12 > ALPHA, f"first two tokens not distributed as the target: chi2 p={p12:.2e}"
    for samples, q in ((first, q1), (joint, q12)):
        freq = torch.bincount(samples, minlength=q.numel()).double() / n
        assert (freq - q).abs().sum() <= l1_bound(q.numel(), n)


SHARP = torch.softmax(4 * B.double(), -1)  # a more confident draft (top token 0.43-0.69): large sibling effects


@pytest.mark.parametrize(
    "kind,n,draft",
    [("chain", 10000, P), ("tree", 10000, P), ("tree", 5000, SHARP), ("onehot", 10000, P), ("onehot_rows", 4000, P)],
    ids=["chain", "tree", "tree-sharp-draft", "onehot", "onehot-rows"],
)
def test_sampling_is_lossless(kind, n, draft):
    check_lossless(first_two(kind, n, seed=1234, draft=draft))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_sampling_draws_on_the_generators_device(kind, device):
    """The engine's generator lives on the model's device, so verification draws its uniforms there: PyTorch
    refuses a CPU draw from a CUDA generator, which would fail every T > 0 draft on a GPU. Verifying on the device
    with a generator there must work and stay lossless."""
    check_lossless(first_two(kind, 6000, seed=4321, device=device))


def test_draws_reach_deep_nodes():
    """The statistical test above exercises acceptance past the first level (else it would prove little)."""
    gen = torch.Generator().manual_seed(0)
    for kind in ("chain", "tree"):
        lengths = [len(e) for e in emitted(kind, torch.full((2000,), ROOT), gen)]
        assert min(lengths) == 1 and max(lengths) >= 3, kind


@pytest.mark.parametrize("kind", ["chain", "tree", "onehot"])
def test_negative_control_residual_not_updated(kind, monkeypatch):
    """A verifier that forgets the residual (keeps sampling from q after a rejection) is biased; the same
    statistic on fewer draws catches it."""
    monkeypatch.setattr(verify_mod, "residual", lambda q, x, p: q)
    pairs = first_two(kind, 3000, seed=99)
    p1 = chi2_pvalue(pairs[:, 0], Q[ROOT])
    p12 = chi2_pvalue(pairs[:, 0] * V + pairs[:, 1], (Q[ROOT][:, None] * Q).flatten())
    assert p1 < ALPHA and p12 < ALPHA, (p1, p12)


def test_negative_control_siblings_not_renormalised():
    """A subtler bug, in a tree builder: siblings drawn without replacement but each given the parent's
    full draft distribution. The joint statistic catches it (with the confident draft that
    test_sampling_is_lossless[tree-sharp-draft] passes with, on fewer draws)."""
    pairs = first_two("tree", 3000, seed=7, draft=SHARP, renormalise=False)
    p12 = chi2_pvalue(pairs[:, 0] * V + pairs[:, 1], (Q[ROOT][:, None] * Q).flatten())
    assert p12 < ALPHA, p12
