"""EAGLE-1/2 head: fc([embed(token); feature]) -> one Llama decoder layer (no input norm) -> next feature.

The head regresses the target's next final-normed hidden state; the target's own lm_head turns a predicted
feature into logits. Embedding and lm_head are borrowed from the target, frozen and not saved. To serve,
`restrict_vocab` can narrow the logits to the training answers' most frequent tokens (FR-Spec, SGLang's
--speculative-token-map): on a CPU the 49k-row lm_head is most of a draft step.

A pair (feature_i, token_{i+1}) sits at position i+1, the token's position in the target (rope only sees
differences, so this is the same model as "pair at position i"; it lines the drafter's cache slots up with
the target's, which the prefix cache relies on).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from draftsmith.runtime.kv_cache import KVCache
from draftsmith.runtime.llama import DecoderLayer, Transformer

from .drafter_folder import restricted_linear
from .head_base import EagleConfig, HeadBase, borrow, sdpa_mask
from .kinds import DraftShape, Kind


class EagleHead(HeadBase):
    shared_prefixes = ("embed_tokens.", "lm_head.")
    target_layers: tuple[int, ...] = ()  # EAGLE-1 reads the target's final hidden states (ForwardOut.hidden)

    def __init__(self, cfg: EagleConfig, model: Transformer | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens, self.lm_head = borrow(model, cfg)
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=True)
        self.layers = nn.ModuleList([DecoderLayer(cfg.layer_config(), input_norm=False)])
        self.rope_cache(cfg.max_position_embeddings)
        self.vocab_ids: Tensor | None = None  # target id of each logit (None: the full target vocabulary)

    def forward(
        self,
        feature: Tensor,
        tokens: Tensor,
        positions: Tensor,
        cache: KVCache | None = None,
        start: int = 0,
        mask: Tensor | None = None,
    ) -> Tensor:
        """feature [b, n, H] (feature_i), tokens [b, n] (token_{i+1}), positions [n] -> predicted feature_{i+1}
        [b, n, H]. Without a cache the pairs attend causally; with one, KV goes to slots [start, start+n) and
        mask (bool [n, start+n], True = attend) says what each pair sees."""
        dtype = self.fc.weight.dtype  # the borrowed embedding may be wider
        x = self.fc(torch.cat([self.embed_tokens(tokens).to(dtype), feature.to(dtype)], dim=-1))
        cos, sin = self.rope(positions, x.dtype)
        kc, vc = (cache.k[0], cache.v[0]) if cache is not None else (None, None)
        return self.layers[0](x, cos, sin, kc, vc, start, sdpa_mask(mask))

    def target_features(self, hidden: Tensor, aux: Tensor | None) -> Tensor:
        """What the head reads from a target forward: its final normed hidden states."""
        return hidden

    def logits(self, feature: Tensor) -> Tensor:
        """Over the full target vocabulary: the target's lm_head, no extra norm (as EAGLE-1 and vLLM)."""
        return self.lm_head(feature.to(self.lm_head.weight.dtype))

    def restrict_vocab(self, ids: Tensor) -> None:
        """Draft over target ids `ids` only: a copy of those lm_head rows (in the head's dtype) replaces the
        borrowed lm_head. Drafts only propose, so the output stays the target's; tokens outside go undrafted."""
        self.lm_head = restricted_linear(self.lm_head, ids, self.fc.weight.dtype)
        self.vocab_ids = ids.to(self.fc.weight.device)


KIND = Kind(
    name="eagle",
    config=EagleConfig,
    module=EagleHead,
    loss="draftsmith.train.loss_eagle:eagle_loss",
    proposer="draftsmith.serve.proposers.propose_eagle:eagle_proposer",
    formats={
        "vllm": "draftsmith.serve.export.export_eagle:EAGLE_VLLM",
        "sglang": "draftsmith.serve.export.export_eagle:EAGLE_SGLANG",
    },
    draft_shape=DraftShape(num_tokens=4, topk=1, total_tokens=0),
    draft_keys=("num_tokens", "topk", "total_tokens"),
)
