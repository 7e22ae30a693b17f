"""P-EAGLE head (arXiv 2602.01469): an EAGLE-3 drafter that drafts K tokens in one forward pass.

After the real pairs (fused target feature_i, token_{i+1}) come K-1 mask slots: each takes the mask token and
the learned `mask_hidden` (k*H, the width of the fused target layers, so it goes through fc like a real feature)
at the next positions. Attention stays causal, so the last real pair predicts draft 1 and mask slot d predicts
draft d+1. The first layer is EAGLE-3's (attention over [embed; feature], 2H); layers 2..4 are plain Llama
layers on its output. Parameter names are the speculators `peagle` checkpoint's (layers.{i}.*, fc, norm, lm_head,
d2t, t2d, mask_hidden), which vLLM loads as eagle3 with parallel drafting. The embedding stays the target's
(frozen, not saved), so the mask token's embedding is the target's row for it; mask_hidden carries the learning.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from draftsmith.heads.eagle3 import Eagle3Config, Eagle3Head
from draftsmith.runtime.kv_cache import KVCache
from draftsmith.runtime.llama import DecoderLayer, ModelConfig, Transformer

from .head_base import sdpa_mask
from .kinds import DraftShape, Kind

MAX_LAYERS = 4


@dataclass
class PEagleConfig(Eagle3Config):
    num_layers: int = 1  # decoder layers, 1..4 (head.num_layers sweeps draft size)
    num_depths: int = 4  # K: tokens drafted per forward (the last real pair + K-1 mask slots), the depths trained
    mask_token_id: int = 0  # the mask slots' token: a target id (default: the target's first EOS id)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.num_layers <= MAX_LAYERS:
            raise ValueError(f"peagle num_layers must be in [1, {MAX_LAYERS}], got {self.num_layers}")
        if self.num_depths < 1:
            raise ValueError(f"peagle num_depths (tokens per draft) must be >= 1, got {self.num_depths}")
        if self.norm_before_fc or self.norm_output or self.norm_before_residual or self.qk_norm:
            raise ValueError(
                "peagle takes none of norm_before_fc, norm_output, norm_before_residual, qk_norm (EAGLE-3 options): "
                "drop them"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"peagle mask_token_id={self.mask_token_id} is not in the target's vocabulary of {self.vocab_size} "
                f"tokens: retrain with head.args.mask_token_id in [0, {self.vocab_size})"
            )

    @classmethod
    def from_target(cls, cfg: ModelConfig, **overrides) -> PEagleConfig:
        if overrides.get("mask_token_id") is None:  # speculators' fallback when the tokenizer has no mask token
            overrides["mask_token_id"] = cfg.eos_token_ids[0] if cfg.eos_token_ids else 0
        return super().from_target(cfg, **overrides)


class PEagleHead(Eagle3Head):
    config: PEagleConfig

    def __init__(self, cfg: PEagleConfig, model: Transformer | None = None) -> None:
        super().__init__(cfg, model)
        first = self.midlayer  # EAGLE-3's layer becomes layers[0], the name speculators and vLLM give it
        del self.midlayer
        rest = [DecoderLayer(cfg.layer_config()) for _ in range(cfg.num_layers - 1)]
        self.layers = nn.ModuleList([first, *rest]).to(self.fc.weight.device)
        self.mask_hidden = nn.Parameter(torch.randn(1, 1, self.fc.in_features, device=self.fc.weight.device))

    def mask_feature(self) -> Tensor:
        """[H]: what a mask slot reads in place of a fused target feature."""
        return self.fc(self.mask_hidden.view(-1).to(self.fc.weight.dtype))

    def forward(
        self,
        feature: Tensor,
        tokens: Tensor,
        positions: Tensor,
        cache: KVCache | None = None,
        start: int = 0,
        mask: Tensor | None = None,
    ) -> Tensor:
        """As Eagle3Head.forward, through every layer (cache: one K/V per layer); returns the last layer's
        output. positions [n], or [b, n] for per-row positions (training). mask: bool [n, start+n] with a
        cache, or [b, n, n] without one (None: causal)."""
        embeds = self.embed_tokens(tokens).to(self.fc.weight.dtype)  # the borrowed embedding may be wider
        cos, sin = self.rope(positions, embeds.dtype)
        if positions.dim() == 2:
            cos, sin = cos[:, None], sin[:, None]
        m = mask[:, None] if mask is not None and mask.dim() == 3 else sdpa_mask(mask)
        x = feature.to(embeds.dtype)
        for i, layer in enumerate(self.layers):
            kc, vc = (cache.k[i], cache.v[i]) if cache is not None else (None, None)
            if i == 0:
                x = layer(embeds, x, cos, sin, kc, vc, start, m)
            else:
                x = layer(x, cos, sin, kc, vc, start, m)
        return x

    def unroll(self, feature: Tensor, tokens: Tensor, steps: int) -> list[Tensor]:
        raise NotImplementedError("P-EAGLE trains its depths with mask slots (cod_forward), not by unrolling")

    def cod_forward(self, feature: Tensor, tokens: Tensor, anchors: list[Tensor]) -> list[Tensor]:
        """Training over m pairs: feature [b, m, H] fused target features 0..m-1, tokens [b, m] (token_{i+1}).
        anchors[d-1] [b, s_d]: the pairs whose depth d is trained (nested: depth d's within depth d-1's).
        Depth 0 is every pair at position i+1; depth d at anchor a is a mask slot at position a+1+d that sees
        the real pairs 0..a and its own mask slots 1..d: what drafting sees when pair a is the last real one.
        One forward over all of them under that mask. Returns each depth's outputs: [b, m, H], then [b, s_d, H]."""
        b, m, _ = feature.shape
        dev, sizes = tokens.device, [m, *(a.shape[1] for a in anchors)]
        anchor = torch.cat([torch.arange(m, device=dev).expand(b, m), *anchors], dim=1)  # [b, T]
        depth = torch.cat([torch.full((s,), d, device=dev) for d, s in enumerate(sizes)]).expand(b, -1)
        masked = (depth > 0)[..., None]
        real = nn.functional.pad(feature.to(self.fc.weight.dtype), (0, 0, 0, anchor.shape[1] - m))
        feats = torch.where(masked, self.mask_feature(), real)
        toks = nn.functional.pad(tokens, (0, anchor.shape[1] - m), value=self.config.mask_token_id)
        out = self(feats, toks, anchor + 1 + depth, mask=cod_mask(anchor, depth))
        return list(out.split(sizes, dim=1))


def cod_mask(anchor: Tensor, depth: Tensor) -> Tensor:
    """bool [b, T, T], True = attend: a row sees the real pairs (depth 0) up to its anchor, and the mask slots
    of its own anchor up to its depth."""
    qa, qd, ka, kd = anchor[:, :, None], depth[:, :, None], anchor[:, None], depth[:, None]
    return ((kd == 0) & (ka <= qa)) | ((ka == qa) & (kd > 0) & (kd <= qd))


KIND = Kind(
    name="peagle",
    config=PEagleConfig,
    module=PEagleHead,
    features=("hidden", "aux"),
    loss="draftsmith.train.loss_peagle:peagle_loss",
    proposer="draftsmith.serve.proposers.propose_peagle:peagle_proposer",
    formats={"vllm": "draftsmith.serve.export.export_peagle:PEAGLE_VLLM"},
    # a chain of the K=4 trained depths: one forward drafts all four, so depth costs ~nothing on a CPU, and a
    # chain keeps verification at 5 rows (a tree's extra rows cost verify time the CPU does not have)
    draft_shape=DraftShape(num_tokens=4, topk=1, total_tokens=0),
    draft_keys=("num_tokens", "topk", "total_tokens"),
    max_depth="num_depths",
)
