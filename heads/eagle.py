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

from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

from .drafter import restricted_linear
from .kinds import DraftShape, Kind, register
from .kv_cache import KVCache
from .llama import DecoderLayer, ModelConfig, Transformer, rope_tables


@dataclass
class EagleConfig:
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int = 128
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    vocab_size: int = 32000
    attention_bias: bool = False

    @classmethod
    def from_target(cls, cfg: ModelConfig, **overrides):
        """The head's layer has the target's sizes; overrides set the kind's own fields."""
        sizes = {k: getattr(cfg, k) for k in EagleConfig.__dataclass_fields__}
        return cls(**{**sizes, **overrides})

    def layer_config(self) -> ModelConfig:
        """A one-layer Llama config for the shared building blocks (no qk-norm: the head is plain Llama)."""
        sizes = {k: v for k, v in asdict(self).items() if k in ModelConfig.__dataclass_fields__}
        return ModelConfig(model_type="llama", num_hidden_layers=1, **sizes)


def borrow(target: Transformer | None, cfg: EagleConfig) -> tuple[nn.Embedding, nn.Linear]:
    """The target's embedding and lm_head (frozen), or frozen placeholders of their shape."""
    if target is not None:
        if (target.config.vocab_size, target.config.hidden_size) != (cfg.vocab_size, cfg.hidden_size):
            raise ValueError(
                f"target has vocab {target.config.vocab_size} / hidden {target.config.hidden_size}, "
                f"the head was made for vocab {cfg.vocab_size} / hidden {cfg.hidden_size}"
            )
        embed, lm_head = target.model.embed_tokens, target.lm_head
    else:
        embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    return embed.requires_grad_(False), lm_head.requires_grad_(False)


class HeadBase(nn.Module):
    """What both EAGLE heads share: a rope table for their one layer, sized like the target's."""

    config: EagleConfig
    fc: nn.Linear

    def rope_cache(self, max_len: int) -> None:
        cos, sin = rope_tables(self.config.layer_config(), max_len)
        self.register_buffer("cos", cos.to(self.fc.weight.device), persistent=False)
        self.register_buffer("sin", sin.to(self.fc.weight.device), persistent=False)

    def rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)


def sdpa_mask(mask: Tensor | None) -> Tensor | None:
    return None if mask is None else mask.view(1, 1, *mask.shape)


class EagleHead(HeadBase):
    shared_prefixes = ("embed_tokens.", "lm_head.")
    target_layers: tuple[int, ...] = ()  # EAGLE-1 reads the target's final hidden states (ForwardOut.hidden)

    def __init__(self, cfg: EagleConfig, target: Transformer | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens, self.lm_head = borrow(target, cfg)
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


register(
    Kind(
        name="eagle",
        config=EagleConfig,
        module=EagleHead,
        loss="draftsmith.train.losses:eagle_loss",
        proposer="draftsmith.serve.proposers.propose_eagle:eagle_proposer",
        formats={
            "vllm": "draftsmith.serve.export.export_eagle:EAGLE_VLLM",
            "sglang": "draftsmith.serve.export.export_eagle:EAGLE_SGLANG",
        },
        draft_shape=DraftShape(num_tokens=4, topk=1, total_tokens=0),
        draft_keys=("num_tokens", "topk", "total_tokens"),
    )
)
