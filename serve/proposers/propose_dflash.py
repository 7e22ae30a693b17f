"""DFlash proposer: one head forward drafts a block, a chain or a tree from each draft slot's top-k.

The drafter's cache holds, per layer, the keys and values of the context: slot j is the head's projection of the
target's features of token j, at position j (it depends on tokens[: j + 1] only, so it goes through the prefix
cache with the target's KV). With the pending token at position p, the block [pending token, mask x (B-1)] runs at
slots and positions p .. p+B-1, attending to context slots [0, p) and to the whole block; slot i's logits draft
depth i. The block's own keys and values are scratch: the next take_in() writes the real context of the verified
tokens over them before the next draft, so a rejected draft leaves nothing behind.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import Tensor

from draftsmith.heads.dflash import DFlashHead
from draftsmith.runtime.kv_cache import KVCache, SlotCache
from draftsmith.runtime.llama import ForwardOut
from draftsmith.serve.drafters import load_drafter
from draftsmith.serve.engine.tree import TreeConfig
from draftsmith.serve.models.target import LoadedTarget
from draftsmith.serve.proposers.slots import SlotProposer
from draftsmith.serve.spec import SpecConfig


class DFlashProposer(SlotProposer):
    head: DFlashHead
    name = "dflash"

    def __init__(self, head: DFlashHead, num_tokens: int, tree: TreeConfig | None = None, generator=None) -> None:
        if num_tokens < 1:
            raise ValueError(f"spec.num_tokens must be >= 1, got {num_tokens}")
        # one forward drafts a block's tokens: a deeper draft is capped there, as Medusa's at its heads
        super().__init__(head, min(num_tokens, self.block_drafts(head)), tree, generator)
        self.cached = 0  # context slots [0, cached) are written

    @staticmethod
    def block_drafts(head: DFlashHead) -> int:
        """Tokens one forward drafts: the mask slots (the pending token's slot drafts nothing)."""
        return head.config.block_size - 1

    @property
    def slot_caches(self) -> list[SlotCache]:
        return [self.cache] if self.cache is not None else []

    def reserve(self, max_len: int) -> None:
        c, w = self.head.config, self.head.fc.weight
        room = max_len + c.block_size
        self.cache = KVCache.allocate(c.num_layers, c.num_key_value_heads, c.head_dim, room, w.dtype, w.device)
        if self.head.cos.shape[0] < room:  # the block reaches block_size - 1 positions past the pending token
            self.head.rope_cache(room)

    def begin(self, start: int) -> None:
        self.cached = start

    def take_in(self, out: ForwardOut) -> None:
        """The verified tokens' context into slots cached.."""
        context = self.head.target_features(out.hidden, torch.cat(out.aux, dim=-1))
        s, rows = self.cached, context.shape[0]
        assert self.cache is not None, "reserve() comes first"
        self.head.write_context(context, torch.arange(s, s + rows, device=context.device), self.cache, s)
        self.cached = s + rows

    def forward(self, tokens: Tensor) -> None:
        """The next block from the pending token (the last), every verified token's context written."""
        self.check_pending(tokens)
        self.draft_block(tokens[-1])

    def draft_block(self, pending: Tensor) -> None:
        """The block [pending token, mask x (B-1)] from context slots [0, cached): each mask slot's logits."""
        assert self.cache is not None, "reserve() comes first"
        block = self.head.block_tokens(pending)
        self.logits = self.head.logits(self.head.draft(block, self.cached, self.cache)[1:]).float()

    def check_pending(self, tokens: Tensor) -> None:
        """The engine's sequence is the drafter's context plus the pending token."""
        if tokens.numel() != self.cached + 1:
            raise RuntimeError(f"the drafter holds {self.cached} tokens + the pending one, the engine {tokens.numel()}")


def dflash_proposer(spec: SpecConfig, target: LoadedTarget) -> DFlashProposer:
    """spec=dflash: the head borrows the target's embedding; num_tokens and tree come resolved (serve/build.py)."""
    assert spec.num_tokens is not None, "serve/build.py resolves it"
    return DFlashProposer(cast(DFlashHead, load_drafter(spec, target, target.model)), spec.num_tokens, spec.tree)
