"""Suffix decoding (serve/proposers/propose_suffix.py): the trees' counts, matches and drafts on small hand-checked
sequences (and against brute force), the global tree's FIFO bound, the engine with it (greedy lossless, a repeated
request drafted from the first one's answer, sampling keeping the target's distribution), the hybrid with a head,
configs, and bad settings refused."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from omegaconf import OmegaConf

import draftsmith.conf
from draftsmith.eval.methods import drafter_params, spec_label
from draftsmith.eval.runner import run_eval
from draftsmith.serve.build import lookup_proposer, make_proposer, resolve_shape
from draftsmith.serve.engine.engine import Engine
from draftsmith.serve.engine.prefix_cache import PrefixCache
from draftsmith.serve.engine.sampling import SamplingParams
from draftsmith.serve.engine.tree import DraftTree, TreeConfig
from draftsmith.serve.models.loader import load_model
from draftsmith.serve.models.target import LoadedTarget
from draftsmith.serve.proposers.hybrid import HybridProposer, merge_tree
from draftsmith.serve.proposers.propose_eagle import EagleProposer
from draftsmith.serve.proposers.propose_suffix import SuffixProposer, SuffixTree
from draftsmith.serve.spec import SpecConfig, SuffixConfig
from helpers import (
    PROMPTS,
    SMALL,
    build_tiny_chat_target,
    check_metrics,
    eagle_head,
    eval_config,
    exact_joint,
    joint_pvalues,
    spy_budgets,
)

GREEDY = SamplingParams()
MAX_NEW, MAX_SEQ, ALPHA = 24, 128, 1e-4
SEQ = [1, 2, 3, 1, 2, 4, 1, 2]

pytestmark = pytest.mark.usefixtures("one_thread")


def held(tree: SuffixTree, tokens: list[int]) -> int:
    """How often the tree counts the substring `tokens` (0: not held)."""
    node = tree.root
    for d, t in enumerate(tokens):
        node = tree.step(node, d, t)
        if node is None:
            return 0
    return node.count


def brute_counts(seqs: list[list[int]], depth: int) -> dict[tuple, int]:
    out: dict[tuple, int] = {}
    for s in seqs:
        for i in range(len(s)):
            for j in range(i + 1, min(len(s), i + depth) + 1):
                out[tuple(s[i:j])] = out.get(tuple(s[i:j]), 0) + 1
    return out


def all_counts(tree: SuffixTree) -> dict[tuple, int]:
    """Every substring the tree holds, leaves' chains spelled out."""
    out: dict[tuple, int] = {}

    def walk(node, path: list[int]) -> None:
        if node.depth:
            out[tuple(path)] = node.count
        if node.seq is not None:
            chain = node.seq[node.at : node.at + tree.depth - node.depth]
            for i in range(len(chain)):
                out[tuple(path + chain[: i + 1])] = 1
            return
        for t, child in node.kids.items():
            walk(child, path + [t])

    walk(tree.root, [])
    return out


# ---------------------------------------------------------------- the tree


def test_counts_on_a_small_sequence():
    tree = SuffixTree(4)
    tree.extend(0, SEQ)
    assert tree.root.count == 8  # one suffix start per token
    assert [held(tree, s) for s in ([1], [2], [1, 2], [2, 3], [1, 2, 3], [1, 2, 4], [4, 1, 2], [3, 1, 2, 4])] == [
        3,
        3,
        3,
        1,
        1,
        1,
        1,
        1,
    ]
    assert held(tree, [1, 2, 3, 1, 2]) == 0  # longer than the depth: not held
    assert held(tree, [2, 1]) == 0 and held(tree, [5]) == 0
    # the sequence's own suffixes that others share: "2" and "1 2" (3 times each); "4 1 2" is met once
    assert [(n.depth, n.count) for n in tree.suffixes(0)] == [(1, 3), (2, 3)]


def test_draft_follows_the_most_frequent_continuation():
    tree = SuffixTree(24)
    tree.extend(0, SEQ)
    draft = tree.speculate(tree.suffixes(0), 24, SuffixConfig())
    # "1 2" (3 times: one is the end itself) went on to 3 and to 4 once each: 3 (the first seen) at 1/3, then the
    # rest of that occurrence ("1 2 4 ...") at 1/3; a draft is capped at the match length (2)
    assert (draft.tokens, draft.parents, draft.match_len) == ([3, 1], [-1, 0], 2)
    assert draft.probs == pytest.approx([1 / 3, 1 / 3]) and draft.score == pytest.approx(2 / 3)
    assert tree.speculate(tree.suffixes(0), 24, SuffixConfig(min_token_prob=0.5)).tokens == []
    half = tree.speculate(tree.suffixes(0), 24, SuffixConfig(max_spec_factor=0.5))
    assert (half.tokens, half.match_len) == ([3], 2)  # 0.5 x 2 tokens
    assert tree.speculate(tree.suffixes(0), 1, SuffixConfig()).tokens == [3]  # num_tokens caps it
    branchy = tree.speculate(tree.suffixes(0), 24, SuffixConfig(tree=True))
    assert (branchy.tokens, branchy.parents) == ([3, 4], [-1, -1])  # both continuations of "1 2", 1/3 each


def test_a_count_that_grows_takes_the_lead():
    tree = SuffixTree(8)
    tree.extend(0, [7, 1, 7, 2, 7, 2, 7])  # after 7: 1 once, 2 twice
    assert tree.speculate(tree.suffixes(0), 1, SuffixConfig()).tokens == [2]
    assert tree.speculate(tree.suffixes(0), 1, SuffixConfig()).probs == pytest.approx([2 / 4])


def test_counts_matches_and_drafts_agree_with_brute_force():
    """Random small sequences, appended and removed in any order: the counts are exact, a sequence's shared
    suffixes hold those met at least twice, and every drafted token is a most frequent child at its probability."""
    rng = random.Random(0)
    for _ in range(150):
        depth, vocab = rng.randint(2, 6), rng.randint(1, 3)
        tree, seqs, live = SuffixTree(depth), {}, []
        for step in range(rng.randint(1, 60)):
            r = rng.random()
            if r < 0.1 and live:
                sid = live.pop(rng.randrange(len(live)))
                tree.remove(sid)
                del seqs[sid]
            elif r < 0.2 or not live:
                live.append(step)
                seqs[step] = []
            else:
                sid = rng.choice(live)
                seqs[sid].append(rng.randint(0, vocab))
                tree.append(sid, seqs[sid][-1])
            want = brute_counts(list(seqs.values()), depth)
            assert all_counts(tree) == want
            assert tree.root.count == sum(map(len, seqs.values()))
            for sid in live:
                s, shared = seqs[sid], tree.suffixes(sid) if seqs[sid] else []
                counts = [want[tuple(s[-m:])] for m in range(1, min(len(s), depth - 1) + 1)]
                # every suffix met twice or more (and maybe some a removed sequence shared), the rest met once
                assert [n.count for n in shared] == counts[: len(shared)] and set(counts[len(shared) :]) <= {1}
                for m, node in enumerate(shared, 1):
                    check_path(tree.draft_path(node, m, depth, 0.1), s[-m:], want)


def check_path(draft, context: list[int], counts: dict[tuple, int]) -> None:
    prob = 1.0
    for token, p in zip(draft.tokens, draft.probs, strict=True):
        kids = {k[-1]: c for k, c in counts.items() if len(k) == len(context) + 1 and list(k[:-1]) == context}
        assert kids[token] == max(kids.values())
        prob *= kids[token] / counts[tuple(context)]
        assert p == pytest.approx(prob) and p >= 0.1
        context = context + [token]


def test_global_matches_follow_the_context():
    tree = SuffixTree(6)
    tree.extend(0, [5, 6, 7, 8, 9])
    context, matches = [], []
    for t in [1, 6, 7]:
        context.append(t)
        matches = tree.follow(matches, context, t)
    assert [n.count for n in matches] == [1, 1]  # "7" and "6 7" are held, "1 6 7" is not
    assert tree.speculate(matches, 24, SuffixConfig()).tokens == [8, 9]  # 2-token match: 2 tokens
    context.append(9)
    assert tree.follow(matches, context, 9) == []  # "9": nothing ever followed it


def test_global_tree_keeps_the_last_max_cached_requests_responses():
    """FIFO: the oldest response goes once more than max_cached_requests are held, and with it its nodes."""
    proposer = SuffixProposer(SuffixConfig(max_tree_depth=4, max_cached_requests=2))
    responses = [[10 + i, 20 + i, 30 + i] for i in range(5)]
    for i, response in enumerate(responses):
        proposer.start([1, 2])
        proposer.learn(response)
        held_now = [r for r in responses[: i + 1] if held(proposer.glob, r) == 1]
        assert held_now == responses[max(0, i - 1) : i + 1]  # the last two
        assert list(proposer.glob.seqs) == list(proposer.cached) == list(range(max(1, i), i + 2))
    assert proposer.glob.root.count == 6
    assert all_counts(proposer.glob) == brute_counts(responses[-2:], 4)  # nothing of the others is left
    for sid in list(proposer.glob.seqs):
        proposer.glob.remove(sid)
    assert proposer.glob.root.kids == {} and proposer.glob.root.count == 0


def nodes(tree: SuffixTree) -> int:
    stack, n = [tree.root], 0
    while stack:
        node = stack.pop()
        n += 1
        stack += (node.kids or {}).values()
    return n


def test_global_tree_memory_is_bounded_by_what_it_holds():
    """Nodes stay within a small multiple of the tokens held (a leaf stands for the rest of an occurrence met
    once), however many requests came before."""
    proposer = SuffixProposer(SuffixConfig(max_tree_depth=8, max_cached_requests=3))
    rng = random.Random(1)
    for _ in range(30):
        proposer.start([1])
        proposer.learn([rng.randrange(50) for _ in range(40)])
        assert nodes(proposer.glob) <= 1 + 2 * proposer.glob.root.count <= 1 + 2 * 3 * 40


def test_no_global_tree_when_max_cached_requests_is_0():
    proposer = SuffixProposer(SuffixConfig(max_cached_requests=0))
    proposer.start([1, 2, 3])
    proposer.learn([4, 5])
    assert proposer.glob is None and proposer.local.seqs[0] == [1, 2, 3, 4, 5]


# ---------------------------------------------------------------- in the engine


@pytest.fixture(scope="module")
def target(tiny_llama_dir):
    return load_model(tiny_llama_dir("llama"), torch.float32, "cpu")


@pytest.fixture(scope="module")
def plain(target):
    engine = Engine(target, max_seq_len=MAX_SEQ)
    return {tuple(p): engine.generate(p, MAX_NEW, GREEDY) for p in PROMPTS}


@pytest.mark.parametrize("cfg", [SuffixConfig(), SuffixConfig(tree=True), SuffixConfig(max_cached_requests=0)])
def test_greedy_suffix_decoding_equals_plain(cfg, target, plain):
    proposer = SuffixProposer(cfg, 8)
    trees = []
    propose = proposer.propose
    proposer.propose = lambda tokens, sp, budget: trees.append(t := propose(tokens, sp, budget)) or t
    engine = Engine(target, proposer, PrefixCache(), max_seq_len=MAX_SEQ)
    accepted = 0
    for rep in range(2):
        for p in PROMPTS:
            out = engine.generate(p, MAX_NEW, GREEDY)
            assert out.output_ids == plain[tuple(p)].output_ids, (cfg, rep, p)
            m = out.metrics
            assert m.draft_tokens <= 8 * m.drafts and sum(m.accepted_per_position) == m.accepted_tokens
            accepted += m.accepted_tokens
    assert accepted > 0
    assert any(not t.is_chain for t in trees) == cfg.tree  # tree=True drafts branch somewhere, paths never do


@pytest.mark.parametrize("cached", [10000, 0])
def test_global_tree_drafts_a_repeated_request_from_the_first_answer(cached, target, plain):
    """The same request twice: the second is drafted from the first's answer (tau up), unless the global tree is
    off (then both draft from the prompt alone: the same tau)."""
    engine = Engine(target, SuffixProposer(SuffixConfig(max_cached_requests=cached)), max_seq_len=MAX_SEQ)
    for p in PROMPTS[:3]:
        first, second = (engine.generate(p, MAX_NEW, GREEDY) for _ in range(2))
        assert first.output_ids == second.output_ids == plain[tuple(p)].output_ids
        tau1, tau2 = first.metrics.mean_acceptance_length, second.metrics.mean_acceptance_length
        if cached:
            assert tau2 > tau1 and tau2 > 4, (p, tau1, tau2)
        else:
            assert tau2 == tau1


@pytest.mark.parametrize("tree", [False, True])
def test_drafts_never_reach_past_max_new_tokens(tree, target, plain):
    """A request answered before drafts all of a repeat from the global tree: each draft still stops at the
    tokens the request may emit (budget), and the output and metrics stay plain decoding's."""
    p = PROMPTS[3]
    ref = plain[tuple(p)].output_ids
    proposer = SuffixProposer(SuffixConfig(tree=tree), 8)
    engine = Engine(target, proposer, max_seq_len=MAX_SEQ)
    engine.generate(p, MAX_NEW, GREEDY)
    calls = spy_budgets(proposer)
    shortened = 0  # drafts the budget made shorter than num_tokens
    for n in range(1, 12):
        calls.clear()
        out = engine.generate(p, n, GREEDY)
        assert out.output_ids == ref[:n] and out.finished_by == "length"
        check_metrics(out.metrics, out.output_ids, proposer.max_tree_size)
        assert all(depth <= budget for _, budget, depth in calls), (n, calls)
        shortened += sum(0 < depth == budget < 8 for _, budget, depth in calls)
    assert shortened > 0


def test_forget_drops_earlier_answers(target):
    proposer = SuffixProposer(SuffixConfig())
    engine = Engine(target, proposer, max_seq_len=MAX_SEQ)
    first = engine.generate(PROMPTS[0], MAX_NEW, GREEDY).metrics.mean_acceptance_length
    engine.generate(PROMPTS[0], MAX_NEW, GREEDY)
    proposer.forget()
    assert engine.generate(PROMPTS[0], MAX_NEW, GREEDY).metrics.mean_acceptance_length == first


def test_one_clients_answers_never_draft_anothers(target):
    """The global tree is kept per client (draftsmith-serve sets it per API key or cache_salt): a second client
    asking what the first asked drafts from its prompt alone, as a fresh engine does; the first drafts from its
    answer."""
    proposer = SuffixProposer(SuffixConfig())
    engine = Engine(target, proposer, max_seq_len=MAX_SEQ)
    fresh = engine.generate(PROMPTS[0], MAX_NEW, GREEDY).metrics.mean_acceptance_length  # client "" learns it
    proposer.set_client("alice")
    engine.generate(PROMPTS[1], MAX_NEW, GREEDY)
    proposer.set_client("bob")
    assert engine.generate(PROMPTS[0], MAX_NEW, GREEDY).metrics.mean_acceptance_length == fresh
    proposer.set_client("")
    assert engine.generate(PROMPTS[0], MAX_NEW, GREEDY).metrics.mean_acceptance_length > fresh


@pytest.fixture(scope="module")
def small(tiny_llama_dir):
    """Vocabulary-8 target and the exact plain-sampling distribution of the 3 tokens after a repetitive prompt."""
    tgt = load_model(tiny_llama_dir("llama", **SMALL), torch.float32, "cpu")
    return tgt, exact_joint(tgt, REPEATS, SamplingParams(temperature=1.0))


REPEATS = [1, 2, 3, 1, 2, 3, 1, 2]  # suffix drafts from the prompt alone too


@pytest.mark.parametrize("tree", [False, True])
def test_speculative_sampling_with_suffix_drafts_matches_plain_distribution(tree, small):
    """Deterministic (one-hot) drafts from both trees, the global one fed by earlier sampled answers: the sampled
    tokens keep the target's joint distribution."""
    tgt, joint = small
    proposer = SuffixProposer(SuffixConfig(max_cached_requests=50, min_token_prob=0.0, tree=tree), 4)
    engine = Engine(tgt, proposer, max_seq_len=32)
    draws, accepted, drafted = [], 0, 0
    for i in range(1500):
        out = engine.generate(REPEATS, 3, SamplingParams(temperature=1.0, seed=30_000 + i))
        draws.append(out.output_ids)
        accepted += out.metrics.accepted_tokens
        drafted += out.metrics.draft_tokens
    assert 0.1 * len(draws) < accepted < drafted  # drafts get accepted and rejected: both branches ran
    x = torch.tensor(draws)
    pvalues = joint_pvalues(x, joint)
    assert min(pvalues) > ALPHA, pvalues


# ---------------------------------------------------------------- with a head, from configs


@pytest.mark.parametrize("policy,tree", [("prefer", False), ("merge", False), ("merge", True)])
def test_hybrid_with_suffix_is_lossless_and_takes_suffix_paths(policy, tree, target, plain):
    head = EagleProposer(eagle_head("eagle3", target), "eagle3", 3, TreeConfig(2, 6))
    lookup = SuffixProposer(SuffixConfig(tree=tree), 6, min_score=3 if policy == "prefer" else 0)
    proposer = HybridProposer(head, lookup, policy)
    assert proposer.name == "eagle3_suffix" and proposer.max_tree_size == 6 + 6
    engine = Engine(target, proposer, max_seq_len=MAX_SEQ)
    for p in PROMPTS[:3] * 2:  # the second pass: suffix drafts from the first answers
        out = engine.generate(p, MAX_NEW, GREEDY)
        assert out.output_ids == plain[tuple(p)].output_ids, (policy, p)
        assert out.metrics.draft_tokens <= out.metrics.drafts * proposer.max_tree_size
    assert proposer.merged > 0


def test_merge_tree_shares_nodes_and_keeps_branches():
    base = DraftTree(torch.tensor([5, 6, 7]), torch.tensor([-1, -1, 0]))
    merged = merge_tree(base, DraftTree(torch.tensor([5, 8, 9, 7]), torch.tensor([-1, 0, -1, 0])))
    assert merged.tokens.tolist() == [5, 6, 7, 8, 9]
    assert merged.parents.tolist() == [-1, -1, 0, 0, -1]  # 5 and 5->7 shared; 5->8 and 9 added


def test_spec_configs_build_suffix_proposers(target):
    loaded = LoadedTarget(target, None, "tiny@0")
    conf = draftsmith.conf.__path__[0]
    spec = OmegaConf.to_object(
        OmegaConf.merge(OmegaConf.structured(SpecConfig), OmegaConf.load(f"{conf}/spec/suffix.yaml"))
    )
    assert spec.name == "suffix" and resolve_shape(spec).num_tokens == 24 and spec.suffix == SuffixConfig()
    proposer = make_proposer(spec, loaded)
    assert isinstance(proposer, SuffixProposer) and proposer.max_tree_size == 24 and proposer.min_score == 0
    assert spec_label(spec) == "suffix" and drafter_params(spec) == 0
    methods = OmegaConf.load(f"{conf}/methods/eagle3_suffix.yaml")
    assert methods.eagle3_suffix.suffix_tokens == 24
    assert spec_label(SpecConfig("eagle3", drafter="x", suffix_tokens=8)) == "eagle3_suffix"
    with pytest.raises(Exception, match="bogus"):
        OmegaConf.merge(OmegaConf.structured(SpecConfig), {"suffix": {"bogus": 1}})


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: SuffixConfig(max_tree_depth=1), "spec.suffix.max_tree_depth must be >= 2"),
        (lambda: SuffixConfig(max_cached_requests=-1), "spec.suffix.max_cached_requests must be >= 0"),
        (lambda: SuffixConfig(max_spec_factor=0), "spec.suffix.max_spec_factor must be > 0"),
        (lambda: SuffixConfig(min_token_prob=1.5), r"spec.suffix.min_token_prob must be in \[0, 1\]"),
        (lambda: SpecConfig("suffix", 0), "spec.num_tokens must be >= 1"),
        (lambda: SpecConfig("eagle3", drafter="x", suffix_tokens=-1), "spec.suffix_tokens must be >= 0"),
        (lambda: SpecConfig("eagle3", drafter="x", suffix_tokens=4, ngram_tokens=4), "pair the drafter with one"),
        (lambda: SuffixProposer(SuffixConfig(), 0), "spec.num_tokens must be >= 1"),
    ],
)
def test_bad_settings_are_refused(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_lookup_pairs_with_a_head_by_the_spec():
    """spec.suffix_tokens: a suffix lookup of that length; under prefer its draft must score spec.num_tokens."""
    prefer = lookup_proposer(SpecConfig("eagle3", 5, drafter="x", suffix_tokens=8))
    assert isinstance(prefer, SuffixProposer) and (prefer.num_tokens, prefer.min_score) == (8, 5)
    merge = lookup_proposer(SpecConfig("eagle3", 5, drafter="x", suffix_tokens=8, ngram_policy="merge"))
    assert merge.min_score == 0
    assert lookup_proposer(SpecConfig("eagle3", 5, drafter="x", ngram_tokens=4)).name == "ngram"
    assert lookup_proposer(SpecConfig("suffix", suffix_tokens=8)) is None  # a lookup is not paired with itself
    assert lookup_proposer(SpecConfig("eagle3", drafter="x")) is None


def test_suffix_tokens_need_a_head(target):
    layerskip = SpecConfig("layerskip", 2, layers=1, suffix_tokens=4)
    with pytest.raises(ValueError, match="spec.suffix_tokens pairs suffix decoding with drafters that rebuild"):
        make_proposer(layerskip, LoadedTarget(target, None, "tiny@0"))


def test_eval_forgets_the_warm_up_and_earlier_repeats(smollm2_dir, tmp_path):
    """spec=suffix with repeats=2: every repeat starts with an empty global tree (neither the warm-up's answer nor
    repeat 1's help repeat 2), so greedy repeats give the same tau, with or without a warm-up."""
    tiny = build_tiny_chat_target(tmp_path / "t", smollm2_dir)
    rows = [{"id": "a", "prompt": "one two three one two"}, {"id": "b", "prompt": "x = 1\nx = 1\nx ="}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    taus = []
    for warmup in (1, 0):
        args = [f"prompts={tmp_path / 'p.jsonl'}", "spec=suffix", "repeats=2", "max_new_tokens=12", f"warmup={warmup}"]
        r = run_eval(eval_config(tiny, tmp_path / f"out{warmup}", *args))
        m = r.methods["suffix"]
        assert m.lossless.identical == m.lossless.checked == 4 and m.drafter_params == 0
        taus.append(m.tau_per_repeat)
    assert taus[0] == taus[1] and taus[0][1] == taus[0][0], taus


def test_a_resumed_eval_counts_what_an_uninterrupted_one_counts(smollm2_dir, tmp_path):
    """Killed after 2 of 4 prompts, then resume=true: the finished prompts are answered again unrecorded, so
    suffix decoding's global tree and the prefix cache hold what they held, and tau, drafts and hits match."""
    tiny = build_tiny_chat_target(tmp_path / "t", smollm2_dir)
    rows = [{"id": f"p{i}", "prompt": "one two three one two " * (i + 1)} for i in range(4)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = [f"prompts={tmp_path / 'p.jsonl'}", "spec=suffix", "max_new_tokens=16"]
    whole = run_eval(eval_config(tiny, tmp_path / "whole", *args))
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "whole", cut)
    lines = (cut / "records.jsonl").read_text().splitlines(keepends=True)
    (cut / "records.jsonl").write_text("".join(lines[:2]))  # a kill after the second prompt
    (cut / "results.json").unlink()
    resumed = run_eval(eval_config(tiny, cut, *args, "resume=true"))
    a, b = whole.methods["suffix"], resumed.methods["suffix"]
    assert (a.mean_acceptance_length, a.drafts) == (b.mean_acceptance_length, b.drafts)
    assert whole.prefix_cache.hit_tokens == resumed.prefix_cache.hit_tokens
