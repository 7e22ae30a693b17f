"""eval/cross_engine.py: every engine's steps recounted as draftsmith's engine counts them (checked against the
engine itself on a tiny target), the paired τ comparison that fails the cross-engine report (it must find a
position where two arms part, and must not where they are the same), and the report's table."""

from __future__ import annotations

import pytest
import torch

from draftsmith.eval.cross_engine import Arm, Record, arm_row, identical, markdown, recount, tau_difference
from draftsmith.eval.stats import Bootstrap
from draftsmith.serve.engine.engine import Engine
from draftsmith.serve.engine.metrics import Metrics
from draftsmith.serve.engine.sampling import SamplingParams
from draftsmith.serve.engine.tree import DraftTree
from draftsmith.serve.models.loader import load_model
from draftsmith.serve.proposers.base import Proposer

pytestmark = pytest.mark.usefixtures("one_thread")


def test_recount_cuts_what_falls_past_the_output():
    # 8 tokens: the prefill's, then 3 drafted+3 accepted (+1), 3+0 (+1), then 2 tokens left: 2 of 3 drafted count
    m = recount([(3, 3), (0, 3), (3, 3), (1, 3)], tokens=8, prompt_s=0.5, total_s=2.0)
    assert (m.drafts, m.draft_tokens, m.accepted_tokens) == (3, 3 + 3 + 2, 3 + 0 + 2)
    assert m.accepted_per_position == [2, 2, 1] and m.mean_acceptance_length == pytest.approx(1 + 5 / 3)
    assert (m.new_tokens, m.ttft_s, m.total_s) == (8, 0.5, 2.0)
    # a step left with one token to emit drafted nothing that could be output: not a draft (vLLM drafts it anyway)
    assert recount([(0, 3), (3, 3)], tokens=2, prompt_s=0, total_s=1).drafts == 1
    assert recount([], tokens=5, prompt_s=0, total_s=1).mean_acceptance_length == 1.0
    # a step without a draft (0, 0) still emits a token: the next step has one fewer left
    m = recount([(3, 3), (0, 0), (3, 3)], tokens=7, prompt_s=0, total_s=1)
    assert (m.drafts, m.draft_tokens, m.accepted_tokens, m.target_forward_passes) == (2, 4, 4, 3)


class Oracle(Proposer):
    """Drafts k tokens of the target's own greedy continuation, whatever the budget (as vLLM drafts, past the
    end too), spoiling the second draft every third step so that acceptance varies; records every step's
    (accepted, drafted) as the engine verified them, before any cut."""

    max_tree_size = 3

    def __init__(self, prompt_len: int, greedy: list[int]) -> None:
        self.prompt_len, self.greedy, self.steps = prompt_len, greedy, []

    def propose(self, tokens, sp, budget):
        i = len(tokens) - self.prompt_len  # output tokens so far, the pending one included
        draft = list(self.greedy[i : i + 3])
        if len(self.steps) % 4 == 2:  # now and then no draft at all
            draft = []
        if len(self.steps) % 3 == 1 and len(draft) > 1:
            draft[1] = (draft[1] + 1) % 128
        return DraftTree.chain(torch.tensor(draft)) if draft else DraftTree.empty(tokens.device)

    def accept(self, tokens, tree, path, out) -> None:
        self.steps.append((len(path), len(tree)))  # (0, 0): a step without a draft


def test_recount_matches_draftsmiths_engine(tiny_llama_dir):
    """The engine's own Metrics (which count only what falls inside the output) equal the recount of what its
    steps drafted and accepted, uncut."""
    model = load_model(tiny_llama_dir("llama"), torch.float32, "cpu")
    prompt = [5, 6, 7, 8, 9]
    greedy = Engine(model, None, max_seq_len=128).generate(prompt, 40, SamplingParams()).output_ids
    for max_new in (2, 5, 9, 24):
        proposer = Oracle(len(prompt), greedy)
        g = Engine(model, proposer, max_seq_len=128).generate(prompt, max_new, SamplingParams())
        assert g.output_ids == greedy[:max_new]
        m, want = recount(proposer.steps, max_new, 0.0, 1.0), g.metrics
        assert (m.drafts, m.draft_tokens, m.accepted_tokens) == (want.drafts, want.draft_tokens, want.accepted_tokens)
        assert m.accepted_per_position == want.accepted_per_position
        assert max_new < 9 or 0 < want.accepted_tokens < want.draft_tokens  # partial acceptance was exercised


def arm(engine: str, method: str, per_prompt: list[list[tuple[int, int]]], tokens: int = 12) -> Arm:
    records = [
        Record(f"p{i}", recount(steps, tokens, 0.1, 1.0 + 0.1 * i), list(range(i, i + tokens)))
        for i, steps in enumerate(per_prompt)
    ]
    return Arm(engine, "fp32", method, records)


def test_tau_difference_finds_the_position_where_two_engines_part():
    rng = torch.Generator().manual_seed(0)
    steps = [[(int(torch.randint(0, 4, (1,), generator=rng)), 3) for _ in range(6)] for _ in range(30)]
    a, same = arm("A", "eagle3", steps), arm("B", "eagle3", steps)
    boot = Bootstrap.over([r.id for r in a.records], 0)
    agree = tau_difference(boot, a, same, 3)
    assert not agree.parts and agree.positions == [] and agree.tau_diff == 0.0
    # B never accepts a third token: τ lower, position 3 parts, positions 1 and 2 are the same
    cut = [[(min(x, 2), d) for x, d in s] for s in steps]
    b = arm("B", "eagle3", cut)
    p = tau_difference(boot, a, b, 3)
    assert p.parts and p.tau_diff > 0 and p.positions == [3]
    fewer = Arm("B", "fp32", "eagle3", b.records[:20])
    with pytest.raises(ValueError, match="ran other prompts"):  # an unpaired difference is no engines' difference
        tau_difference(boot, a, fewer, 3)


def test_rows_and_report():
    plain = arm("A", "plain", [[] for _ in range(4)])
    spec = arm("A", "eagle3 k=3", [[(3, 3), (3, 3), (3, 3)] for _ in range(4)])
    boot = Bootstrap.over([r.id for r in plain.records], 0)
    row = arm_row(boot, spec, plain, plain, 3)
    assert row["mean_acceptance_length"] == pytest.approx(4.0) and row["acceptance_rate_per_position"] == [1, 1, 1]
    assert row["identical_to_plain"] == (4, 4) and row["speedup"] == pytest.approx(1.0)
    assert arm_row(boot, plain, plain, plain, 3)["identical_to_plain"] is None
    assert identical(spec, arm("A", "plain", [[]] * 4, tokens=11)) == (0, 4)
    text = markdown([arm_row(boot, plain, plain, plain, 3), row], [tau_difference(boot, spec, spec, 3)], [], 3)
    assert "| A | fp32 | eagle3 k=3 |" in text and "4.000" in text and "→ agrees" in text
    assert isinstance(Metrics(), Metrics)
