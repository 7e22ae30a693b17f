"""serve/engine/draft_cut.py: the cost-scheduled cut on hand-made trees, against brute force over every allowed cut;
the sampling restrictions (whole levels; a drawn level never judged by its own draws); DraftTree.subtree; the engine
telling the proposer the accepted path in its own tree's indices."""

from __future__ import annotations

import itertools

import torch

from draftsmith.serve.engine.draft_cut import CostCut, path_probs, stopped_levels
from draftsmith.serve.engine.engine import Engine
from draftsmith.serve.engine.sampling import SamplingParams
from draftsmith.serve.engine.tree import DraftTree
from draftsmith.serve.models.loader import load_model
from draftsmith.serve.proposers.base import Proposer


def linear(base: float, per_row: float):
    return lambda rows: base + per_row * rows


def tree(parents: list[int], a: list[float], draft_probs: bool = False) -> DraftTree:
    n = len(parents)
    probs = torch.full((n, 4), 0.25) if draft_probs else None
    return DraftTree(torch.arange(n) + 10, torch.tensor(parents), probs, torch.tensor(a))


def rate(parents: list[int], a: list[float], keep: list[int], cost, draft_s: float = 0.0) -> float:
    P = path_probs(parents, a)
    return (1 + sum(P[i] for i in keep)) / (draft_s + cost(1 + len(keep)))


def prefix_closed(parents: list[int], keep: set[int]) -> bool:
    return all(parents[i] < 0 or parents[i] in keep for i in keep)


def kept(t: DraftTree, cut) -> list[int]:
    return list(range(len(t))) if cut is None else cut.tolist()


def random_tree(g: torch.Generator, n: int) -> tuple[list[int], list[float]]:
    parents = [-1] + [int(torch.randint(-1, i, (1,), generator=g)) for i in range(1, n)]
    return parents, torch.rand(n, generator=g).tolist()


def test_path_probs_multiply_down_the_tree():
    assert path_probs([-1, 0, 1, -1], [0.5, 0.5, 0.5, 0.2]) == [0.5, 0.25, 0.125, 0.2]


def test_greedy_keeps_the_best_prefix_closed_set_of_a_chain():
    cost = linear(1.0, 0.1)
    a = [0.9, 0.9, 0.2, 0.9]
    t = tree([-1, 0, 1, 2], a)
    keep = kept(t, CostCut(cost).cut(t, 0.0, greedy=True))
    best = max(range(5), key=lambda m: rate([-1, 0, 1, 2], a, list(range(m)), cost))
    assert keep == list(range(best)) == [0, 1]


def test_greedy_matches_brute_force_on_random_trees():
    """Every prefix-closed subset of a random tree is tried: the cut's rate is the best one, and it is a
    prefix-closed set."""
    g = torch.Generator().manual_seed(0)
    for trial in range(150):
        n = int(torch.randint(1, 8, (1,), generator=g))
        parents, a = random_tree(g, n)
        cost = linear(1.0, float(torch.rand((), generator=g)) * 0.5)
        draft_s = float(torch.rand((), generator=g))
        t = tree(parents, a)
        keep = kept(t, CostCut(cost).cut(t, draft_s, greedy=True))
        assert prefix_closed(parents, set(keep)), (parents, keep)
        sets = (
            list(s) for m in range(n + 1) for s in itertools.combinations(range(n), m) if prefix_closed(parents, set(s))
        )
        best = max(rate(parents, a, s, cost, draft_s) for s in sets)
        assert abs(rate(parents, a, keep, cost, draft_s) - best) < 1e-9, (trial, parents, a, keep)


def test_a_flat_cost_keeps_everything_and_a_steep_one_nothing():
    t = tree([-1, 0, 0, 1], [0.5, 0.4, 0.3, 0.2])
    assert CostCut(linear(1.0, 0.0)).cut(t, 0.0, greedy=True) is None  # None: the whole tree
    assert CostCut(linear(1.0, 10.0)).cut(t, 0.0, greedy=True).tolist() == []


def test_draft_time_makes_a_longer_draft_pay():
    """The same row costs weigh less against a step whose drafting already took long."""
    t, cost = tree([-1, 0, 1], [0.6, 0.6, 0.6]), linear(0.01, 0.01)
    fast = kept(t, CostCut(cost).cut(t, 0.0, greedy=True))
    slow = kept(t, CostCut(cost).cut(t, 1.0, greedy=True))
    assert len(fast) < len(slow) == 3


def test_sampling_cuts_whole_levels_only():
    """Node 1 (a poor sibling) is worth dropping alone, but sampling keeps or drops its level whole."""
    parents, a = [-1, -1, 0, 0], [0.95, 0.05, 0.9, 0.5]
    cost = linear(1.0, 0.12)
    t = tree(parents, a)
    assert 1 not in kept(t, CostCut(cost).cut(t, 0.0, greedy=True))
    keep = kept(t, CostCut(cost).cut(t, 0.0, greedy=False))
    assert 1 in keep
    depths = t.depths.tolist()
    deepest = max((depths[i] for i in keep), default=0)
    assert keep == [i for i in range(4) if depths[i] <= deepest]
    best = max(range(3), key=lambda d: rate(parents, a, [i for i in range(4) if depths[i] <= d], cost))
    assert deepest == best


def test_drawn_levels_are_kept_by_what_the_levels_above_say():
    """A sampled chain (draft_probs set): changing level d's accept probability never changes whether level d is
    verified, only whether deeper ones are."""
    cost, parents = linear(1.0, 0.1), [-1, 0, 1, 2, 3]
    g = torch.Generator().manual_seed(1)
    for _ in range(100):
        a = torch.rand(5, generator=g).tolist()
        base = stopped_levels(path_probs(parents, a), [1, 2, 3, 4, 5], cost, 0.0)
        for d in range(5):
            other = a.copy()
            other[d] = float(torch.rand((), generator=g))
            changed = stopped_levels(path_probs(parents, other), [1, 2, 3, 4, 5], cost, 0.0)
            assert (d < len(base)) == (d < len(changed)), (a, d)  # level d + 1 in or out alike
    t = tree(parents, [0.01] * 5, draft_probs=True)
    assert kept(t, CostCut(cost).cut(t, 0.0, greedy=False)) == [0]  # level 1 always stays


def test_no_accept_probs_means_no_cut():
    t = DraftTree(torch.tensor([1, 2]), torch.tensor([-1, 0]))
    assert CostCut(linear(1.0, 10.0)).cut(t, 0.0, greedy=True) is None
    assert CostCut(linear(1.0, 10.0)).cut(DraftTree.empty(), 0.0, greedy=True) is None


def test_non_finite_accept_probs_are_not_trusted_to_cut(caplog):
    """A drafter with NaN weights (its confidence NaN) must not switch speculation off: the draft is verified whole."""
    for bad in (float("nan"), float("inf")):
        t = tree([-1, 0, 1], [0.9, bad, 0.1])
        assert CostCut(linear(1.0, 10.0)).cut(t, 0.0, greedy=True) is None


def test_subtree_renumbers_and_carries_the_probabilities():
    t = DraftTree(
        torch.tensor([10, 11, 12, 13, 14]),
        torch.tensor([-1, -1, 0, 1, 2]),
        torch.eye(5),
        torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5]),
    )
    s = t.subtree(torch.tensor([0, 2, 4]))
    assert s.tokens.tolist() == [10, 12, 14] and s.parents.tolist() == [-1, 0, 1]
    assert s.depths.tolist() == [1, 2, 3]
    assert s.draft_probs.argmax(-1).tolist() == [0, 2, 4]
    assert torch.allclose(s.accept_probs, torch.tensor([0.1, 0.3, 0.5]))


class PlantedProposer(Proposer):
    """Drafts [a wrong token (unlikely), the right next token (likely) -> the right one after it (likely)] from a
    known greedy continuation, and records what accept() is told."""

    max_tree_size = 3

    def __init__(self, full: list[int]) -> None:
        self.full, self.told = full, []

    def propose(self, tokens, sp, budget):
        n = tokens.numel()
        if n + 1 >= len(self.full) or budget < 2:
            return DraftTree.empty()
        right = self.full[n : n + 2]
        return DraftTree(
            torch.tensor([(right[0] + 1) % 128, *right]),
            torch.tensor([-1, -1, 1]),
            None,
            torch.tensor([0.01, 0.9, 0.9]),
        )

    def accept(self, tokens, tree, path, out):
        self.told.append((len(tree), tree.tokens[path].tolist(), tokens[-len(path) - 1 : -1].tolist()))


def test_the_proposer_hears_the_path_in_the_indices_of_the_tree_it_drafted(tiny_llama_dir):
    model = load_model(tiny_llama_dir("llama"), torch.float32, "cpu")
    prompt = [5, 6, 7, 8]
    full = prompt + Engine(model, max_seq_len=64).generate(prompt, 12, SamplingParams()).output_ids
    spy = PlantedProposer(full)
    engine = Engine(model, spy, max_seq_len=64, draft_cut=CostCut(linear(1.0, 0.05)))
    out = engine.generate(prompt, 12, SamplingParams())
    assert prompt + out.output_ids == full
    assert spy.told and all(size == 3 and drafted == emitted for size, drafted, emitted in spy.told), spy.told
    assert out.metrics.accepted_tokens == 2 * out.metrics.drafts  # the wrong sibling was cut, the right path kept
    assert out.metrics.verify_rows[2] == out.metrics.drafts  # 3 rows: the pending token and the two kept nodes
