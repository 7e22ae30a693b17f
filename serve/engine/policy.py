"""spec.verify=policy: decide before drafting. Each step picks what to draft and verify, or a plain step, by expected
emitted tokens per second of step.

The proposer's parts (serve/proposers/base.py `parts`: a drafter, or a lookup and a drafter) are judged two ways. A
lookup (n-gram, suffix) costs next to nothing to draft, so it drafts first and its draft itself is judged. A drafter
that costs a forward per level is judged before it drafts, at each depth, by what its last draft would be worth cut
to that depth at today's calibrated estimates (its deeper levels from its last draft that deep): expected emitted
tokens and verify rows, against its measured draft time there. The best of plain, each lookup draft and each drafter
at each depth is taken. A draft is cut to the nodes that pay, as spec.verify=cost cuts (serve/engine/draft_cut.py), by
calibrated estimates (serve/engine/calibration.py) instead of the drafter's own probabilities.

A request whose drafts stop paying goes plain; within a plain run the drafters are judged again every REJUDGE-th step
(nothing is observed meanwhile, so the decision holds), and a plain step costs next to nothing. After `probe_every`
plain steps in a row it probes: the lookup's first node if one drafted, else the cheapest drafter's first node (its
whole first level where it samples its draft). A probe that does not bring drafting back doubles the wait for the
next, up to `probe_backoff` x `probe_every` (B x P); a draft worth making resets it. So probing costs at most one
draft level and one verify row per P + 1 steps, one per B x P + 1 while requests stay plain (the plain run and the
wait go on from one request to the next), and a request whose acceptance comes back is drafting again within B x P + 1
steps. Likewise a drafter drafting short of its deepest goes one level deeper every
`probe_every`-th draft, so deeper levels that came to pay are found.

A drafter that drafted nothing but probes in `bench_after` attached requests in a row sits whole requests out: no
step asks it or tells it what was accepted, and its prefill keeps the target's features and leaves its own forward to
a later draft, so it costs a request next to nothing. Where every drafter sits out (no lookup beside them) the
engine does not ask the policy either: the request's steps are plain decoding's. Every `attach_every`-th request it
is attached again, and its probes there, due from its first plain step, say whether it pays again; a draft worth
making brings it back for good.

Estimates are kept apart for greedy and sampled requests (a sampled draft is accepted less often). Draft times are
learnt from drafts that follow a step the same drafter drafted: the first draft after other steps also runs the
drafter over the tokens it skipped (serve/proposers/propose_eagle.py), which a later draft does not pay. That
catch-up is learnt apart, per token skipped, and charged to a drafter judged after steps it did not draft: a head
left out for a plain run costs more to bring back than its draft time says.

Lossless as the cost cut is: whether a step drafts, and how deep, depends on earlier steps only; a drawn (sampled)
draft is cut by whole levels, level d by what the levels above it say (draft_cut.stopped_levels).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TypeVar

import torch
from torch import Tensor

from draftsmith.serve.engine.calibration import Acceptance, Key, node_key
from draftsmith.serve.engine.draft_cut import Cost, best_levels, best_subset, path_probs, stopped_levels
from draftsmith.serve.engine.metrics import Metrics
from draftsmith.serve.engine.sampling import SamplingParams
from draftsmith.serve.engine.tree import DraftTree
from draftsmith.serve.proposers.base import Proposer
from draftsmith.serve.spec import PolicyConfig

T = TypeVar("T")
Timed = Callable[[Callable[[], T]], tuple[T, float]]  # runs a call, returns its result and seconds
SETTLED = 32  # request steps after which its estimates count as settled (the calibration report's second table)
EMA = 0.2  # weight of the newest draft time
REJUDGE = 4  # a plain run judges its drafters again every this many steps
# tokens skipped below which a draft teaches no catch-up time: a jitter of the draft time, divided by one or two
# tokens, would be charged times a whole plain run
CATCH_UP_MIN = 4


@dataclass
class Plan:
    """One step's decision: what the chosen part drafted (empty: a plain step) and which of its nodes are verified."""

    tree: DraftTree
    kept: Tensor | None = None  # node indices verified (ascending); None: all
    part: int = -1  # the part that drafted it (-1: none)
    seconds: float = 0.0  # drafting, every part asked
    decision: str = "plain"  # plain | whole | cut | probe
    keys: list[Key] = field(default_factory=list)  # per node: what its estimate pools with
    estimates: list[float] = field(default_factory=list)  # per node: its estimated acceptance given its parent's
    own: list[float | None] = field(default_factory=list)  # per node: the drafter's own probability, where finite
    name: str = ""  # the part's name (the calibration report's)

    @property
    def verifies_nothing(self) -> bool:
        return self.part < 0 or not len(self.tree) or self.kept is not None and not len(self.kept)

    @property
    def deepest(self) -> int:
        return max(self.tree.depth_list, default=0)


@dataclass
class DraftPolicy:
    cost: Cost
    cfg: PolicyConfig = field(default_factory=PolicyConfig)
    acceptance: Acceptance = field(init=False)
    draft_s: dict[tuple[int, int], float] = field(init=False)  # (part, depth) -> seconds to draft
    last: dict[int, Plan] = field(init=False)  # part -> its last draft
    deep: dict[int, Plan] = field(init=False)  # part -> its last draft as deep as any it made
    # parts whose deepest draft stopped short of the depth asked (or was empty): as deep as they draft
    full: set[int] = field(init=False)
    shallow_run: dict[int, int] = field(init=False)  # part -> drafts in a row below its deepest
    plain_run: int = 0  # plain steps in a row
    previous: int = -1  # the part that drafted the last step (-1: none)
    wait: int = 0  # plain steps in a row before the next probe
    catch_up_s: dict[int, float] = field(init=False)  # drafter part -> seconds per token it skipped, to catch up
    # drafter part (not a lookup: nothing to catch up) -> the request's length after its last draft's step
    caught_up: dict[int, int] = field(init=False)
    # across requests, per drafter part: attached requests in a row without a draft but probes, and requests sat out
    idle: dict[int, int] = field(init=False)
    sat_out: dict[int, int] = field(init=False)
    benched: set[int] = field(init=False)  # drafter parts sitting this request out
    attached: set[int] = field(init=False)  # drafter parts attached to it
    drafted: set[int] = field(init=False)  # drafter parts that made a draft in it (not a probe)
    empties: dict[str, DraftTree] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.forget()

    def forget(self) -> None:
        """Back to knowing nothing: no estimate, draft time or draft of earlier requests (an eval's repeats each
        start cold)."""
        self.acceptance = Acceptance(self.cfg.prior_weight, self.cfg.half_life)
        self.draft_s, self.last, self.deep, self.shallow_run, self.full = {}, {}, {}, {}, set()
        self.plain_run, self.previous, self.wait = 0, -1, self.cfg.probe_every
        self.catch_up_s, self.caught_up = {}, {}
        self.attach_all()

    def attach_all(self) -> None:
        """Forget what earlier requests said of each drafter's worth: every drafter is attached to the next request."""
        self.idle, self.sat_out, self.benched, self.attached, self.drafted = {}, {}, set(), set(), set()

    def start(self, parts: list[Proposer]) -> set[int]:
        """A new request: its estimates start from the engine's. The plain run and the wait before the next probe go
        on from the last request's: a drafter that stopped paying is looked at once per wait, not once per request.
        Returns the drafter parts that sit this request out, idle for bench_after attached requests."""
        self.bench([i for i, part in enumerate(parts) if not part.by_lookup], stepped=self.acceptance.step > 0)
        self.acceptance.start()
        self.previous = -1
        self.caught_up = {}  # each drafter's prefill runs the prompt: caught up at the request's first step
        return self.benched

    def bench(self, drafters: list[int], stepped: bool) -> None:
        """Which drafters sit the new request out, from the requests before it. stepped: whether the last request ran
        a step (one that ended at its first token says nothing of its drafters, so those it attached stay attached)."""
        if self.attached and not stepped:
            return
        for i in self.attached:
            self.idle[i] = 0 if i in self.drafted else self.idle.get(i, 0) + 1
        after, every = self.cfg.bench_after, self.cfg.attach_every
        self.benched = {
            i for i in drafters if after and self.idle.get(i, 0) >= after and self.sat_out.get(i, 0) < every - 1
        }
        if any(self.sat_out.get(i, 0) for i in drafters if i not in self.benched):
            # attached again: its probes decide, from the first plain step on (the steps of a request every drafter
            # sat out do not ask the policy, so they never counted toward the wait)
            self.plain_run = max(self.plain_run, self.wait)
        self.sat_out = {i: self.sat_out.get(i, 0) + 1 if i in self.benched else 0 for i in drafters}
        self.attached, self.drafted = set(drafters) - self.benched, set()

    def plan(self, parts: list[Proposer], tokens: Tensor, sp: SamplingParams, budget: int, timed: Timed) -> Plan:
        self.acceptance.tick()
        empty = Plan(self.empty_tree(tokens.device))
        spent, best, best_rate = 0.0, empty, 0.0
        found: Plan | None = None  # a lookup's draft, for a probe
        for i, part in enumerate(parts):
            if part.by_lookup:
                tree, s = timed(lambda part=part: part.propose(tokens, sp, budget))  # type: ignore[misc]
                spent += s
                if len(tree):
                    candidate, rate = self.judge(i, tree, spent, sp)
                    found = found or candidate
                    if rate > best_rate:
                        best, best_rate = candidate, rate
        plain_rate = 1.0 / (spent + self.cost(1))
        if best_rate <= plain_rate:
            best, best_rate = empty, plain_rate
        chosen: tuple[int, int] | None = None  # (part, depth) of a drafter worth drafting
        n = tokens.numel()
        for i, part in enumerate(parts):
            if part.by_lookup or i in self.benched:
                continue
            self.caught_up.setdefault(i, n)
            if self.rejudged():
                depth, rate = self.best_depth(i, budget, spent + self.catch_up_time(i, n), sp)
                if rate > best_rate:
                    chosen, best_rate = (i, depth), rate
        if chosen is not None:
            best = self.draft(parts, self.deeper_now_and_then(*chosen), tokens, sp, budget, spent, timed)
        elif best.part < 0 and self.probe_due():
            best = self.probe(parts, found, tokens, sp, spent, timed)
            if best.decision == "probe":  # back to probe_every once drafting pays
                self.wait = min(2 * self.wait, self.cfg.probe_backoff * self.cfg.probe_every)
        if best.decision != "probe" and not best.verifies_nothing:
            self.wait = self.cfg.probe_every
            if best.part in self.attached:
                self.drafted.add(best.part)
        best.seconds = max(best.seconds, spent)
        best.name = parts[best.part].name if best.part >= 0 else ""
        self.plain_run = self.plain_run + 1 if best.verifies_nothing and best.decision != "probe" else 0
        self.previous = best.part
        return best

    def empty_tree(self, device: torch.device) -> DraftTree:
        """One empty tree per device for every plain step (nothing reads it but to see it is empty)."""
        tree = self.empties.get(str(device))
        if tree is None:
            tree = self.empties[str(device)] = DraftTree.empty(device)
        return tree

    def draft(
        self,
        parts: list[Proposer],
        chosen: tuple[int, int],
        tokens: Tensor,
        sp: SamplingParams,
        budget: int,
        spent: float,
        timed: Timed,
    ) -> Plan:
        i, depth = chosen
        tree, s = timed(lambda: parts[i].propose(tokens, sp, min(budget, depth)))
        self.learn_draft_time(i, tree, s, tokens.numel())
        plan, _ = self.judge(i, tree, spent + s, sp)
        self.remember(i, plan, min(budget, depth))
        return plan

    def probe(
        self,
        parts: list[Proposer],
        found: Plan | None,
        tokens: Tensor,
        sp: SamplingParams,
        spent: float,
        timed: Timed,
    ) -> Plan:
        """The cheapest look at whether drafting pays again: a lookup's first node, else a drafter's first node (its
        first level where it draws the draft: which of its siblings is verified must not depend on their draws)."""
        first = torch.zeros(1, dtype=torch.long, device=tokens.device)
        if found is not None:
            return replace(found, kept=first, seconds=spent, decision="probe")
        drafters = [i for i, part in enumerate(parts) if not part.by_lookup and i not in self.benched]
        if not drafters:
            return Plan(self.empty_tree(tokens.device))
        i = min(drafters, key=lambda j: self.time_at(j, 1))
        tree, s = timed(lambda: parts[i].propose(tokens, sp, 1))
        self.learn_draft_time(i, tree, s, tokens.numel())
        kept = None if tree.draft_probs is not None or len(tree) <= 1 else first
        plan = Plan(tree, kept, i, spent + s, "probe", *self.estimate(i, tree, sp))
        self.remember(i, plan, 1)
        return plan

    def deeper_now_and_then(self, i: int, depth: int) -> tuple[int, int]:
        """Every probe_every-th draft below drafter i's deepest goes one level deeper, so what the deeper levels are
        worth is measured again: they may have come to pay."""
        if depth >= self.deepest(i) or not self.cfg.probe_every:
            return i, depth
        self.shallow_run[i] = self.shallow_run.get(i, 0) + 1
        if self.shallow_run[i] < self.cfg.probe_every:
            return i, depth
        self.shallow_run[i] = 0
        return i, depth + 1

    def rejudged(self) -> bool:
        """Whether this step judges the drafters again: every step but within a plain run, every REJUDGE-th (nothing
        is observed in a plain run, and the estimates only decay toward the engine's, so a decision holds)."""
        return self.plain_run % REJUDGE == 0

    def probe_due(self) -> bool:
        return self.cfg.probe_every > 0 and self.plain_run >= self.wait

    def judge(self, i: int, tree: DraftTree, spent: float, sp: SamplingParams) -> tuple[Plan, float]:
        """Part i's draft cut to the nodes worth their rows by calibrated estimates, and its expected rate."""
        keys, estimates, own = self.estimate(i, tree, sp)
        P, depths = path_probs(tree.parent_list, estimates), tree.depth_list
        keep = self.cut(P, depths, spent, sp.greedy, tree.draft_probs is not None)
        rate = (1.0 + sum(P[k] for k in keep)) / (spent + self.cost(1 + len(keep)))
        whole = len(keep) == len(tree)
        kept = None if whole else torch.tensor(keep, dtype=torch.long, device=tree.tokens.device)
        return Plan(tree, kept, i, spent, "whole" if whole else "cut", keys, estimates, own), rate

    def cut(self, P: list[float], depths: list[int], spent: float, greedy: bool, drawn: bool) -> list[int]:
        if greedy:
            return best_subset(P, self.cost, spent)
        if not drawn:
            return best_levels(P, depths, self.cost, spent)
        return stopped_levels(P, depths, self.cost, spent)

    def estimate(
        self, i: int, tree: DraftTree, sp: SamplingParams
    ) -> tuple[list[Key], list[float], list[float | None]]:
        return estimate(self.acceptance, i, tree, sp)

    def remember(self, i: int, plan: Plan, asked: int) -> None:
        """Drafter i's draft, asked `asked` levels deep, to judge its next one before drafting (an empty draft: worth
        nothing). A draft as deep as asked may not be as deep as the drafter goes (the request's budget, or a probe,
        asked less): until one stops short, a budget past it drafts the whole shape again."""
        self.last[i], before = plan, self.deepest(i)
        if plan.deepest >= before:
            self.deep[i] = plan
        if plan.deepest < asked or not plan.deepest:  # it stopped on its own (or drafted nothing): no need to ask more
            self.full.add(i)
        elif plan.deepest > before:  # deeper than ever, and as deep as asked: it may go deeper still
            self.full.discard(i)

    def deepest(self, i: int) -> int:
        """The deepest draft drafter i made."""
        return self.deep[i].deepest if i in self.deep else 0

    def best_depth(self, i: int, budget: int, spent: float, sp: SamplingParams) -> tuple[int, float]:
        """The depth at which drafter i's expected rate is best, and that rate. A drafter not yet seen at its whole
        shape drafts it once, so its depth, time and worth get measured."""
        if i not in self.last or i not in self.full and budget > self.deepest(i):
            return budget, math.inf
        last, deep = self.last[i], self.deep[i]
        today = {id(p): self.path_probs_now(p) for p in (last, deep)}
        best, best_rate = 0, 0.0
        for d in range(1, min(deep.deepest, budget) + 1):
            source = last if last.deepest >= d else deep
            gain, rows = self.worth(source, today[id(source)], d, self.time_at(i, d), sp.greedy)
            rate = (1.0 + gain) / (spent + self.time_at(i, d) + self.cost(rows))
            if rate > best_rate:
                best, best_rate = d, rate
        return best, best_rate

    def path_probs_now(self, plan: Plan) -> list[float]:
        """Each node's chance of being emitted at today's estimates."""
        return path_probs(plan.tree.parent_list, [self.acceptance.rate(k) for k in plan.keys])

    def worth(self, plan: Plan, P: list[float], depth: int, draft_s: float, greedy: bool) -> tuple[float, int]:
        """A past draft cut to `depth` and judged with path probabilities P: its expected accepted tokens and the
        rows it would verify. A sampled draft is judged as a deterministic one: a guess made before drafting looks at
        no draw."""
        depths = plan.tree.depth_list
        within = [v for v, dv in enumerate(depths) if dv <= depth]  # prefix-closed, in order
        sub = [P[v] for v in within]  # a node's path probability is its ancestors': the same in any prefix-closed set
        keep = self.cut(sub, [depths[v] for v in within], draft_s, greedy, False)
        return sum(sub[k] for k in keep), 1 + len(keep)

    def time_at(self, i: int, depth: int) -> float:
        """Drafter i's measured time to draft `depth` levels; an unmeasured depth scales the nearest measured one."""
        exact = self.draft_s.get((i, depth))
        if exact is not None:
            return exact
        known = [d for (j, d) in self.draft_s if j == i]
        if not known:
            return 0.0
        near = min(known, key=lambda d: abs(d - depth))
        return self.draft_s[(i, near)] * depth / near

    def catch_up_time(self, i: int, n: int) -> float:
        """What drafter i would spend first on the tokens of steps it did not draft, drafting at request length n (0
        right after its own draft's step: what that step added is part of its draft time)."""
        return self.catch_up_s.get(i, 0.0) * self.skipped(i, n)

    def skipped(self, i: int, n: int) -> int:
        return n - self.caught_up.get(i, n)

    def learn_draft_time(self, i: int, tree: DraftTree, seconds: float, n: int) -> None:
        """A draft's seconds: its draft time where it skipped no step (or nothing is known of it yet); else, past the
        draft time measured at its depth (not one scaled from another depth), a catch-up over the CATCH_UP_MIN or more
        tokens it skipped, per token."""
        skipped, self.caught_up[i] = self.skipped(i, n), n
        if not len(tree):
            return
        depth = max(tree.depth_list)
        old = self.draft_s.get((i, depth))
        if not skipped or not any(j == i for j, _ in self.draft_s):
            self.draft_s[(i, depth)] = seconds if old is None else ema(old, seconds)
        elif old is not None and skipped >= CATCH_UP_MIN:
            per_token = max(seconds - old, 0.0) / skipped
            self.catch_up_s[i] = ema(self.catch_up_s[i], per_token) if i in self.catch_up_s else per_token

    def observe(self, plan: Plan, path: list[int], m: Metrics) -> None:
        record(self.acceptance, plan, path, m)
        if plan.part in self.caught_up and len(plan.tree):
            self.caught_up[plan.part] += 1 + len(path)  # its next draft runs these tokens as any draft does


def estimate(
    acceptance: Acceptance, i: int, tree: DraftTree, sp: SamplingParams
) -> tuple[list[Key], list[float], list[float | None]]:
    """Per node of part i's draft: what its estimate pools with, the estimate, and the drafter's own probability (in
    [0, 1], None where it gives none or a non-finite one)."""
    raw = tree.accept_probs.float().tolist() if tree.accept_probs is not None else [None] * len(tree)
    own = [min(max(p, 0.0), 1.0) if p is not None and math.isfinite(p) else None for p in raw]
    keys = [node_key(i, not sp.greedy, d, p, tree.match_len) for d, p in zip(tree.depth_list, own, strict=True)]
    return keys, [acceptance.rate(k) for k in keys], own


def record(acceptance: Acceptance, plan: Plan, path: list[int], m: Metrics) -> None:
    """What the target accepted of the plan's tree (path: drafted node indices): every verified node whose parent was
    accepted updates its estimate, and goes into the request's reliability tables."""
    if plan.verifies_nothing:
        return
    tree, on_path, settled = plan.tree, set(path), acceptance.step > SETTLED
    for v in range(len(tree)) if plan.kept is None else plan.kept.tolist():
        parent = tree.parent_list[v]
        if parent >= 0 and parent not in on_path:
            continue
        hit = v in on_path
        acceptance.observe(plan.keys[v], hit)
        m.record_estimate(plan.name, tree.depth_list[v], plan.estimates[v], plan.own[v], hit, settled)


def ema(old: float, new: float) -> float:
    return old + EMA * (new - old)
