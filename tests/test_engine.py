"""The engine on tiny random Llama targets (fp32, CPU): greedy speculative decoding is lossless for every
proposer, metrics add up, eos / length / bad input, the prefix cache (target and drafter state), and
sampling: seeded determinism and a statistical check that speculative sampling matches plain sampling."""

from __future__ import annotations

import math

import pytest
import torch

from draftsmith.heads.draft_model import DraftModel
from draftsmith.serve.engine import graphs as graphs_mod
from draftsmith.serve.engine import verify as verify_mod
from draftsmith.serve.engine.engine import Engine
from draftsmith.serve.engine.graphs import full_mask
from draftsmith.serve.engine.prefix_cache import PrefixCache
from draftsmith.serve.engine.sampling import SamplingParams
from draftsmith.serve.engine.tree import DraftTree
from draftsmith.serve.models.loader import load_model
from draftsmith.serve.proposers.base import Proposer
from draftsmith.serve.proposers.propose_draft_model import DraftChainConfig, DraftModelProposer
from draftsmith.serve.proposers.propose_layerskip import layerskip_model
from draftsmith.serve.proposers.propose_ngram import NgramConfig, NgramProposer
from helpers import (
    DEVICES,
    PROMPTS,
    SMALL,
    SMALL_PROMPT,
    check_metrics,
    exact_joint,
    joint_pvalues,
    kv_prefix,
    same_kv,
    spy_budgets,
)

GREEDY = SamplingParams()
ALPHA = 1e-4
MAX_NEW = 24
MAX_SEQ = 128


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target(tiny_llama_dir):
    return load_model(tiny_llama_dir("llama"), torch.float32, "cpu")


@pytest.fixture(scope="module")
def other(tiny_llama_dir):
    """Another random model with the same vocabulary: it rarely agrees with the target."""
    return load_model(tiny_llama_dir("llama", seed=1), torch.float32, "cpu")


@pytest.fixture(scope="module")
def noisy(tiny_llama_dir):
    """The target with its weights perturbed: agrees often, not always."""
    return load_noisy(tiny_llama_dir, "cpu")


def load_noisy(tiny_llama_dir, device: str):
    model = load_model(tiny_llama_dir("llama"), torch.float32, device)
    g = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.add_(0.005 * torch.randn(p.shape, generator=g).to(p.device))
    return model


@pytest.fixture(scope="module")
def plain(target):
    """Plain greedy output, and the target KV it leaves, per prompt."""
    engine = Engine(target, max_seq_len=MAX_SEQ)
    refs = {}
    for p in PROMPTS:
        out = engine.generate(p, MAX_NEW, GREEDY)
        refs[tuple(p)] = (out, kv_prefix(engine, len(p) + MAX_NEW - 1))
    return refs


class OracleTreeProposer(Proposer):
    """Knows the target's greedy continuation and hides it among decoys in a branching tree, so the
    accepted path is not contiguous and the engine has to compact the KV cache."""

    name = "oracle-tree"
    max_tree_size = 6

    def __init__(self, future: list[int], vocab: int) -> None:
        self.future, self.vocab, self.calls = future, vocab, 0

    def propose(self, tokens: torch.Tensor, sp: SamplingParams, budget: int) -> DraftTree:
        t = self.future[tokens.numel() : tokens.numel() + 3]
        if len(t) < 3:
            return DraftTree.empty()
        w = [(x + 1) % self.vocab for x in t]  # decoys: never the target's argmax
        shape = self.calls % 3
        self.calls += 1
        if shape == 0:  # right branch second: path [1, 4, 5]
            toks, parents = [w[0], t[0], w[1], w[1], t[1], t[2]], [-1, -1, 0, 1, 1, 4]
        elif shape == 1:  # right branch first, decoy between its levels: path [0, 3, 4]
            toks, parents = [t[0], w[0], w[1], t[1], t[2], w[1]], [-1, -1, 0, 0, 3, 1]
        else:  # two right, then a decoy: path [0, 1], the target corrects to t[2]
            toks, parents = [t[0], t[1], w[2], w[0]], [-1, 0, 1, -1]
        return DraftTree(torch.tensor(toks), torch.tensor(parents))


def make_proposer(name: str, target, other, noisy) -> Proposer:
    if name == "ngram":
        return NgramProposer(NgramConfig(num_tokens=4))
    if name == "draft-other":
        return DraftModelProposer(other, DraftChainConfig(3))
    if name == "draft-noisy":
        return DraftModelProposer(noisy, DraftChainConfig(4))
    if name == "draft-self":  # the target drafting for itself: every draft is accepted
        return DraftModelProposer(target, DraftChainConfig(4))
    assert name == "layerskip"
    return DraftModelProposer(layerskip_model(target, 1), DraftChainConfig(3))


# ---------------------------------------------------------------- greedy: lossless for every proposer


@pytest.mark.parametrize("name", ["ngram", "draft-other", "draft-noisy", "draft-self", "layerskip"])
def test_greedy_speculative_equals_plain(name, target, other, noisy, plain):
    proposer = make_proposer(name, target, other, noisy)
    engine = Engine(target, proposer, max_seq_len=MAX_SEQ)
    accepted = passes = plain_passes = 0
    for p in PROMPTS:
        ref, ref_kv = plain[tuple(p)]
        out = engine.generate(p, MAX_NEW, GREEDY)
        assert out.output_ids == ref.output_ids, (name, p)
        assert out.finished_by == "length"
        assert same_kv(kv_prefix(engine, len(p) + MAX_NEW - 1), ref_kv)  # the cache holds the true sequence
        check_metrics(out.metrics, out.output_ids, proposer.max_tree_size)
        if isinstance(proposer, DraftModelProposer):
            assert out.metrics.drafts == out.metrics.target_forward_passes  # it drafts at every step
            # k per draft, less only near the end (test_drafts_never_reach_past_max_new_tokens)
            k = proposer.cfg.num_tokens
            assert (out.metrics.drafts - k) * k < out.metrics.draft_tokens <= out.metrics.drafts * k
        accepted += out.metrics.accepted_tokens
        passes += out.metrics.target_forward_passes
        plain_passes += ref.metrics.target_forward_passes
    if name != "draft-other":  # these do get drafts accepted on these prompts, so the accept paths ran
        assert accepted > 0 and passes < plain_passes, (name, accepted, passes, plain_passes)
    if name == "draft-self":
        assert passes == len(PROMPTS) * math.ceil((MAX_NEW - 1) / 5)  # 4 accepted + 1 bonus per pass


def test_greedy_tree_with_non_contiguous_path_equals_plain(target, plain):
    for p in PROMPTS[:3]:
        ref, ref_kv = plain[tuple(p)]
        proposer = OracleTreeProposer(p + ref.output_ids, target.config.vocab_size)
        engine = Engine(target, proposer, max_seq_len=MAX_SEQ)
        out = engine.generate(p, MAX_NEW, GREEDY)
        assert out.output_ids == ref.output_ids
        assert same_kv(kv_prefix(engine, len(p) + MAX_NEW - 1), ref_kv)  # keep() moved the right slots
        m = out.metrics
        check_metrics(m, out.output_ids, 3)
        assert m.accepted_per_position[:2] == [m.drafts, m.drafts] and 0 < m.accepted_per_position[2] < m.drafts
        assert m.target_forward_passes < ref.metrics.target_forward_passes


def test_plain_metrics(plain):
    for ref, _ in plain.values():
        m = ref.metrics
        assert m.new_tokens == MAX_NEW and m.drafts == m.draft_tokens == m.accepted_tokens == 0
        assert m.target_forward_passes == MAX_NEW - 1  # the prefill pass is not counted
        assert m.mean_acceptance_length == 1.0 and m.accepted_per_position == []
        assert m.prompt_tokens > 0 and m.ttft_s > 0 and m.total_s >= m.ttft_s


# ---------------------------------------------------------------- stopping


@pytest.mark.parametrize("name", [None, "ngram", "draft-self", "draft-noisy"])
def test_eos_stops_and_is_included(name, target, other, noisy, plain):
    for p in PROMPTS[:4]:
        ref = plain[tuple(p)][0].output_ids
        j = next(i for i in range(3, MAX_NEW) if ref[i] not in ref[:i])  # first occurrence, not at the start
        proposer = make_proposer(name, target, other, noisy) if name else None
        engine = Engine(target, proposer, eos_ids=(ref[j],), max_seq_len=MAX_SEQ)
        out = engine.generate(p, MAX_NEW, GREEDY)
        assert out.output_ids == ref[: j + 1] and out.finished_by == "eos"
        assert out.metrics.new_tokens == j + 1


def test_eos_accepted_past_max_new_tokens_is_cut(target, plain):
    """A pass that accepts beyond the budget must not bring back an EOS that plain decoding never reaches."""
    p = PROMPTS[0]
    ref = plain[tuple(p)][0].output_ids  # MAX_NEW tokens
    limit = next(i for i in range(MAX_NEW - 1, 2, -1) if ref[i] not in ref[:i] and i % 5 not in (0, 1))
    engine = Engine(target, DraftModelProposer(target, DraftChainConfig(4)), eos_ids=(ref[limit],), max_seq_len=MAX_SEQ)
    out = engine.generate(p, limit, GREEDY)  # the pass that emits token limit-1 also accepts token limit (the EOS)
    assert out.output_ids == ref[:limit] and out.finished_by == "length"


def test_eos_inside_an_accepted_draft_cuts_the_draft(target, plain):
    p = PROMPTS[0]
    ref = plain[tuple(p)][0].output_ids
    j = next(i for i in range(2, MAX_NEW) if ref[i] not in ref[:i] and i % 5 != 0)  # not the pass's last token
    engine = Engine(target, DraftModelProposer(target, DraftChainConfig(4)), eos_ids=(ref[j],), max_seq_len=MAX_SEQ)
    out = engine.generate(p, MAX_NEW, GREEDY)
    assert out.output_ids == ref[: j + 1] and out.finished_by == "eos"


@pytest.mark.parametrize("name", [None, "ngram", "draft-self"])
def test_max_new_tokens_is_exact(name, target, other, noisy, plain):
    p = PROMPTS[3]
    ref = plain[tuple(p)][0].output_ids
    engine = Engine(target, make_proposer(name, target, other, noisy) if name else None, max_seq_len=MAX_SEQ)
    for n in range(1, 9):
        out = engine.generate(p, n, GREEDY)
        assert out.output_ids == ref[:n] and out.finished_by == "length" and out.metrics.new_tokens == n
    assert engine.generate(p, 1, GREEDY).metrics.target_forward_passes == 0  # the prefill gave it


# ---------------------------------------------------------------- drafts within the budget, metrics of what was kept


def test_tau_counts_only_tokens_kept_within_max_new_tokens(target, plain):
    """The target drafting for itself, k=4, max_new_tokens=2: tau counts the tokens kept, not the 5 accepted
    past the budget. One token may still be emitted after the prefill's: the draft is one token deep, kept, and the
    bonus token is cut."""
    p = PROMPTS[0]
    engine = Engine(target, DraftModelProposer(target, DraftChainConfig(4)), max_seq_len=MAX_SEQ)
    out = engine.generate(p, 2, GREEDY)
    m = out.metrics
    assert out.output_ids == plain[tuple(p)][0].output_ids[:2]
    assert m.mean_acceptance_length == 2.0 and m.accepted_per_position == [1]
    assert (m.target_forward_passes, m.drafts, m.draft_tokens, m.accepted_tokens) == (1, 1, 1, 1)


def drafter_kv_is_fresh(proposer: DraftModelProposer, seq: list[int]) -> bool:
    """The draft model's cache slots [0, cached) hold what a fresh run of it over the sequence writes there."""
    c = proposer.cached
    fresh = proposer.model.new_cache(c)
    proposer.model(torch.tensor(seq[:c]), torch.arange(c), fresh, 0)
    return same_kv(proposer.cache.read(0, c), fresh.read(0, c), atol=1e-4)


@pytest.mark.parametrize("name", ["ngram", "draft-self", "draft-noisy", "layerskip"])
def test_drafts_never_reach_past_max_new_tokens(name, target, other, noisy, plain):
    """Each draft stops at the tokens the request may still emit; output stays plain decoding's, the metrics add
    up with at most the bonus token cut, and a draft model's cache stays valid after its shortened drafts."""
    p = PROMPTS[3]
    ref = plain[tuple(p)][0].output_ids
    proposer = make_proposer(name, target, other, noisy)
    calls = spy_budgets(proposer)
    engine = Engine(target, proposer, max_seq_len=MAX_SEQ)
    shortened = 0  # drafts the budget made shorter than k
    for n in range(1, 12):
        calls.clear()
        out = engine.generate(p, n, GREEDY)
        assert out.output_ids == ref[:n] and out.finished_by == "length"
        check_metrics(out.metrics, out.output_ids, proposer.max_tree_size)
        for length, budget, depth in calls:
            assert budget == len(p) + n - length and depth <= budget, (name, n, calls)
        shortened += sum(0 < depth == budget < proposer.max_tree_size for _, budget, depth in calls)
        if isinstance(proposer, DraftModelProposer):
            assert drafter_kv_is_fresh(proposer, p + out.output_ids), (name, n)
    assert shortened > 0


def test_draft_tokens_and_acceptance_stop_at_an_accepted_eos(target, plain):
    """The target drafting for itself (k=4) accepts every draft: 5 tokens per pass after the prefill's. An EOS at
    the start of a pass's draft cuts the rest of it, which must not count as drafted or accepted."""
    p = PROMPTS[0]
    ref = plain[tuple(p)][0].output_ids
    j = next(i for i in range(6, MAX_NEW) if ref[i] not in ref[:i] and i % 5 in (1, 2, 3))
    passes, o = (j + 4) // 5, (j - 1) % 5  # the pass that emits ref[j], at draft index o
    engine = Engine(target, DraftModelProposer(target, DraftChainConfig(4)), eos_ids=(ref[j],), max_seq_len=MAX_SEQ)
    out = engine.generate(p, MAX_NEW, GREEDY)
    m = out.metrics
    assert out.output_ids == ref[: j + 1] and out.finished_by == "eos" and m.target_forward_passes == passes
    assert m.accepted_per_position == [passes] * (o + 1) + [passes - 1] * (3 - o)
    assert m.draft_tokens == m.accepted_tokens == 4 * (passes - 1) + o + 1
    assert 1 + m.target_forward_passes + m.accepted_tokens == m.new_tokens + 1  # the cut bonus token alone


def test_tree_nodes_past_an_accepted_eos_are_not_counted(target, plain):
    """A tree whose accepted path starts with an EOS: only the depth-1 nodes (the EOS and its decoy sibling)
    count as drafted; the deeper nodes, on the path or not, were cut."""
    p = next(q for q in PROMPTS[:3] if plain[tuple(q)][0].output_ids[1] != plain[tuple(q)][0].output_ids[0])
    ref = plain[tuple(p)][0].output_ids
    proposer = OracleTreeProposer(p + ref, target.config.vocab_size)  # first tree: 6 nodes, path [1, 4, 5]
    out = Engine(target, proposer, eos_ids=(ref[1],), max_seq_len=MAX_SEQ).generate(p, MAX_NEW, GREEDY)
    m = out.metrics
    assert out.output_ids == ref[:2] and out.finished_by == "eos"
    assert (m.drafts, m.draft_tokens, m.accepted_tokens, m.accepted_per_position) == (1, 2, 1, [1])


@pytest.mark.parametrize("device", DEVICES)
def test_draft_model_with_a_shorter_context_than_the_target(device, tiny_llama_dir):
    """A draft LM whose max_position_embeddings (16) is below the target's (256) would index past its rope table
    after position 16, so its table is extended when the engine is built. The draft here is the target's
    own weights, so with a correct table every draft is accepted."""
    tgt = load_model(tiny_llama_dir("llama"), torch.float32, device)
    short = load_model(tiny_llama_dir("llama", max_position_embeddings=16), torch.float32, device)
    engine = Engine(tgt, DraftModelProposer(short, DraftChainConfig(4)), max_seq_len=MAX_SEQ)
    plain_engine = Engine(tgt, max_seq_len=MAX_SEQ)
    for p in PROMPTS:
        out = engine.generate(p, MAX_NEW, GREEDY)
        assert out.output_ids == plain_engine.generate(p, MAX_NEW, GREEDY).output_ids, p
        assert out.metrics.accepted_tokens == out.metrics.draft_tokens, p  # tokens at positions 16..: all accepted
    assert short.cos.shape[0] >= MAX_SEQ and short.cos.device == tgt.cos.device


def test_context_can_be_filled_exactly(target):
    """prompt + max_new_tokens == max_seq_len is allowed, with drafts reaching past the last position."""
    plain_engine = Engine(target)
    for proposer in (DraftModelProposer(target, DraftChainConfig(4)), NgramProposer(NgramConfig(num_tokens=5))):
        engine = Engine(target, proposer)
        assert engine.max_seq_len <= target.config.max_position_embeddings
        prompt = ([9, 10, 11] * 100)[: engine.max_seq_len - 12]
        out = engine.generate(prompt, 12, GREEDY)
        assert out.output_ids == plain_engine.generate(prompt, 12, GREEDY).output_ids
        assert out.metrics.drafts > 0


# ---------------------------------------------------------------- bad input


def test_bad_input(target):
    engine = Engine(target, NgramProposer(NgramConfig()), max_seq_len=32)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    for bad in (0, -3):
        with pytest.raises(ValueError, match=f"max_new_tokens must be > 0, got {bad}"):
            engine.generate([1, 2, 3], bad, GREEDY)
    with pytest.raises(ValueError, match="empty prompt"):
        engine.generate([], 4, GREEDY)
    limit = engine.max_seq_len
    with pytest.raises(ValueError) as e:
        engine.generate([1] * (limit - 3), 4, GREEDY)
    msg = str(e.value)
    assert f"{limit - 3} tokens" in msg and "max_new_tokens=4" in msg and f"{limit} tokens" in msg
    assert len(engine.generate([1] * (limit - 3), 3, GREEDY).output_ids) == 3  # one fewer fits


def test_max_seq_len_is_capped_by_the_model(target):
    assert Engine(target, max_seq_len=10**6).max_seq_len == target.config.max_position_embeddings


# ---------------------------------------------------------------- prefix cache


def test_prefix_cache_hits_are_lossless_and_restore_drafter_state(target, noisy):
    a = PROMPTS[1] + PROMPTS[0][:2]  # 14 tokens: a hit covers 3 blocks of 4
    b = a[:8] + [100, 101, 102, 103, 104, 105]  # shares a's first 2 blocks
    c = PROMPTS[2]  # an unrelated prompt that overwrites both caches' first slots

    def cold(prompt):
        engine = Engine(target, DraftModelProposer(noisy, DraftChainConfig(3)), max_seq_len=MAX_SEQ)
        out = engine.generate(prompt, 12, GREEDY)
        return out, kv_prefix(engine, len(prompt)), engine.proposer.cache.read(0, len(prompt))

    pc = PrefixCache(block_size=4)
    engine = Engine(target, DraftModelProposer(noisy, DraftChainConfig(3)), prefix_cache=pc, max_seq_len=MAX_SEQ)
    first = engine.generate(a, 12, GREEDY)
    assert first.metrics.prefix_hit_tokens == 0 and first.metrics.prefix_queried_tokens == len(a)
    for prompt, hit in ((c, 0), (a, 12), (c, 16), (b, 8)):
        ref, ref_target_kv, ref_drafter_kv = cold(prompt)
        out = engine.generate(prompt, 12, GREEDY)
        assert out.metrics.prefix_hit_tokens == hit
        assert out.output_ids == ref.output_ids
        assert same_kv(kv_prefix(engine, len(prompt)), ref_target_kv)
        # a hit never leaves drafter state stale: the restored slots are those of a cold run ...
        assert same_kv(engine.proposer.cache.read(0, len(prompt)), ref_drafter_kv)
        # ... so the drafter proposes exactly what it would cold
        assert out.metrics.accepted_per_position == ref.metrics.accepted_per_position
        assert out.metrics.accepted_tokens == ref.metrics.accepted_tokens > 0
    assert pc.hit_tokens == 12 + 16 + 8


def test_prefix_cache_plain_engine(target, plain):
    pc = PrefixCache(block_size=4)
    engine = Engine(target, prefix_cache=pc, max_seq_len=MAX_SEQ)
    p = PROMPTS[2]
    for hit in (0, 16, 16):
        out = engine.generate(p, MAX_NEW, GREEDY)
        assert out.metrics.prefix_hit_tokens == hit
        assert out.output_ids == plain[tuple(p)][0].output_ids


# ---------------------------------------------------------------- sampling


def test_sampling_is_deterministic_given_a_seed(target, noisy):
    for proposer in (None, DraftModelProposer(noisy, DraftChainConfig(3)), NgramProposer(NgramConfig())):
        engine = Engine(target, proposer, max_seq_len=MAX_SEQ)
        runs = []
        for seed in (3, None, 3, 4):  # an unseeded request in between must not disturb the seeded ones
            runs.append(engine.generate(PROMPTS[3], 20, SamplingParams(temperature=1.0, seed=seed)).output_ids)
        assert runs[0] == runs[2], proposer
        assert runs[0] != runs[3]  # another seed, other tokens (20 tokens from a 128 vocabulary)


@pytest.mark.parametrize("device", DEVICES)
def test_sampling_runs_on_the_models_device(device, tiny_llama_dir):
    """The request's generator lives on the model's device, so every draw of a T > 0 step (the draft's,
    verification's, the bonus token's) must be made there: a draw elsewhere fails every sampled draft on a GPU."""
    tgt, drafter = load_model(tiny_llama_dir("llama"), torch.float32, device), load_noisy(tiny_llama_dir, device)
    engine = Engine(tgt, DraftModelProposer(drafter, DraftChainConfig(3)), max_seq_len=MAX_SEQ)
    runs = [engine.generate(PROMPTS[3], 20, SamplingParams(temperature=1.0, seed=s)) for s in (3, 3, 4)]
    assert runs[0].output_ids == runs[1].output_ids != runs[2].output_ids and len(runs[0].output_ids) == 20
    m = runs[0].metrics
    assert m.drafts == m.target_forward_passes and 0 < m.accepted_tokens < m.draft_tokens  # accepted and rejected


def test_unseeded_generate_leaves_the_global_rng_alone(target, noisy):
    for proposer in (None, DraftModelProposer(noisy, DraftChainConfig(3))):
        engine = Engine(target, proposer, max_seq_len=MAX_SEQ)
        torch.manual_seed(0)
        expected = torch.rand(4)
        torch.manual_seed(0)
        engine.generate(PROMPTS[0], 8, SamplingParams(temperature=1.0))
        assert torch.equal(torch.rand(4), expected)


SAMPLE = SamplingParams(temperature=1.0)


@pytest.fixture(scope="module")
def small(tiny_llama_dir):
    """Vocabulary-8 target and a different draft model, and the exact plain-sampling distribution of the
    first three tokens after SMALL_PROMPT: joint[a, b, c] = q(a) q(b | a) q(c | a, b) from the target's logits."""
    tgt = load_model(tiny_llama_dir("llama", **SMALL), torch.float32, "cpu")
    drf = load_model(tiny_llama_dir("llama", seed=1, **SMALL), torch.float32, "cpu")

    joint = exact_joint(tgt, SMALL_PROMPT, SAMPLE)
    assert torch.isclose(joint.sum(), torch.tensor(1.0, dtype=torch.float64))
    return tgt, drf, joint


def speculative_pvalues(small, n: int) -> tuple[float, float, float]:
    """n generations of 3 tokens with a draft model (k=2): x1 comes from the prefill, x2 and x3 from the
    speculative step(s). p-values of (x1, x2), (x2, x3) and (x1, x2, x3) against the exact distribution."""
    tgt, drf, joint = small
    engine = Engine(tgt, DraftModelProposer(drf, DraftChainConfig(2)), max_seq_len=16)
    draws, accepted = [], 0
    for i in range(n):
        out = engine.generate(SMALL_PROMPT, 3, SamplingParams(temperature=1.0, seed=10_000 + i))
        draws.append(out.output_ids)
        accepted += out.metrics.accepted_tokens
    assert 0.1 * n < accepted < 2 * n  # drafts get accepted and rejected: both branches ran
    return joint_pvalues(torch.tensor(draws), joint)


def test_speculative_sampling_matches_plain_distribution(small):
    pvalues = speculative_pvalues(small, 2000)
    assert min(pvalues) > ALPHA, pvalues


def test_speculative_sampling_with_a_draft_vocabulary_matches_plain_distribution(small, tiny_llama_dir):
    """A draft LM drafting over 6 of the 8 tokens (spec.draft_vocab): the other two still come out at the
    target's rates."""
    tgt, _, joint = small
    drf = load_model(tiny_llama_dir("llama", seed=1, **SMALL), torch.float32, "cpu")
    DraftModel.restrict_vocab(drf, torch.tensor([0, 1, 2, 4, 5, 7]))  # any Llama, as for a draft_model folder
    pvalues = speculative_pvalues((tgt, drf, joint), 2000)
    assert min(pvalues) > ALPHA, pvalues


def test_negative_control_biased_engine_is_caught(small, monkeypatch):
    """The same check on an engine whose verifier forgets the residual after a rejection fails."""
    monkeypatch.setattr(verify_mod, "residual", lambda q, x, p: q)
    p12, p23, p123 = speculative_pvalues(small, 2000)
    assert p12 < ALPHA and p23 < ALPHA, (p12, p23, p123)


# ---------------------------------------------------------------- static-shape step (the CUDA-graph form, run eagerly)


@pytest.mark.parametrize("name", [None, "ngram", "draft-noisy", "oracle-tree"])
def test_static_step_equals_dynamic_forward(name, target, other, noisy, plain):
    """cuda_graphs=eager runs serve/engine/graphs.py's static form (KV written at slot tensors, attention over the
    whole cache under a widened mask) on CPU: the outputs and the cache it leaves must equal plain decoding."""
    for p in PROMPTS[:3]:
        ref, ref_kv = plain[tuple(p)]
        if name == "oracle-tree":
            proposer = OracleTreeProposer(p + ref.output_ids, target.config.vocab_size)
        else:
            proposer = make_proposer(name, target, other, noisy) if name else None
        engine = Engine(target, proposer, max_seq_len=MAX_SEQ, cuda_graphs="eager")
        assert engine.static is not None and engine.static.mode == "eager"
        out = engine.generate(p, MAX_NEW, GREEDY)
        assert out.output_ids == ref.output_ids, (name, p)
        assert same_kv(kv_prefix(engine, len(p) + MAX_NEW - 1), ref_kv)


def test_static_step_modes(target):
    assert Engine(target, max_seq_len=MAX_SEQ).static is None  # auto on CPU: the dynamic forward
    with pytest.raises(ValueError, match="needs the target on a CUDA device"):
        Engine(target, max_seq_len=MAX_SEQ, cuda_graphs="graphs")
    with pytest.raises(ValueError, match="unknown static-step mode"):
        Engine(target, max_seq_len=MAX_SEQ, cuda_graphs="always")


@pytest.mark.parametrize("name", [None, "ngram"])
def test_a_failed_graph_capture_falls_back_to_the_eager_step(name, target, other, noisy, plain, monkeypatch):
    """A capture that raises (e.g. an op CUDA graphs cannot record) warns once, switches the step to eager for
    good and still answers that step: the output and the cache equal plain decoding. Capture is forced to
    fail, so this runs on CPU."""
    attempts = []

    def refuse(self, *args):
        attempts.append(args[0].numel())
        raise RuntimeError("capture refused")

    monkeypatch.setattr(graphs_mod.StaticStep, "capture", refuse)
    p = PROMPTS[0]
    ref, ref_kv = plain[tuple(p)]
    engine = Engine(
        target, make_proposer(name, target, other, noisy) if name else None, max_seq_len=MAX_SEQ, cuda_graphs="eager"
    )
    engine.static.mode = "graphs"  # as on a GPU, where make_static_step picks it
    with pytest.warns(UserWarning, match="CUDA graph capture failed .*capture refused.*runs eagerly"):
        out = engine.generate(p, MAX_NEW, GREEDY)
    assert out.output_ids == ref.output_ids
    assert same_kv(kv_prefix(engine, len(p) + MAX_NEW - 1), ref_kv)
    assert len(attempts) == 1 and engine.static.mode == "eager" and not engine.static.graphs


def test_full_mask_widens_the_engine_mask():
    decode = full_mask(None, 3, 1, 6, "cpu")
    assert decode.tolist() == [[True, True, True, True, False, False]]
    tree = torch.tensor([[True, True, True, False], [True, True, False, True]])  # start 2, two siblings
    wide = full_mask(tree, 2, 2, 6, "cpu")
    assert wide.shape == (2, 6) and wide[:, :4].equal(tree) and not wide[:, 4:].any()
