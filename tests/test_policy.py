"""spec.verify=policy (serve/engine/policy.py): each step decides before drafting, from acceptance calibrated on what
the target accepted (serve/engine/calibration.py). On a tiny random target with scripted drafters: a drafter that
stops paying goes plain and probes, one that pays drafts every step, a lookup that pays is taken without asking the
drafter, and output stays plain decoding's throughout."""

from __future__ import annotations

import math

import pytest
import torch

from draftsmith.eval.calibration_report import own_cell
from draftsmith.serve.engine.calibration import BINS, Acceptance, calibration_error, node_key, reliability_add
from draftsmith.serve.engine.engine import Engine
from draftsmith.serve.engine.metrics import Metrics
from draftsmith.serve.engine.policy import REJUDGE, DraftPolicy
from draftsmith.serve.engine.sampling import SamplingParams
from draftsmith.serve.engine.tree import DraftTree
from draftsmith.serve.models.loader import load_model
from draftsmith.serve.proposers.base import Proposer
from draftsmith.serve.proposers.hybrid import HybridProposer
from draftsmith.serve.proposers.propose_ngram import NgramConfig, NgramProposer
from draftsmith.serve.spec import PolicyConfig, SpecConfig
from helpers import PROMPTS

GREEDY = SamplingParams()
NEW = 48
# made-up verify cost: a row costs 0.3 of a step, so a node pays when it is accepted more than about 30% of the time
COST = lambda rows: 1.0 + 0.3 * (rows - 1)  # noqa: E731

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target(tiny_llama_dir):
    return load_model(tiny_llama_dir("llama"), torch.float32, "cpu")


@pytest.fixture(scope="module")
def future(target) -> list[int]:
    """Prompt 0 and its plain greedy continuation."""
    out = Engine(target, max_seq_len=128).generate(PROMPTS[0], NEW, GREEDY)
    return [*PROMPTS[0], *out.output_ids]


class Scripted(Proposer):
    """Drafts a chain of the target's own continuation while right(length) holds, else tokens it never emits."""

    def __init__(self, future: list[int], right, depth: int = 3, lookup: bool = False, name: str = "scripted"):
        self.future, self.right, self.depth, self.by_lookup, self.name = future, right, depth, lookup, name
        self.max_tree_size, self.asked = depth, 0

    def propose(self, tokens, sp, budget) -> DraftTree:
        self.asked += 1
        n, k = tokens.numel(), min(self.depth, budget)
        good = self.future[n : n + k]
        chain = good if self.right(n) else [(t + 1) % 128 for t in good]
        if not chain:
            return DraftTree.empty()
        tree = DraftTree.chain(torch.tensor(chain))
        if self.by_lookup:
            tree.match_len = 3
        return tree


class Pair(Proposer):
    """A lookup and a drafter, as serve/proposers/hybrid.py pairs them: the policy chooses between its parts."""

    name = "pair"

    def __init__(self, lookup: Proposer, drafter: Proposer) -> None:
        self.lookup, self.drafter = lookup, drafter
        self.max_tree_size = lookup.max_tree_size + drafter.max_tree_size

    def parts(self) -> list[Proposer]:
        return [self.lookup, self.drafter]

    def prefill(self, tokens, start, out) -> None:
        self.lookup.prefill(tokens, start, out)
        self.drafter.prefill(tokens, start, out)


def run(target, proposer: Proposer, future: list[int], probe_every: int = 8) -> tuple[list[str], Metrics]:
    """Generate prompt 0 under the policy; each step's decision, in order, and the metrics."""
    engine = Engine(target, proposer, max_seq_len=128)
    engine.policy = DraftPolicy(COST, PolicyConfig(probe_every=probe_every))
    decisions: list[str] = []
    plan = engine.plan

    def spied(*args):
        p = plan(*args)
        decisions.append(p.decision)
        return p

    engine.plan = spied  # type: ignore[method-assign]
    out = engine.generate(PROMPTS[0], NEW, GREEDY)
    assert out.output_ids == future[len(PROMPTS[0]) :]  # the target's own output, whatever the policy chose
    return decisions, out.metrics


def test_a_drafter_that_pays_drafts_every_step_whole(target, future):
    decisions, m = run(target, Scripted(future, lambda n: True), future)
    assert "plain" not in decisions and decisions.count("whole") >= len(decisions) - 3, decisions
    assert m.mean_acceptance_length > 3


def test_a_drafter_that_stops_paying_goes_plain_and_probes(target, future):
    turn = len(PROMPTS[0]) + 12
    decisions, m = run(target, Scripted(future, lambda n: n < turn), future, probe_every=8)
    first_plain = decisions.index("plain")
    assert first_plain >= 4  # it drafted while its drafts paid
    late = decisions[first_plain + 4 :]
    assert late.count("plain") >= 0.8 * len(late)  # then stopped drafting
    assert 0 < m.probe_steps <= len(decisions) / 8 + 1  # and probed, at most once per probe_every steps
    runs = "".join("p" if d == "plain" else "x" for d in decisions[first_plain:]).split("x")
    assert max(len(r) for r in runs) <= 4 * 8  # never more than 4 x probe_every plain steps without a look


class Lagging(Scripted):
    """A scripted drafter whose draft takes `step` seconds, plus `per_token` for each token of steps it did not draft
    (what a head with a KV cache runs first, after such steps)."""

    def __init__(self, future: list[int], right, per_token: float, step: float = 0.05):
        super().__init__(future, right)
        self.per_token, self.step, self.last, self.seconds = per_token, step, 0, 0.0

    def propose(self, tokens, sp, budget) -> DraftTree:
        n = tokens.numel()
        self.seconds = self.step + self.per_token * (n - (self.last or n))
        self.last = n
        return super().propose(tokens, sp, budget)

    def prefill(self, tokens, start, out) -> None:
        self.last = tokens.numel()

    def accept(self, tokens, tree, path, out) -> None:
        if len(tree):  # it drafted this step: its next draft runs what the step added, as every draft does
            self.last = tokens.numel()


def lagging_run(target, drafter: Lagging, future: list[int]) -> tuple[list[str], DraftPolicy]:
    engine = Engine(target, drafter, max_seq_len=128)
    engine.policy = DraftPolicy(COST, PolicyConfig(probe_every=4))
    engine.clocked = lambda call: (call(), drafter.seconds)  # type: ignore[method-assign]
    decisions: list[str] = []
    plan = engine.plan
    engine.plan = lambda *args: (decisions.append((p := plan(*args)).decision), p)[1]  # type: ignore[method-assign]
    assert engine.generate(PROMPTS[0], NEW, GREEDY).output_ids == future[len(PROMPTS[0]) :]
    return decisions, engine.policy


@pytest.mark.parametrize("per_token", [0.0, 2.0])
def test_catching_up_after_steps_not_drafted_is_learnt_and_charged(per_token, target, future):
    """A draft after steps its drafter did not draft also catches up on them: that time is learnt per token skipped,
    apart from the draft time, and charged to the drafter judged after such steps (not after its own draft's step)."""
    right = lambda n: (n // 6) % 2 == 0  # noqa: E731  right and wrong in turns: plain runs, then drafts again
    decisions, policy = lagging_run(target, Lagging(future, right, per_token), future)
    assert "plain" in decisions and "probe" in decisions
    assert policy.catch_up_s[0] == pytest.approx(per_token) and policy.draft_s[(0, 3)] == pytest.approx(0.05)
    n = len(future) - 4
    policy.caught_up[0] = n - 5  # five tokens of steps it did not draft
    assert policy.catch_up_time(0, n) == pytest.approx(5 * per_token)
    policy.caught_up[0] = n  # its own draft's step: nothing to catch up on
    assert policy.catch_up_time(0, n) == 0.0


def test_catch_up_is_learnt_only_against_a_measured_depth_and_past_a_few_tokens():
    """A depth never measured has only a scaled guess of its draft time, and a jitter over one or two skipped tokens
    would be charged times a whole plain run: neither teaches a catch-up time."""
    policy = DraftPolicy(COST)
    policy.start([])
    chain = lambda k: DraftTree.chain(torch.arange(k))  # noqa: E731
    policy.caught_up[0] = 10
    policy.learn_draft_time(0, chain(3), 0.3, 10)  # depth 3, nothing skipped: its draft time
    policy.learn_draft_time(0, chain(1), 0.3, 17)  # depth 1 (scaled from depth 3: 0.1) after 7 skipped tokens
    policy.learn_draft_time(0, chain(3), 0.31, 19)  # depth 3 after 2 skipped tokens
    assert 0 not in policy.catch_up_s and policy.draft_s == {(0, 3): 0.3}
    policy.learn_draft_time(0, chain(3), 0.5, 29)  # depth 3 after 10 skipped tokens: 0.02 s a token
    assert policy.catch_up_s[0] == pytest.approx(0.02)


def test_a_plain_run_judges_its_drafter_every_fourth_step(target, future, monkeypatch):
    """Nothing is observed in a plain run: the drafter is judged again every REJUDGE-th step, not every step."""
    judged: list[int] = []
    best_depth = DraftPolicy.best_depth

    def counted(self, i, *args):
        judged.append(self.plain_run)
        return best_depth(self, i, *args)

    monkeypatch.setattr(DraftPolicy, "best_depth", counted)
    decisions, _ = run(target, Scripted(future, lambda n: False), future, probe_every=0)
    plain = decisions.count("plain")
    assert plain > 3 * REJUDGE and all(run % REJUDGE == 0 for run in judged)
    assert len(judged) <= len(decisions) - plain + plain // REJUDGE + 1


def test_probes_that_find_nothing_back_off_to_four_times_probe_every(target, future):
    decisions, _ = run(target, Scripted(future, lambda n: False), future, probe_every=2)
    start = decisions.index("plain")  # after its first drafts, judged at even odds
    assert set(decisions[start:]) == {"plain", "probe"}, decisions
    gaps = [len(r) for r in "".join("p" if d == "plain" else "x" for d in decisions[start:]).split("x")[:-1]]
    assert gaps[:3] == [2, 4, 8] and set(gaps[3:]) <= {8}, decisions


def test_a_longer_backoff_looks_less_often(target, future):
    engine = Engine(target, Scripted(future, lambda n: False), max_seq_len=128)
    engine.policy = DraftPolicy(COST, PolicyConfig(probe_every=2, probe_backoff=16))
    engine.generate(PROMPTS[0], NEW, GREEDY)
    assert engine.policy.wait == 32  # 2, 4, 8, 16, 32: backed off to 16 x probe_every
    with pytest.raises(ValueError, match="spec.policy.probe_backoff must be >= 1"):
        PolicyConfig(probe_backoff=0)


def test_the_wait_before_a_probe_goes_on_from_one_request_to_the_next(target, future):
    """A drafter that stopped paying is looked at once per wait across requests, not again early in each request."""
    engine = Engine(target, Scripted(future, lambda n: False), max_seq_len=128)
    engine.policy = DraftPolicy(COST, PolicyConfig(probe_every=2))
    engine.generate(PROMPTS[0], NEW, GREEDY)
    assert engine.policy.wait == 8  # backed off to 4 x probe_every
    for _ in range(3):
        m = engine.generate(PROMPTS[0], 12, GREEDY).metrics
        assert m.probe_steps <= 1 and m.plain_steps >= m.target_forward_passes - 1  # not at steps 2, 4 and 8 again


def test_a_request_whose_drafts_come_back_drafts_again(target, future):
    start = len(PROMPTS[0])
    bad = range(start + 4, start + 24)  # wrong for a stretch, then right again
    decisions, _ = run(target, Scripted(future, lambda n: n not in bad, depth=2), future, probe_every=4)
    assert "plain" in decisions and "plain" not in decisions[-6:], decisions


def test_probe_every_zero_never_probes(target, future):
    decisions, m = run(target, Scripted(future, lambda n: False), future, probe_every=0)
    assert m.probe_steps == 0 and decisions[8:].count("plain") >= len(decisions) - 10  # estimates only decay back


def test_a_lookup_that_pays_is_taken_and_the_drafter_is_not_asked(target, future):
    lookup = Scripted(future, lambda n: True, depth=4, lookup=True, name="lookup")
    drafter = Scripted(future, lambda n: False, depth=2, name="drafter")
    decisions, m = run(target, Pair(lookup, drafter), future)
    assert drafter.asked <= 2  # measured once (its first draft), then never worth asking
    assert lookup.asked == len(decisions) and "plain" not in decisions and decisions[-1] == "whole"
    seen = {k: sum(v[:BINS]) for k, v in m.calibration.items()}
    assert seen["lookup/1"] > 10 * seen.get("drafter/1", 0.1)  # estimates came from the part that drafted


def test_a_lookup_that_misses_is_cut_and_the_drafter_takes_over(target, future):
    lookup = Scripted(future, lambda n: False, depth=4, lookup=True, name="lookup")
    drafter = Scripted(future, lambda n: True, depth=3, name="drafter")
    decisions, m = run(target, Pair(lookup, drafter), future)
    assert drafter.asked >= len(decisions) - 4 and m.mean_acceptance_length > 2.5


def test_acceptance_learns_an_overconfident_drafter():
    """A drafter that says 0.95 and is right 30% of the time is estimated near 0.3 within a request, and a new request
    starts from what the engine learnt."""
    acc = Acceptance()
    key = node_key(0, False, 1, 0.95, 0)
    assert acc.rate(key) == pytest.approx(0.95)  # nothing seen: the drafter's own word
    hits = [bool(h) for h in torch.rand(200, generator=torch.Generator().manual_seed(0)) < 0.3]
    for h in hits:
        acc.tick()
        acc.observe(key, h)
    assert abs(acc.rate(key) - 0.3) < 0.15  # the drafter's word still weighs as 4 of ~50 decayed observations
    acc.start()
    assert abs(acc.rate(key) - sum(hits) / len(hits)) < 0.01  # pooled over the finished request


def test_estimates_forget_with_the_half_life():
    acc = Acceptance(prior_weight=1.0, half_life=4.0)
    key = node_key(0, False, 1, None, 0)
    for _ in range(40):
        acc.tick()
        acc.observe(key, True)
    for _ in range(40):
        acc.tick()
        acc.observe(key, False)
    assert acc.rate(key) < 0.1  # the recent misses dominate, not the 50/50 total


def test_nan_and_constant_probabilities_fall_back_to_observed_acceptance():
    nan, lookup = node_key(0, False, 2, math.nan, 0), node_key(0, False, 2, None, 3)
    assert nan[3] == 0 and lookup[3] == 2  # NaN: by depth alone; a lookup: by its match length
    assert node_key(0, False, 1, 0.5, 0) == node_key(0, False, 1, 0.55, 0)  # constant probabilities share one bin
    assert node_key(0, False, 1, 0.5, 0) != node_key(0, True, 1, 0.5, 0)  # greedy and sampled apart


def test_reliability_tables_and_the_expected_calibration_error():
    table: list[float] = []
    for p, hit in [(0.9, True), (0.9, True), (0.1, False), (0.1, False)]:
        table = reliability_add(table, p, hit)
    assert calibration_error(table) == pytest.approx(0.1)
    assert calibration_error([]) is None
    m, other = Metrics(), Metrics()
    m.record_estimate("eagle3", 1, 0.8, 0.95, True, settled=False)
    other.record_estimate("eagle3", 1, 0.6, None, False, settled=True)
    m.merge(other)
    assert sum(m.calibration["eagle3/1"][:BINS]) == 2 and sum(m.calibration["eagle3/1/settled"][:BINS]) == 1
    assert sum(m.calibration["eagle3/1/own"][:BINS]) == 1


def test_policy_settings_are_checked_when_built():
    with pytest.raises(ValueError, match="spec.policy.probe_every must be >= 0"):
        PolicyConfig(probe_every=-1)
    with pytest.raises(ValueError, match="spec.policy.half_life must be > 0"):
        PolicyConfig(half_life=0)
    with pytest.raises(ValueError, match="spec.verify must be one of fixed, cost, policy"):
        SpecConfig("ngram", verify="always")
    with pytest.raises(ValueError, match="spec.verify=policy decides what is drafted and spec=ar drafts nothing"):
        SpecConfig("ar", verify="policy")


class Wide(Scripted):
    """Drafts three siblings at depth 1, none of them the target's token: a top-k drafter that never pays."""

    def propose(self, tokens, sp, budget) -> DraftTree:
        self.asked += 1
        t = self.future[tokens.numel()]
        return DraftTree(torch.tensor([(t + j) % 128 for j in (1, 2, 3)]), torch.tensor([-1, -1, -1]))


def test_a_probe_of_a_top_k_drafter_verifies_one_node(target, future):
    decisions, m = run(target, Wide(future, lambda n: False, depth=1), future, probe_every=4)
    assert m.probe_steps >= 3
    assert sum(m.verify_rows[2:]) <= 1  # its first, full draft only: a probe sends the pending token and one node


class Empty(Scripted):
    def propose(self, tokens, sp, budget) -> DraftTree:
        self.asked += 1
        return DraftTree.empty()


def test_a_drafter_that_drafts_nothing_does_not_shut_out_a_lookup_that_pays(target, future):
    lookup = Scripted(future, lambda n: True, depth=4, lookup=True, name="lookup")
    _, m = run(target, Pair(lookup, Empty(future, lambda n: True, name="drafter")), future)
    assert m.mean_acceptance_length > 3


def test_the_drafters_own_probabilities_are_reported_within_0_and_1(target, future):
    class Overconfident(Scripted):
        def propose(self, tokens, sp, budget) -> DraftTree:
            tree = super().propose(tokens, sp, budget)
            tree.accept_probs = torch.full((len(tree),), 3.0)
            return tree

    _, m = run(target, Overconfident(future, lambda n: True), future)
    for key, table in m.calibration.items():
        if key.endswith("/own"):
            assert all(table[BINS + b] <= table[b] for b in range(BINS))  # each bin's mean at most 1
            assert calibration_error(table) <= 1.0


def test_an_eval_repeat_starts_the_policy_cold(target, future):
    engine = Engine(target, Scripted(future, lambda n: True), max_seq_len=128)
    engine.policy = DraftPolicy(COST)
    engine.generate(PROMPTS[0], 8, GREEDY)
    assert engine.policy.acceptance.tally and engine.policy.draft_s
    engine.forget()
    assert not engine.policy.acceptance.tally and not engine.policy.draft_s and not engine.policy.last


def test_estimates_are_reported_beside_a_whole_draft_and_decide_nothing(target, future):
    """spec.policy.report_estimates: a fixed-verify run keeps the policy's estimates for the calibration report, past
    the first 32 steps too, and drafts and emits what it would without them."""
    right = lambda n: n % 4 == 0  # noqa: E731  (some drafts right, most wrong: over 32 steps, both outcomes seen)
    plain = Engine(target, Scripted(future, right, depth=1), max_seq_len=128).generate(PROMPTS[0], NEW, GREEDY)
    engine = Engine(target, Scripted(future, right, depth=1), max_seq_len=128)
    engine.estimates = Acceptance()
    out = engine.generate(PROMPTS[0], NEW, GREEDY)
    assert out.output_ids == plain.output_ids == future[len(PROMPTS[0]) :]
    assert out.metrics.drafts == plain.metrics.drafts and plain.metrics.calibration == {}
    table, settled = out.metrics.calibration["scripted/1"], out.metrics.calibration["scripted/1/settled"]
    assert sum(table[:BINS]) == out.metrics.drafts and 0 < sum(settled[:BINS]) < sum(table[:BINS])
    assert 0 < sum(table[2 * BINS :]) < sum(table[:BINS])  # hits and misses both counted
    engine.forget()
    assert not engine.estimates.tally and not engine.estimates.pooled and engine.accept_s == 0.0


def test_estimates_beside_a_paired_lookup_or_no_drafter_are_refused():
    estimates = PolicyConfig(report_estimates=True)
    with pytest.raises(ValueError, match="reported part by part under spec.verify=policy"):
        SpecConfig("eagle3", drafter="x", ngram_tokens=5, policy=estimates)
    with pytest.raises(ValueError, match="spec=ar drafts nothing"):
        SpecConfig("ar", policy=estimates)
    SpecConfig("eagle3", drafter="x", ngram_tokens=5, verify="policy", policy=estimates)  # the policy reports anyway


def test_merge_is_refused_under_the_policy():
    with pytest.raises(ValueError, match="set spec.ngram_policy=prefer, or spec.verify=cost to keep merge"):
        SpecConfig("eagle3", drafter="x", ngram_tokens=5, ngram_policy="merge", verify="policy")


def test_the_report_says_when_a_drafter_is_judged_by_observed_acceptance_alone():
    constant: list[float] = []
    for _ in range(20):
        constant = reliability_add(constant, 0.5, True)
    assert "judged by observed acceptance alone" in own_cell([])  # NaN or no probabilities
    assert "all in one bin: judged by observed acceptance alone" in own_cell(constant)
    spread = reliability_add(list(constant), 0.9, True)
    assert own_cell(spread) == f"{calibration_error(spread):.3f}"


def test_a_lookup_that_finds_nothing_does_not_back_the_probes_off(target, future):
    engine = Engine(target, Empty(future, lambda n: True, lookup=True, name="lookup"), max_seq_len=128)
    engine.policy = DraftPolicy(COST, PolicyConfig(probe_every=4))
    m = engine.generate(PROMPTS[0], 24, GREEDY).metrics
    assert m.plain_steps == m.target_forward_passes and engine.policy.wait == 4  # nothing was probed


def test_a_first_request_too_short_for_the_drafters_shape_does_not_cap_its_depth(target, future):
    """A draft cut short by the request's budget says nothing of how deep the drafter goes: a longer request
    drafts its whole shape again (draftsmith-serve's warm-up is such a short request)."""
    engine = Engine(target, Scripted(future, lambda n: True, depth=4), max_seq_len=128)
    engine.policy = DraftPolicy(COST, PolicyConfig(probe_every=8))
    engine.generate(PROMPTS[0], 3, GREEDY)  # budget 2: a 2-deep draft
    m = engine.generate(PROMPTS[0], 40, GREEDY).metrics
    assert len(m.accepted_per_position) == 4 and m.mean_acceptance_length > 4


def test_an_empty_probe_resets_the_wait_and_counts_once_per_wait(target, future):
    decisions, m = run(target, Empty(future, lambda n: True), future, probe_every=4)
    assert m.probe_steps <= len(decisions) // 5 + 1, decisions  # not every step once the first probe came up empty


class Benchable(Scripted):
    """A scripted drafter that keeps, per request, whether its prefill was told to sit the request out and how often
    it was asked to draft."""

    mergeable = True  # as an EAGLE head is: serve/proposers/hybrid.py pairs it with a lookup

    def __init__(self, future: list[int], right) -> None:
        super().__init__(future, right)
        self.requests: list[tuple[bool, int]] = []  # (benched at prefill, drafts asked so far)
        self.told = 0  # steps whose outcome it was told (accept)
        self.told_before: list[int] = []  # per request: steps told before its prefill

    def prefill(self, tokens, start, out) -> None:
        self.requests.append((self.benched, self.asked))
        self.told_before.append(self.told)

    def accept(self, tokens, tree, path, out) -> None:
        self.told += 1


def requests_run(target, drafter: Proposer, future: list[int], n: int, engine: Engine | None = None, **policy):
    """n requests of prompt 0 on one engine (a new one with the policy's settings where none is given)."""
    if engine is None:
        engine = Engine(target, drafter, max_seq_len=128)
        engine.policy = DraftPolicy(COST, PolicyConfig(probe_every=4, **policy))
    outs = [engine.generate(PROMPTS[0], 24, GREEDY) for _ in range(n)]
    assert all(o.output_ids == future[len(PROMPTS[0]) :][:24] for o in outs)
    return engine, [o.metrics for o in outs]


def test_a_drafter_idle_for_two_requests_sits_requests_out_and_is_attached_every_eighth(target, future):
    drafter = Benchable(future, lambda n: False)
    _, metrics = requests_run(target, drafter, future, 24)
    benched = [b for b, _ in drafter.requests]
    first = benched.index(True)
    assert 2 <= first <= 3 and not any(benched[:first])  # its first draft, then two attached requests of probes
    assert benched[first:] == ([True] * 7 + [False]) * 2 + [True] * (len(benched) - first - 16)
    asked = [a for _, a in drafter.requests] + [drafter.asked]
    told = [*drafter.told_before, drafter.told]
    for i, sat_out in enumerate(benched):
        # no step of a request it sat out asked it anything or told it anything: those steps are plain decoding's
        assert (asked[i + 1] == asked[i] and told[i + 1] == told[i]) if sat_out else told[i + 1] > told[i]
    assert [m.drafters_benched for m in metrics] == [int(b) for b in benched]
    assert all(m.plain_steps == m.target_forward_passes for m, b in zip(metrics, benched, strict=True) if b)


def test_a_drafter_attached_again_for_a_request_with_no_step_stays_attached_for_the_next(target, future):
    """The request that was to probe it ended at its first token: it said nothing, so the next one probes it."""
    drafter = Benchable(future, lambda n: False)
    engine, _ = requests_run(target, drafter, future, 4)
    assert drafter.requests[-1][0]  # sitting out by now
    for _ in range(8):  # one-token requests, none running a step, until its attach_every-th attaches it
        engine.generate(PROMPTS[0], 1, GREEDY)
        if not drafter.requests[-1][0]:
            break
    assert not drafter.requests[-1][0]
    engine.generate(PROMPTS[0], 24, GREEDY)
    assert not drafter.requests[-1][0]  # attached again, and probed there


def test_a_drafter_that_pays_never_sits_a_request_out(target, future):
    drafter = Benchable(future, lambda n: True)
    requests_run(target, drafter, future, 6)
    assert not any(b for b, _ in drafter.requests)


def test_bench_after_zero_keeps_every_drafter_attached(target, future):
    drafter = Benchable(future, lambda n: False)
    requests_run(target, drafter, future, 8, bench_after=0)
    assert not any(b for b, _ in drafter.requests)


def test_a_benched_drafter_whose_drafts_pay_again_comes_back_at_its_next_attached_request(target, future):
    good = [False]
    drafter = Benchable(future, lambda n: good[0])
    engine, _ = requests_run(target, drafter, future, 4)
    assert drafter.requests[-1][0]  # sitting out by now
    good[0] = True
    requests_run(target, drafter, future, 16, engine)
    benched = [b for b, _ in drafter.requests[4:]]
    back = benched.index(False)  # its next attached request: its probes pay, it drafts, and it stays
    assert back <= 7 and not any(benched[back:])


def test_a_lookup_never_sits_out_and_a_benched_drafter_leaves_it_the_steps(target, future):
    lookup, drafter = Scripted(future, lambda n: True, lookup=True), Benchable(future, lambda n: False)
    requests_run(target, Pair(lookup, drafter), future, 6)
    assert drafter.requests[-1][0] and not lookup.benched and lookup.asked > 0


def test_a_paired_drafter_sitting_a_request_out_is_told_nothing_while_its_lookup_drafts(target, future):
    """serve/proposers/hybrid.py: the lookup hears every step; the benched drafter, none of the request's."""
    drafter = Benchable(future, lambda n: False)
    lookup = NgramProposer(NgramConfig(num_tokens=3))
    _, metrics = requests_run(target, HybridProposer(drafter, lookup), future, 8)
    told = [*drafter.told_before, drafter.told]
    for i, (sat_out, _) in enumerate(drafter.requests):
        assert (told[i + 1] == told[i]) if sat_out else told[i + 1] > told[i]
    assert drafter.requests[-1][0] and sum(m.accepted_tokens for m in metrics[-3:]) > 0  # the lookup drafted


def test_requests_that_end_before_a_step_say_nothing_of_a_drafters_worth(target, future):
    drafter = Benchable(future, lambda n: True)
    engine = Engine(target, drafter, max_seq_len=128)
    engine.policy = DraftPolicy(COST, PolicyConfig(probe_every=4))
    for new in (24, 1, 1, 1, 24, 24):
        engine.generate(PROMPTS[0], new, GREEDY)
    assert not any(b for b, _ in drafter.requests)


def test_a_new_drafter_or_no_policy_starts_attached(target, future):
    drafter = Benchable(future, lambda n: False)
    engine, _ = requests_run(target, drafter, future, 4)
    assert drafter.requests[-1][0]
    fresh = Benchable(future, lambda n: True)
    engine.replace_proposer(fresh, "v2")
    requests_run(target, fresh, future, 3, engine)
    assert not any(b for b, _ in fresh.requests)
    engine.replace_proposer(drafter, "v1")
    for _ in range(12):  # benched again once its requests say so
        if drafter.benched:
            break
        requests_run(target, drafter, future, 1, engine)
    assert drafter.benched
    engine.policy = None
    requests_run(target, drafter, future, 1, engine)
    assert not drafter.requests[-1][0]  # drafted every step again, its prefill run eagerly
