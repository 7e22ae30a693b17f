"""EAGLE-1/2 and EAGLE-3 proposers: a one-layer head drafts a chain or an EAGLE-2 dynamic tree.

The head has its own one-layer KV cache. Slot j holds the pair (target feature of token j-1, token j) at
position j, the token's position in the target, so a slot depends only on tokens[: j + 1]. Slot 0 (no
feature) stays empty and is never attended. The target features themselves are kept per token too: after a
prefix-cache hit of h tokens, slot h needs the feature of token h-1, which the target does not recompute.
Both go through the prefix cache with the target's KV. After each verification the accepted tokens' slots are
recomputed from the target's real features, which also gives the head's prediction for the next pending
token: the first level of the next draft. That recomputation, and the features' projection, wait for the next draft:
a step the draft policy (serve/engine/policy.py) leaves plain costs the head nothing, and the tokens it skipped run in
one forward later.

With a window (spec.head_window) the head reads only the prompt's last `window` tokens and everything after: its
prefill runs over those slots alone. The features are kept for the whole prompt, so a later request whose window
starts earlier can fill its slots from them; which slots hold real pairs is kept per slot too (`filled`), through the
prefix cache, since a slot restored from it may lie before the window of the request that stored it.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import Tensor

from draftsmith.cpu_kernels import eagle3_draft, native
from draftsmith.heads.eagle import EagleHead
from draftsmith.heads.eagle3 import Eagle3Head
from draftsmith.runtime.kv_cache import FeatureStore, KVCache, SlotCache
from draftsmith.runtime.llama import ForwardOut
from draftsmith.serve.drafters import load_drafter
from draftsmith.serve.engine.sampling import SamplingParams, probs_from_logits, widen
from draftsmith.serve.engine.tree import DraftTree, TreeConfig
from draftsmith.serve.models.target import LoadedTarget
from draftsmith.serve.proposers import base
from draftsmith.serve.proposers.base import Proposer
from draftsmith.serve.proposers.topk_trees import rerank, tree_size
from draftsmith.serve.spec import SpecConfig


class EagleProposer(Proposer):
    mergeable = True

    def __init__(
        self,
        head: EagleHead | Eagle3Head,
        kind: str,
        num_tokens: int = 4,
        tree: TreeConfig | None = None,
        generator: torch.Generator | None = None,
        window: int = 0,
    ) -> None:
        self.head, self.name, self.depth, self.tree, self.gen = head, kind, num_tokens, tree or TreeConfig(), generator
        self.window = window  # the prompt's last tokens the head reads (0: all)
        self.first = 1  # the first slot this request's head reads (slot 0 holds no pair)
        self.target_layers = tuple(head.target_layers)
        self.vocab_ids = head.vocab_ids  # EAGLE-3: target id of each draft id
        self.max_tree_size = tree_size(self.tree, num_tokens, head.lm_head.out_features)
        self.cache: KVCache | None = None
        self.store: FeatureStore | None = None  # per token: the target feature the head reads
        self.filled: FeatureStore | None = None  # per slot: 1 where it holds a real pair (a window leaves some out)
        self.cached = 0  # slots [0, cached) hold real pairs
        self.known = 0  # tokens [0, known) have their target outputs kept (the last one pending)
        # target outputs not yet made features: (first token, hidden, aux), consecutive tokens
        self.unstored: list[tuple[int, Tensor, list[Tensor]]] = []
        self.feature: Tensor | None = None  # [H] the head's prediction for the pending token's feature
        self.logits: Tensor | None = None  # [1, vocab] its logits: the root's children
        self.sees = torch.ones(0, dtype=torch.bool)  # per slot: whether the head reads it (prefill sets it)

    @property
    def slot_caches(self) -> list[SlotCache]:
        if self.cache is None or self.store is None or self.filled is None:
            return []
        return [self.cache, self.store, self.filled]

    def reserve(self, max_len: int) -> None:
        c, w = self.head.config, self.head.fc.weight
        room = max_len + self.depth * self.tree.width
        self.cache = KVCache.allocate(1, c.num_key_value_heads, c.head_dim, room, w.dtype, w.device)
        self.store = FeatureStore.allocate(room, c.hidden_size, w.dtype, w.device)
        self.filled = FeatureStore.allocate(room, 1, torch.bool, w.device)
        self.sees = torch.ones(room, dtype=torch.bool, device=w.device)  # the slots a new one sees, up to itself
        if self.head.cos.shape[0] < room:  # drafts reach a few positions past the last verified one
            self.head.rope_cache(room)

    def prefill(self, tokens: Tensor, start: int, out: ForwardOut) -> None:
        """Features of tokens [0, start) and slots [0, start) came from the prefix cache."""
        self.unstored = []
        self.keep_features(start, out.hidden, out.aux)
        prompt = tokens.numel() - 1
        assert self.filled is not None, "reserve() comes first"
        self.filled.features[start:] = False  # what an earlier request left past the restored slots is not this one's
        self.first = max(1, prompt - self.window) if self.window else 1
        self.sees[: self.first], self.sees[self.first :] = False, True
        self.cached, self.known = self.first_unfilled(self.first, max(start, self.first)), tokens.numel()
        if not self.benched:  # benched: the features are kept, the slots stay unfilled for a later draft to run
            self.extend(tokens)

    def first_unfilled(self, begin: int, end: int) -> int:
        """The first slot in [begin, end) that holds no real pair (end where every one does)."""
        assert self.filled is not None, "reserve() comes first"
        empty = (~self.filled.features[begin:end, 0]).nonzero()
        return begin + int(empty[0]) if empty.numel() else end

    def accept(self, tokens: Tensor, tree: DraftTree, path: list[int], out: ForwardOut) -> None:
        self.unstored.append((self.known - 1, out.hidden, out.aux))  # the next draft stores them, runs the new slots
        self.known = tokens.numel()
        if self.known - 1 - self.unstored[0][0] > base.BACKLOG:  # a head left out for long: project what it has so far
            self.store_unstored()

    def store_unstored(self) -> None:
        """The kept target outputs, consecutive tokens, made features in one projection."""
        first = self.unstored[0][0]
        self.keep_features(first, *base.joined([(h, aux) for _, h, aux in self.unstored]))
        self.unstored = []

    def keep_features(self, first: int, hidden: Tensor, aux: list[Tensor]) -> None:
        """The target's outputs for tokens first, first+1, ...: keep the features the head reads."""
        feats = self.head.target_features(hidden, torch.cat(aux, dim=-1) if aux else None)
        assert self.store is not None, "reserve() comes first"
        self.store.features[first : first + feats.shape[0]] = feats

    def extend(self, tokens: Tensor) -> None:
        """Real pairs (feature of token j-1, token j) into slots j in [cached, len(tokens))."""
        s, n = self.cached, tokens.numel()
        assert self.store is not None, "reserve() comes first"
        feats = self.store.features[s - 1 : n - 1]
        mask = self.slot_mask(s, n)
        h = self.head(feats[None], tokens[None, s:n], torch.arange(s, n, device=tokens.device), self.cache, s, mask)
        self.filled_up_to(n, h[0, -1], self.head.logits(h[0, -1:]).float())

    def slot_mask(self, s: int, n: int) -> Tensor:
        """What slots s .. n-1 see: the slots before each and itself, from the first this request's head reads (slot 0,
        and the prompt before the window, are left out)."""
        return self.sees[:n].expand(n - s, n).tril(s)

    def filled_up_to(self, n: int, feature: Tensor, logits: Tensor) -> None:
        """Slots [cached, n) hold real pairs now; the last one's output and logits are the next draft's first level."""
        assert self.filled is not None, "reserve() comes first"
        self.filled.features[self.cached : n] = True
        self.feature, self.logits, self.cached = feature, logits, n

    def take_in(self, tokens: Tensor) -> None:
        """The kept target outputs made features and the new slots run: in one call where the head takes it
        (cpu_kernels/eagle3_draft.py, the same bits), else module by module."""
        assert self.store is not None and self.cache is not None, "reserve() comes first"
        # native.handles: no grad, autocast or compile, kernels not switched off (else the modules keep torch's ops)
        fits = self.cached < tokens.numel() and native.handles(self.store.features)
        made = self.head.draft_plan() if isinstance(self.head, Eagle3Head) and fits else None
        if made is None or not all(aux for _, _, aux in self.unstored):  # no taps: target_features names the problem
            if self.unstored:
                self.store_unstored()
            if self.cached < tokens.numel():
                self.extend(tokens)
            return
        s, n, store = self.cached, tokens.numel(), self.store.features
        first = self.unstored[0][0] if self.unstored else s - 1
        taps = self.kept_taps()
        rope, caches = (self.head.cos[s:n], self.head.sin[s:n]), (self.cache.k[0], self.cache.v[0])
        projected, features = store[first : first + taps[0].numel() // store.shape[1]], store[s - 1 : n - 1]
        ids = tokens[s:n].long().contiguous()  # the ids as the kernel reads them (itself where they are)
        out, logits = eagle3_draft.run(made, taps, projected, ids, features, rope, caches, s, self.slot_mask(s, n))
        self.unstored = []
        self.filled_up_to(n, out[-1], logits[None])

    def kept_taps(self) -> list[Tensor]:
        """Each tapped target layer's rows kept since the last draft, one run of tokens (none kept: no rows), as the
        kernel reads them: contiguous fp32 (as target_features casts them for fc)."""
        assert self.store is not None, "reserve() comes first"
        if not self.unstored:
            return [self.store.features[:0]] * len(self.target_layers)
        taps = self.unstored[0][2] if len(self.unstored) == 1 else base.joined([(h, a) for _, h, a in self.unstored])[1]
        return [t if t.dtype == torch.float32 and t.is_contiguous() else t.float().contiguous() for t in taps]

    def propose(self, tokens: Tensor, sp: SamplingParams, budget: int) -> DraftTree:
        """Level d's nodes sit at position n-1+d; the nodes expanded at level d take slots n+(d-1)*topk onwards
        and see the real slots, their ancestors and themselves (the target's tree mask, over the head's cache).
        Those slots are scratch: the next draft overwrites them from the target's features, whatever the depth."""
        n, k, dev, depth = tokens.numel(), self.tree.width, tokens.device, min(self.depth, budget)
        if n != self.known:
            raise RuntimeError(f"the drafter holds {self.known} tokens, the engine passed {n}")
        if self.unstored or self.cached < n:
            self.take_in(tokens)
        assert self.feature is not None and self.logits is not None, "a draft follows prefill()"
        if depth == 1:
            return self.first_level(sp)
        sampled = k == 1 and not sp.greedy
        visible = torch.zeros(1, n + (depth - 1) * k, dtype=torch.bool, device=dev)
        visible[:, self.first : n] = True
        feats, logits, scores = self.feature[None], self.logits, torch.zeros(1, device=dev)
        frontier = torch.full((1,), -1, device=dev)  # node index of each expanded row (-1: the root)
        toks: list[Tensor] = []
        parents: list[Tensor] = []
        cum: list[Tensor] = []
        own: list[Tensor] = []  # each node's log-prob under its parent's distribution
        probs: list[Tensor] = []
        for d in range(1, depth + 1):
            logp, ids, p = self.children(logits, sp, sampled)  # [rows, k]
            first = sum(t.numel() for t in toks)
            toks.append(self.to_target(ids).flatten())
            parents.append(frontier.repeat_interleave(k))
            own.append(logp.flatten())
            cum.append((scores[:, None] + logp).flatten())
            if p is not None:
                probs.append(p)
            if d == depth:
                break
            best = cum[-1].topk(min(k, cum[-1].numel())).indices  # the level's nodes to expand
            rows = best // k
            feats, logits, visible = self.run_level(feats[rows], toks[-1][best], visible[rows], n, d)
            scores, frontier = cum[-1][best], first + best
        draft_probs = self.to_target_probs(torch.cat(probs)) if probs else None
        tree = DraftTree(torch.cat(toks), torch.cat(parents), draft_probs, torch.cat(own).exp())
        return rerank(tree, torch.cat(cum), self.max_tree_size)

    def first_level(self, sp: SamplingParams) -> DraftTree:
        """A draft of one level, the root's children, from the logits the last slot gave (what propose's levels
        make of it, without their bookkeeping)."""
        assert self.logits is not None, "a draft follows prefill()"
        logp, ids, p = self.children(self.logits, sp, self.tree.width == 1 and not sp.greedy)
        draft_probs = None if p is None else self.to_target_probs(p)
        roots = torch.full((ids.numel(),), -1, device=ids.device)
        tree = DraftTree(self.to_target(ids).flatten(), roots, draft_probs, logp.flatten().exp())
        return rerank(tree, logp.flatten(), self.max_tree_size)

    def run_level(self, feats: Tensor, toks: Tensor, visible: Tensor, n: int, d: int) -> tuple[Tensor, Tensor, Tensor]:
        """Run level d's expanded nodes (parent features, own tokens) through the head. visible: per node, the
        slots its parent saw; each node adds its own. Returns their predicted features, logits and visibility."""
        r, slot = toks.numel(), n + (d - 1) * self.tree.width
        own = torch.arange(r, device=toks.device)
        visible[own, slot + own] = True
        pos = torch.full((r,), n - 1 + d, device=toks.device)
        h = self.head(feats[None], toks[None], pos, self.cache, slot, visible[:, : slot + r])[0]
        return h, self.head.logits(h).float(), visible

    def children(self, logits: Tensor, sp: SamplingParams, sampled: bool) -> tuple[Tensor, Tensor, Tensor | None]:
        """Per row: the topk draft ids and their log-probs, or (a sampled chain) one id drawn from the
        distribution plain sampling would use, which verification needs as the node's draft probability."""
        if sampled:
            p = probs_from_logits(logits, sp)
            ids = torch.multinomial(p, 1, generator=self.gen)
            return p.gather(-1, ids).log(), ids, p
        top = torch.log_softmax(logits, dim=-1).topk(self.tree.width, dim=-1)
        return top.values, top.indices, None

    def to_target(self, ids: Tensor) -> Tensor:
        # index_select, not indexing: the same ids for a fraction of advanced indexing's dispatch
        return ids if self.vocab_ids is None else self.vocab_ids.index_select(0, ids.flatten()).view(ids.shape)

    def to_target_probs(self, p: Tensor) -> Tensor:
        return widen(p, self.vocab_ids, self.head.config.vocab_size)


def eagle_proposer(spec: SpecConfig, target: LoadedTarget) -> EagleProposer:
    """spec=eagle, eagle3: the head borrows the target's embedding (and EAGLE-1 its lm_head)."""
    head = cast("EagleHead | Eagle3Head", load_drafter(spec, target, target.model))
    assert spec.num_tokens is not None, "serve/build.py resolves it"
    return EagleProposer(head, spec.name, spec.num_tokens, spec.tree, window=spec.head_window)
