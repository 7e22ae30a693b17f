"""P-EAGLE proposer: one head forward drafts K tokens, a chain or a tree from each draft slot's top-k.

The drafter cache is laid out as EagleProposer's: slot j holds the real pair (target feature of token j-1, token
j) at position j, slot 0 stays empty, and the per-token target features go through the prefix cache with the
target's KV. Before each draft (and after the prefill) one forward runs the new real pairs and, behind the
last one (the pending token's), K-1 mask slots at the next positions, under a plain causal mask: the last real
pair's logits give draft 1, mask slot d's give draft d+1. The mask slots sit past the real ones and the drafted
tokens never enter the drafter, so rejected drafts leave nothing to discard: the next forward writes the real
pairs over the mask slots' KV.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import Tensor

from draftsmith.heads.peagle import PEagleHead
from draftsmith.runtime.kv_cache import FeatureStore, KVCache, SlotCache
from draftsmith.runtime.llama import ForwardOut, Transformer
from draftsmith.serve.drafters import load_drafter
from draftsmith.serve.engine.tree import TreeConfig
from draftsmith.serve.models.target import LoadedTarget
from draftsmith.serve.proposers.slots import SlotProposer
from draftsmith.serve.spec import SpecConfig


class PEagleProposer(SlotProposer):
    head: PEagleHead
    name = "peagle"

    def __init__(
        self, head: PEagleHead, num_tokens: int | None = None, tree: TreeConfig | None = None, generator=None
    ) -> None:
        super().__init__(head, num_tokens or head.config.num_depths, tree, generator)
        self.store: FeatureStore | None = None  # per token: the fused target feature the head reads
        self.cached = 0  # slots [0, cached) hold real pairs
        self.featured = 0  # tokens [0, featured) have their target features stored

    @property
    def slot_caches(self) -> list[SlotCache]:
        return [self.cache, self.store] if self.cache is not None and self.store is not None else []

    def reserve(self, max_len: int) -> None:
        c, w = self.head.config, self.head.fc.weight
        room = max_len + self.depth
        self.cache = KVCache.allocate(c.num_layers, c.num_key_value_heads, c.head_dim, room, w.dtype, w.device)
        self.store = FeatureStore.allocate(room, c.hidden_size, w.dtype, w.device)
        self.mask_feature = self.head.mask_feature().detach()
        if self.head.cos.shape[0] < room:  # mask slots reach K-1 positions past the pending token
            self.head.rope_cache(room)

    def begin(self, start: int) -> None:
        self.cached, self.featured = max(start, 1), start  # tokens [0, featured) have their features stored

    def take_in(self, out: ForwardOut) -> None:
        """Keep the features the head reads of the target's outputs."""
        feats = self.head.target_features(out.hidden, torch.cat(out.aux, dim=-1))
        assert self.store is not None, "reserve() comes first"
        self.store.features[self.featured : self.featured + feats.shape[0]] = feats
        self.featured += feats.shape[0]

    def forward(self, tokens: Tensor) -> None:
        """Real pairs into slots [cached, n), then K-1 mask slots n.. (scratch): one forward, K rows of logits."""
        s, n, k, dev = self.cached, tokens.numel(), self.depth - 1, tokens.device
        assert self.store is not None, "reserve() comes first"
        feats = torch.cat([self.store.features[s - 1 : n - 1], self.mask_feature.expand(k, -1)])
        toks = torch.cat([tokens[s:n], torch.full((k,), self.head.config.mask_token_id, device=dev)])
        mask = torch.ones(n + k - s, n + k, dtype=torch.bool, device=dev).tril(s)
        mask[:, 0] = False
        h = self.head(feats[None], toks[None], torch.arange(s, n + k, device=dev), self.cache, s, mask)
        self.logits = self.head.logits(h[0, n - 1 - s :]).float()
        self.cached = n


def peagle_proposer(spec: SpecConfig, target: LoadedTarget) -> PEagleProposer:
    """spec=peagle: the head borrows the target's embedding; refused if it reads layers the target lacks."""
    head = cast(PEagleHead, load_drafter(spec, target, target.model))
    assert spec.drafter is not None, "SpecConfig refuses peagle without one"
    check_target_layers(head, target.model, spec.drafter)
    return PEagleProposer(head, spec.num_tokens, spec.tree)


def check_target_layers(head: PEagleHead, model: Transformer, folder: str) -> None:
    """Refuse a drafter that reads target layers the target does not have (L: the last layer's output)."""
    n = model.config.num_hidden_layers
    if max(head.target_layers) > n:
        raise ValueError(
            f"drafter {folder} reads the inputs of target layers {list(head.target_layers)}, but the target has "
            f"{n} layers (at most layer {n}): train a drafter for this target"
        )
