"""The speculative engine: prefill (with prefix cache), then propose -> (cut) -> verify -> keep, batch 1.

Plain decoding is the same loop with no proposer: every step verifies an empty tree. With a cost cut
(spec.verify=cost, serve/engine/draft_cut.py) a step verifies only the part of the draft worth its rows; with a draft
policy (spec.verify=policy, serve/engine/policy.py) the step decides first whether to draft, with what and how deep.
Either way the proposer still hears about the tree it drafted.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from torch import Tensor

from draftsmith.runtime.kv_cache import KVCache
from draftsmith.runtime.llama import ForwardOut, Transformer
from draftsmith.serve.engine.calibration import Acceptance
from draftsmith.serve.engine.draft_cut import CostCut
from draftsmith.serve.engine.generation import Generation
from draftsmith.serve.engine.graphs import cache_len, make_static_step, resolve_mode
from draftsmith.serve.engine.metrics import Metrics
from draftsmith.serve.engine.observer import Observer
from draftsmith.serve.engine.policy import DraftPolicy, Plan, estimate, record
from draftsmith.serve.engine.prefix_cache import PrefixCache
from draftsmith.serve.engine.sampling import SamplingParams, pick
from draftsmith.serve.engine.tree import DraftTree, causal_mask
from draftsmith.serve.engine.verify import verify
from draftsmith.serve.proposers.base import Proposer

T = TypeVar("T")


@dataclass
class Engine:
    model: Transformer
    proposer: Proposer | None = None
    prefix_cache: PrefixCache | None = None
    eos_ids: tuple[int, ...] = ()
    max_seq_len: int = 4096
    salt: str = ""  # separates prefix-cache entries of other targets, dtypes and drafters
    cuda_graphs: str = "auto"  # static-shape step (graphs.py): auto | compile | graphs | eager | off
    draft_cut: CostCut | None = None  # cut each draft to what pays for its verify rows (None: verify it whole)
    policy: DraftPolicy | None = None  # decide before each step what to draft (takes the place of draft_cut)
    # without a policy: its acceptance estimates, kept for the calibration report only (spec.policy.report_estimates)
    estimates: Acceptance | None = None
    cache: KVCache = field(init=False, repr=False)
    accept_s: float = field(init=False, default=0.0)  # the proposer's accept() last step: part of its cost per step
    # every drafter sits this request out: after its prefill (which keeps what the prefix cache stores) the proposer
    # is neither asked nor told anything, so the request's steps cost what plain decoding's do
    sitting_out: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        tree = self.proposer.max_tree_size if self.proposer else 0
        # draft nodes sit at positions up to max_seq_len - 2 + tree: all must stay inside the model's rope table
        room = self.model.config.max_position_embeddings
        if tree >= room:
            assert self.proposer is not None, "a draft (tree > 0) has a proposer"
            raise ValueError(
                f"a draft of up to {tree} tokens ({self.proposer.name}) leaves no room in the model's "
                f"{room}-token context: draft fewer tokens (spec.num_tokens, spec.tree.*)"
            )
        self.max_seq_len = min(self.max_seq_len, room + 1 - max(tree, 1))
        slots = self.max_seq_len + tree + 1
        mode = resolve_mode(self.cuda_graphs, self.model, tree)
        self.cache = self.model.new_cache(cache_len(mode, slots))
        if self.proposer:
            self.proposer.reserve(slots)
        self.target_layers = self.proposer.target_layers if self.proposer else ()  # hidden states the drafter reads
        self.static = make_static_step(mode, self.model, self.cache, self.target_layers)

    def replace_proposer(self, proposer: Proposer, salt: str) -> None:
        """Draft with another proposer from the next request on (a new version of the head): it must read the same
        target layers and fit the draft room reserved. The prefix cache is emptied: it holds the old one's state."""
        old = self.proposer
        if old is None or proposer.target_layers != old.target_layers or proposer.max_tree_size > old.max_tree_size:
            raise ValueError(
                f"a proposer reading layers {proposer.target_layers} with drafts of up to {proposer.max_tree_size} "
                f"tokens cannot replace {old.name if old else 'plain decoding'}: draft the same shape from the same "
                "target layers"
            )
        proposer.reserve(self.cache.max_len)
        self.proposer, self.salt = proposer, salt
        if self.prefix_cache is not None:
            self.prefix_cache.reset()
        if self.policy is not None:
            self.policy.attach_all()  # what the old one's requests said of it says nothing of the new one

    def forget(self) -> None:
        """Back to a cold engine: no prefix-cache hits, no drafting from earlier answers (suffix decoding's global
        tree), no acceptance estimate or draft time learnt from earlier requests."""
        if self.prefix_cache is not None:
            self.prefix_cache.reset()
        if self.proposer:
            self.proposer.forget()
        if self.policy is not None:
            self.policy.forget()
        if self.estimates is not None:
            self.estimates = Acceptance(self.estimates.prior_weight, self.estimates.half_life)
        self.accept_s = 0.0

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        if prompt_len == 0:
            raise ValueError("empty prompt: give at least one token")
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be > 0, got {max_new_tokens}")
        if prompt_len + max_new_tokens > self.max_seq_len:
            raise ValueError(
                f"prompt of {prompt_len} tokens + max_new_tokens={max_new_tokens} exceeds the context of "
                f"{self.max_seq_len} tokens; shorten the prompt, lower max_new_tokens, or raise max_seq_len "
                f"(the model allows {self.model.config.max_position_embeddings}, less the draft tree's reach)"
            )

    @torch.inference_mode()
    def generate(
        self, prompt_ids: list[int], max_new_tokens: int, sp: SamplingParams, observer: Observer | None = None
    ) -> Generation:
        """observer (serve/engine/observer.py): told each step's new output tokens (and may stop the request
        there), the target's outputs when it wants them, and the finished Generation."""
        self.check_fits(len(prompt_ids), max_new_tokens)
        gen = torch.Generator(self.model.device)
        if sp.seed is not None:
            gen.manual_seed(sp.seed)
        else:
            gen.seed()  # a fresh seed for this generator only: the global RNG is left alone
        benched: set[int] = set()  # drafter parts the policy leaves out of this request
        if self.proposer is not None:
            self.proposer.gen = gen  # drafts are sampled from the request's generator: a seed fixes the whole run
            parts = self.proposer.parts()
            benched = self.policy.start(parts) if self.policy is not None else benched
            for i, part in enumerate(parts):
                part.benched = i in benched
            self.sitting_out = len(benched) == len(parts)
        if self.estimates is not None:
            self.estimates.start()
        m = Metrics(prompt_tokens=len(prompt_ids), drafters_benched=len(benched))
        begin = time.perf_counter()
        room = len(prompt_ids) + max_new_tokens + 1 + (self.proposer.max_tree_size if self.proposer else 0)
        tokens = torch.zeros(room, dtype=torch.long, device=self.model.device)
        tokens[: len(prompt_ids)] = torch.tensor(prompt_ids)
        p = len(prompt_ids)
        limit = p + max_new_tokens
        n = self.prefill(tokens, p, sp, gen, m, observer)
        self.sync()
        m.ttft_s = time.perf_counter() - begin
        finished = self.advance(tokens[p:n].tolist(), n - p, max_new_tokens, observer)
        while finished is None:
            old = n
            n = self.step(tokens, n, limit - n, sp, gen, m, observer)
            # a step's bonus token may land past max_new_tokens: an EOS out there does not count
            finished = self.advance(tokens[old : min(n, limit)].tolist(), n - p, max_new_tokens, observer)
        self.sync()
        m.total_s = time.perf_counter() - begin
        out = self.truncate(tokens[len(prompt_ids) : n].tolist(), max_new_tokens)
        m.new_tokens = len(out)
        g = Generation(out, m, finished)
        if observer:
            observer.finish(g)
        return g

    def advance(self, new: list[int], generated: int, max_new: int, observer: Observer | None) -> str | None:
        """Why the request ends after these new tokens (None: it goes on); the observer sees them first."""
        finished = self.finish_reason(new, generated, max_new)
        if observer is not None and not observer.emit(self.upto_eos(new)) and finished is None:
            return "stopped"
        return finished

    def prefill(
        self, tokens: Tensor, p: int, sp: SamplingParams, gen, m: Metrics, observer: Observer | None = None
    ) -> int:
        """Run the prompt (minus any prefix-cache hit) and sample the first new token."""
        caches = [self.cache] + (self.proposer.slot_caches if self.proposer else [])
        prompt = tokens[:p].tolist()
        hit = self.prefix_cache.lookup(prompt, self.salt, caches) if self.prefix_cache is not None else 0
        out = self.forward(
            tokens[hit:p],
            torch.arange(hit, p, device=tokens.device),
            hit,
            causal_mask(hit, p - hit, tokens.device),
            logit_rows=slice(-1, None),
        )
        tokens[p] = pick(out.logits[-1], sp, gen)
        if self.proposer:
            self.proposer.prefill(tokens[: p + 1], hit, out)
        if observer is not None and observer.wants_outputs:
            observer.prefill(tokens[: p + 1], hit, out)
        if self.prefix_cache is not None:
            self.prefix_cache.insert(prompt, self.salt, caches)
            m.prefix_queried_tokens, m.prefix_hit_tokens = p, hit
        return p + 1

    def step(
        self, tokens: Tensor, n: int, budget: int, sp: SamplingParams, gen, m: Metrics, observer: Observer | None = None
    ) -> int:
        """One target pass over [pending token, draft tree]; returns the new sequence length.
        budget: how many more tokens the request may emit (the pending one counted as emitted)."""
        cached = n - 1
        plan = self.plan(tokens[:n], sp, budget, m)
        drafted, kept, propose_s = plan.tree, plan.kept, plan.seconds
        tree = drafted if kept is None else drafted.subtree(kept)
        size = len(tree)
        if size == 0:
            out = self.forward(tokens[cached:n], torch.arange(cached, n, device=tokens.device), cached, None)
        else:
            inputs = torch.cat([tokens[cached:n], tree.tokens])
            out = self.forward(inputs, tree.positions(cached), cached, tree.attention_mask(cached))
        verdict = verify(tree, out.logits, sp, gen)
        path = verdict.path
        if path:
            nodes = torch.tensor(path, device=tokens.device)
            self.cache.keep(n, nodes + n)  # node i sat at slot cached + 1 + i = n + i
            tokens[n : n + len(path)] = tree.tokens[nodes]
        end = n + len(path)
        reach = self.reach(tokens[n:end].tolist(), budget)
        m.record_step(int((tree.depths <= reach).sum()), min(len(path), reach), size + 1)
        tokens[end] = verdict.next_token
        watching = observer if observer is not None and observer.wants_outputs else None
        told = self.proposer is not None and not self.sitting_out
        if told or watching:
            verified = out if size == 0 and self.fresh_outputs else select_rows(out, [0] + [i + 1 for i in path])
            if told:
                # the proposer's own node indices: it may keep state per node of the tree it drafted
                drafted_path = path if kept is None else kept[path].tolist()
                self.accept(tokens[: end + 1], drafted, drafted_path, verified)
                if self.policy is not None:
                    self.policy.observe(plan, drafted_path, m)
                elif self.estimates is not None:
                    record(self.estimates, plan, drafted_path, m)
            if watching:
                watching.accept(tokens[: end + 1], path, verified)
        m.draft_s += propose_s + (self.accept_s if told else 0.0)
        return end + 1

    @property
    def fresh_outputs(self) -> bool:
        """Whether a forward's outputs are its own tensors, so a plain step's one row is handed on without a copy."""
        return self.static is None or self.static.fresh_outputs

    def plan(self, tokens: Tensor, sp: SamplingParams, budget: int, m: Metrics) -> Plan:
        """What this step verifies: the policy's choice, else the proposer's draft, cut by draft_cut if any."""
        if self.proposer is None:
            return Plan(DraftTree.empty(tokens.device))
        if self.sitting_out:
            plan = Plan(DraftTree.empty(tokens.device))
        elif self.policy is not None:
            plan = self.policy.plan(self.proposer.parts(), tokens, sp, budget, self.clocked)
        else:
            proposer = self.proposer
            tree, seconds = self.clocked(lambda: proposer.propose(tokens, sp, budget))
            kept = self.draft_cut.cut(tree, seconds + self.accept_s, sp.greedy) if self.draft_cut else None
            plan = Plan(tree, kept, 0, seconds, "whole" if kept is None else "cut")
            if self.estimates is not None:
                self.estimates.tick()
                plan.keys, plan.estimates, plan.own = estimate(self.estimates, 0, tree, sp)
                plan.name = proposer.name
        if plan.verifies_nothing and plan.decision != "probe":
            plan.decision = "plain"
        m.record_decision(plan.decision)
        return plan

    def clocked(self, call: Callable[[], T]) -> tuple[T, float]:
        """The call's result and its seconds (a GPU synchronised around it when they steer a cost decision)."""
        begin = time.perf_counter()
        out = call()
        if self.draft_cut is not None or self.policy is not None:
            self.sync()
        return out, time.perf_counter() - begin

    def accept(self, tokens: Tensor, tree: DraftTree, path: list[int], out: ForwardOut) -> None:
        assert self.proposer is not None, "only a proposer is told what was accepted"
        begin = time.perf_counter()
        self.proposer.accept(tokens, tree, path, out)
        if self.draft_cut is not None:  # the cut charges accept's time to the next draft
            self.sync()
        self.accept_s = time.perf_counter() - begin

    def forward(
        self, inputs: Tensor, positions: Tensor, start: int, mask: Tensor | None, logit_rows: slice | None = None
    ) -> ForwardOut:
        if self.static is not None and (logit_rows is None or self.static.prefill):
            return self.static(inputs, positions, start, mask, logit_rows)
        return self.model(inputs, positions, self.cache, start, mask, logit_rows, self.target_layers)

    def reach(self, accepted: list[int], budget: int) -> int:
        """How many draft depths this step's output covers: up to the budget or an accepted EOS, whichever
        comes first. Metrics count only nodes within it: the rest were cut, never emitted."""
        for i, t in enumerate(accepted[:budget]):
            if t in self.eos_ids:
                return i + 1
        return budget

    def finish_reason(self, new: list[int], generated: int, max_new: int) -> str | None:
        if any(t in self.eos_ids for t in new):
            return "eos"
        return "length" if generated >= max_new else None

    def truncate(self, out: list[int], max_new: int) -> list[int]:
        return self.upto_eos(out[:max_new])

    def upto_eos(self, out: list[int]) -> list[int]:
        for i, t in enumerate(out):
            if t in self.eos_ids:
                return out[: i + 1]
        return out

    def sync(self) -> None:
        if self.model.device.type == "cuda":
            torch.cuda.synchronize()


def select_rows(out: ForwardOut, rows: list[int]) -> ForwardOut:
    """The verified rows' outputs, copied (a captured graph's outputs are overwritten by its next replay)."""
    index = torch.tensor(rows, device=out.hidden.device)
    return ForwardOut(out.logits[index], out.hidden[index], [a[index] for a in out.aux])
