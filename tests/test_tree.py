"""Draft trees: structure, depths, positions, the tree attention mask, and that mask + positions make a
tree forward equal to running each root-to-node path as a plain causal sequence."""

from __future__ import annotations

import pytest
import torch

from draftsmith.serve.engine.tree import DraftTree, python_depths
from draftsmith.serve.models.loader import load_model

T, F = True, False


def test_chain():
    tree = DraftTree.chain(torch.tensor([5, 6, 7]))
    assert len(tree) == 3
    assert tree.parents.tolist() == [-1, 0, 1]
    assert tree.depths.tolist() == [1, 2, 3]
    assert tree.is_chain
    assert tree.children() == [[0], [1], [2], []]
    assert tree.positions(10).tolist() == [10, 11, 12, 13]
    assert tree.draft_probs is None


def test_chain_keeps_draft_probs():
    probs = torch.softmax(torch.randn(2, 4), -1)
    tree = DraftTree.chain(torch.tensor([1, 2]), probs)
    assert tree.draft_probs is probs and tree.is_chain


def test_empty():
    tree = DraftTree.empty()
    assert len(tree) == 0 and tree.tokens.dtype == torch.long
    assert tree.depths.numel() == 0
    assert tree.is_chain
    assert tree.children() == [[]]
    assert tree.positions(7).tolist() == [7]  # only the root
    assert torch.equal(tree.attention_mask(3), torch.ones(1, 4, dtype=torch.bool))


def test_single_node():
    tree = DraftTree(torch.tensor([9]), torch.tensor([-1]))
    assert tree.is_chain and tree.depths.tolist() == [1]
    assert torch.equal(tree.attention_mask(0), torch.tensor([[T, F], [T, T]]))


def test_branching_structure():
    tree = DraftTree(torch.tensor([10, 11, 12, 13, 14]), torch.tensor([-1, -1, 0, 0, 2]))
    assert not tree.is_chain
    assert tree.depths.tolist() == [1, 1, 2, 2, 3]
    assert tree.children() == [[0, 1], [2, 3], [], [4], [], []]
    assert tree.positions(10).tolist() == [10, 11, 11, 12, 12, 13]
    assert tree.positions(0).tolist() == [0, 1, 1, 2, 2, 3]


def test_not_a_chain_even_when_depths_are():
    # every node at a new depth but node 2 hangs off the root's first child, not node 1
    assert not DraftTree(torch.tensor([1, 2, 3]), torch.tensor([-1, 0, 0])).is_chain
    assert DraftTree(torch.tensor([1, 2, 3]), torch.tensor([-1, 0, 1])).is_chain


def test_tree_depths_deep():
    assert python_depths([-1, 0, 1, 2, -1, 4, 1]) == [1, 2, 3, 4, 1, 2, 3]
    assert DraftTree(torch.arange(3), torch.tensor([-1, 0, 0])).depths.tolist() == [1, 2, 2]


def test_attention_mask_by_hand():
    tree = DraftTree(torch.tensor([10, 11, 12, 13, 14]), torch.tensor([-1, -1, 0, 0, 2]))
    #            prefix | root n0 n1 n2 n3 n4
    expected = [
        [T, T, T, F, F, F, F, F],  # root
        [T, T, T, T, F, F, F, F],  # n0 <- root
        [T, T, T, F, T, F, F, F],  # n1 <- root
        [T, T, T, T, F, T, F, F],  # n2 <- n0 <- root
        [T, T, T, T, F, F, T, F],  # n3 <- n0 <- root
        [T, T, T, T, F, T, F, T],  # n4 <- n2 <- n0 <- root
    ]
    mask = tree.attention_mask(2)
    assert mask.dtype == torch.bool and mask.shape == (6, 8)
    assert mask.tolist() == expected
    assert tree.attention_mask(0).tolist() == [row[2:] for row in expected]


def test_attention_mask_of_chain_is_causal():
    tree = DraftTree.chain(torch.tensor([1, 2, 3, 4]))
    assert torch.equal(tree.attention_mask(3), torch.ones(5, 8, dtype=torch.bool).tril(3))


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return load_model(tiny_llama_dir("llama"), torch.float32, "cpu")


def path_tokens(tree: DraftTree, node: int) -> list[int]:
    """Tokens of the ancestors of `node` (root excluded), root-side first, ending with node."""
    out = []
    while node >= 0:
        out.append(int(tree.tokens[node]))
        node = int(tree.parents[node])
    return out[::-1]


def tree_forward(model, prefix: torch.Tensor, root: int, tree: DraftTree, mask: torch.Tensor) -> torch.Tensor:
    cache = model.new_cache(64)
    p = prefix.numel()
    model(prefix, torch.arange(p), cache, 0)  # causal prefill
    inputs = torch.cat([torch.tensor([root]), tree.tokens])
    return model(inputs, tree.positions(p), cache, p, mask).logits


def test_tree_forward_equals_each_path_run_causally(model):
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prefix = torch.randint(0, vocab, (6,), generator=g)
    root = 3
    parents = torch.tensor([-1, -1, 0, 0, 2, 1, 5, -1, 3])
    tree = DraftTree(torch.randint(0, vocab, (len(parents),), generator=g), parents)
    logits = tree_forward(model, prefix, root, tree, tree.attention_mask(prefix.numel()))

    for row in range(len(tree) + 1):
        seq = prefix.tolist() + [root] + ([] if row == 0 else path_tokens(tree, row - 1))
        ref = model(torch.tensor(seq), torch.arange(len(seq)), model.new_cache(64), 0).logits[-1]
        assert torch.allclose(logits[row], ref, atol=1e-5, rtol=0), f"row {row}: {(logits[row] - ref).abs().max()}"

    # The check has teeth: a plain causal mask over the same flattened tree gives other logits for branch nodes.
    p = prefix.numel()
    wrong = tree_forward(model, prefix, root, tree, torch.ones(len(tree) + 1, p + len(tree) + 1).bool().tril(p))
    assert (wrong[2] - logits[2]).abs().max() > 1e-3  # node 1 would see node 0, its sibling


def merge_chain(tree: DraftTree, chain: torch.Tensor) -> DraftTree:
    from draftsmith.serve.proposers.hybrid import merge_tree

    return merge_tree(tree, DraftTree.chain(chain))


def test_merge_chain_reuses_the_trees_nodes_then_appends():
    tree = DraftTree(torch.tensor([5, 6, 7, 8]), torch.tensor([-1, -1, 0, 0]))  # root -> 5 -> {7, 8}; root -> 6
    merged = merge_chain(tree, torch.tensor([5, 8, 9, 9]))
    assert merged.tokens.tolist() == [5, 6, 7, 8, 9, 9]
    assert merged.parents.tolist() == [-1, -1, 0, 0, 3, 4]  # 5 and 8 shared, then 9 -> 9 under node 3
    assert merged.depths.tolist() == [1, 1, 2, 2, 3, 4]
    inside = merge_chain(tree, torch.tensor([6]))
    assert inside.tokens.tolist() == tree.tokens.tolist() and inside.parents.tolist() == tree.parents.tolist()
    fresh = merge_chain(DraftTree.empty(), torch.tensor([3, 4]))
    assert fresh.is_chain and fresh.tokens.tolist() == [3, 4]


def random_scored_tree(g: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Parents before children, scores as cumulative log-probs: a child never scores above its parent. Many
    log-probs are 0 (a certain token), so children tie with their parents and with unrelated nodes."""
    parents, scores = [], []
    for i in range(n):
        p = int(torch.randint(-1, i, (1,), generator=g)) if i else -1
        step = -float(torch.randint(0, 3, (1,), generator=g))  # 0, -1 or -2
        parents.append(p)
        scores.append((scores[p] if p >= 0 else 0.0) + step)
    return torch.tensor(parents), torch.tensor(scores)


def test_rerank_keeps_the_best_nodes_with_all_their_ancestors():
    """serve/eagle.rerank: the kept nodes are the `keep` best by score, every kept node's ancestors are kept
    (ties broken by index, so a parent wins a tie with its child), parents are re-indexed and order stays
    topological, and each kept node keeps its token and draft distribution."""
    from draftsmith.serve.proposers.topk_trees import rerank

    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        n = int(torch.randint(1, 12, (1,), generator=g))
        parents, scores = random_scored_tree(g, n)
        keep = int(torch.randint(1, n + 2, (1,), generator=g))
        probs = torch.eye(n)  # row i names node i
        tree = rerank(DraftTree(torch.arange(n) + 100, parents, probs), scores, keep)
        kept = (tree.tokens - 100).tolist()  # original index of each kept node
        assert len(kept) == min(keep, n) and kept == sorted(kept)
        assert tree.draft_probs.argmax(-1).tolist() == kept
        dropped = [i for i in range(n) if i not in kept]
        if dropped:
            assert min(scores[kept]) >= max(scores[dropped])
        for new, old in enumerate(kept):
            p = int(parents[old])
            assert p == -1 or p in kept, (parents.tolist(), scores.tolist(), keep, kept)  # the ancestor rule
            assert int(tree.parents[new]) == (-1 if p == -1 else kept.index(p))
            assert int(tree.parents[new]) < new


def test_rerank_keeps_all_when_the_tree_fits():
    from draftsmith.serve.proposers.topk_trees import rerank

    tokens, parents = torch.tensor([5, 6, 7]), torch.tensor([-1, 0, 0])
    tree = rerank(DraftTree(tokens, parents), torch.tensor([-1.0, -1.0, -3.0]), 3)
    assert tree.tokens.equal(tokens) and tree.parents.equal(parents) and tree.draft_probs is None
