"""The interface every drafter speaks to the engine.

A proposer drafts a tree after each target step and is then told which path the target
accepted, together with the target's hidden states for the tokens it just verified (what
EAGLE-style heads feed on). State it keeps per position (a KV cache, a feature store) is listed in slot_caches
so the prefix cache saves and restores it with the target's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from draftsmith.runtime.kv_cache import SlotCache
from draftsmith.runtime.llama import ForwardOut
from draftsmith.serve.engine.sampling import SamplingParams
from draftsmith.serve.engine.tree import DraftTree

# tokens of target outputs a drafter keeps untaken before it takes them in (a drafter the draft policy leaves out for
# long: serve/engine/policy.py); until then a plain step costs it nothing
BACKLOG = 64


def joined(pieces: list[tuple[Tensor, list[Tensor]]]) -> tuple[Tensor, list[Tensor]]:
    """The target's outputs of consecutive steps, (hidden rows, tapped layers' rows) each, as one run of rows."""
    hidden = torch.cat([h for h, _ in pieces])
    return hidden, [torch.cat([aux[j] for _, aux in pieces]) for j in range(len(pieces[0][1]))]


class Proposer:
    name = "none"
    target_layers: tuple[int, ...] = ()  # target layers whose inputs the proposer wants (EAGLE-3)
    max_tree_size = 0  # upper bound on nodes per proposal (the engine reserves cache slots)
    gen: torch.Generator | None = None  # draw random drafts from this; the engine sets the request's generator
    mergeable = False  # rebuilds its state from the target's outputs after each step, so it can take a path
    # through nodes it did not draft (serve/proposers/hybrid.py merges n-gram lookup into its tree)
    by_lookup = False  # drafts by looking up the tokens so far (n-gram, suffix): costs next to nothing, so the draft
    # policy (serve/engine/policy.py) drafts it first and judges the draft itself, not its expected worth
    benched = False  # the draft policy leaves it out of this request: no step asks it to draft, so its prefill may
    # leave its own forward to a later draft (its state must still let a later request draft from the prefix cache)

    @property
    def slot_caches(self) -> list[SlotCache]:
        return []

    def reserve(self, max_len: int) -> None:
        """Allocate per-sequence state for sequences up to max_len tokens (called once)."""

    def prefill(self, tokens: Tensor, start: int, out: ForwardOut) -> None:
        """New sequence. tokens: prompt + first generated token; slots [0, start) were restored
        from the prefix cache; target: the target's outputs for tokens[start:-1]."""

    def propose(self, tokens: Tensor, sp: SamplingParams, budget: int) -> DraftTree:
        """Draft continuations of tokens (the last one is pending: not yet run by the target).
        budget (>= 1): how many tokens the request may still emit, so no node deeper than that is drafted
        (it could never be kept: verify rows, and the drafter's work, would be spent on nothing)."""
        raise NotImplementedError

    def accept(self, tokens: Tensor, tree: DraftTree, path: list[int], out: ForwardOut) -> None:
        """The target accepted tree nodes `path`; tokens now ends with the next pending token.
        target: the target's outputs for the verified tokens (old pending token, then the path)."""

    def parts(self) -> list[Proposer]:
        """The drafters the draft policy chooses among each step; each is asked to propose on its own, and the
        whole (this proposer) is told what was accepted. One drafter: itself."""
        return [self]

    def forget(self) -> None:
        """Drop what earlier requests taught it (suffix decoding's global tree), e.g. after a warm-up."""

    def set_client(self, client: str) -> None:
        """Whose earlier requests the next ones may draft from, where a proposer learns across requests (suffix
        decoding's global tree): each client's own, as its prefix-cache entries are ("": the one shared set)."""
