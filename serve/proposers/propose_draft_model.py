"""A small causal LM sharing the target's tokenizer drafts a chain, one token at a time.

Also `layerskip`: the target's own first N layers with its final norm and lm_head, a
training-free draft that shares the target's weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from draftsmith.runtime.kv_cache import KVCache, SlotCache
from draftsmith.runtime.llama import ForwardOut, Transformer
from draftsmith.serve.drafters import draft_lm, drafter_dtype
from draftsmith.serve.engine.sampling import SamplingParams, probs_from_logits, sample, widen
from draftsmith.serve.engine.tree import DraftTree, causal_mask
from draftsmith.serve.models.target import LoadedTarget
from draftsmith.serve.proposers.base import Proposer
from draftsmith.serve.spec import SpecConfig


@dataclass
class DraftChainConfig:
    """The chain a draft LM or layerskip drafts (the draft LM's own sizes: heads/draft_model.DraftModelConfig)."""

    num_tokens: int = 4  # chain length k


class DraftModelProposer(Proposer):
    name = "draft_model"

    def __init__(self, model: Transformer, cfg: DraftChainConfig, generator: torch.Generator | None = None) -> None:
        self.model, self.cfg, self.gen = model, cfg, generator
        self.vocab_ids: Tensor | None = getattr(model, "vocab_ids", None)  # a draft vocabulary: target id per logit
        self.max_tree_size = cfg.num_tokens
        self.cache: KVCache | None = None
        self.cached = 0  # leading slots of self.cache that hold KV of the true sequence

    @property
    def slot_caches(self) -> list[SlotCache]:
        return [self.cache] if self.cache is not None else []

    def reserve(self, max_len: int) -> None:
        self.cache = self.model.new_cache(max_len)
        # Slot j holds position j. A draft LM with a shorter max_position_embeddings than the engine's context gets
        # its rope table extended, rather than the engine capped to it: past its trained context its drafts may be
        # worse, never wrong (the target verifies every token).
        if self.model.cos.shape[0] < max_len:
            self.model.rope_cache(max_len)

    def prefill(self, tokens: Tensor, start: int, out: ForwardOut) -> None:
        self.cached = start
        self.run(tokens[start:-1], logits=False)

    def propose(self, tokens: Tensor, sp: SamplingParams, budget: int) -> DraftTree:
        ids, k = self.vocab_ids, min(self.cfg.num_tokens, budget)
        logits = self.run(tokens[self.cached :])
        drafted, probs, own = [], [], []
        for i in range(k):
            if sp.greedy:
                p = torch.softmax(logits.float(), dim=-1)
                pick = int(logits.argmax())
            else:
                p = probs_from_logits(logits, sp)
                probs.append(p)
                pick = sample(p, self.gen)
            own.append(float(p[pick]))
            drafted.append(pick if ids is None else int(ids[pick]))
            if i + 1 < k:
                logits = self.run(torch.tensor(drafted[-1:], device=tokens.device))
        self.cached -= k - 1  # drafted KV stays in the slots, valid only once accepted
        draft_probs = widen(torch.stack(probs), ids, self.model.config.vocab_size) if probs else None
        dev = tokens.device
        return DraftTree.chain(torch.tensor(drafted, device=dev), draft_probs, torch.tensor(own, device=dev))

    def accept(self, tokens: Tensor, tree: DraftTree, path: list[int], out: ForwardOut) -> None:
        # slots hold the old pending token, then drafts 1..k-1 of this k-token chain; the accepted prefix is valid.
        # A step that drafted nothing (a plain one the draft policy chose) wrote no slot: the next draft catches up
        self.cached += min(len(path), len(tree) - 1) if len(tree) else 0

    def run(self, tokens: Tensor, logits: bool = True) -> Tensor:
        """Feed tokens at the next slots; returns the last row's logits."""
        n, start = tokens.numel(), self.cached
        positions = torch.arange(start, start + n, device=tokens.device)
        out = self.model(
            tokens,
            positions,
            self.cache,
            start,
            causal_mask(start, n, tokens.device),
            logit_rows=slice(-1, None) if logits else slice(0, 0),
        )
        self.cached += n
        return out.logits[-1] if logits else out.logits


def draft_proposer(spec: SpecConfig, target: LoadedTarget) -> DraftModelProposer:
    """spec=draft_model: an HF draft LM, or a draft_model drafter folder."""
    assert spec.num_tokens is not None and spec.drafter is not None, "serve/build.py resolves them"
    model = draft_lm(Path(spec.drafter), target, drafter_dtype(spec, target), spec.draft_vocab)
    return DraftModelProposer(model, DraftChainConfig(spec.num_tokens))
