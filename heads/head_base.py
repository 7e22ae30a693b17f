"""What the EAGLE-style heads share: the one-layer Llama sizes (EagleConfig), the target's embedding and lm_head
they borrow, a rope table (HeadBase), SDPA's mask shape, and which target layers fused features read."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from draftsmith.runtime.llama import ModelConfig, Transformer, rope_tables

if TYPE_CHECKING:
    from typing_extensions import Self  # typing's from 3.11


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
    def from_target(cls, cfg: ModelConfig, **overrides) -> Self:
        """The head's layer has the target's sizes; overrides set the kind's own fields."""
        sizes = {k: getattr(cfg, k) for k in EagleConfig.__dataclass_fields__}
        return cls(**{**sizes, **overrides})

    def layer_config(self) -> ModelConfig:
        """A one-layer Llama config for the shared building blocks (no qk-norm: the head is plain Llama)."""
        sizes = {k: v for k, v in asdict(self).items() if k in ModelConfig.__dataclass_fields__}
        return ModelConfig(model_type="llama", num_hidden_layers=1, **sizes)


def borrow(model: Transformer | None, cfg: EagleConfig) -> tuple[nn.Embedding, nn.Linear]:
    """The target's embedding and lm_head (frozen), or frozen placeholders of their shape."""
    if model is not None:
        if (model.config.vocab_size, model.config.hidden_size) != (cfg.vocab_size, cfg.hidden_size):
            raise ValueError(
                f"target has vocab {model.config.vocab_size} / hidden {model.config.hidden_size}, "
                f"the head was made for vocab {cfg.vocab_size} / hidden {cfg.hidden_size}"
            )
        embed, lm_head = model.model.embed_tokens, model.lm_head
    else:
        embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    return embed.requires_grad_(False), lm_head.requires_grad_(False)


class HeadBase(nn.Module):
    """What both EAGLE heads share: a rope table for their one layer, sized like the target's."""

    config: EagleConfig
    fc: nn.Linear
    cos: Tensor  # rope tables (rope_cache's buffers): [max_len, head_dim]
    sin: Tensor

    def rope_cache(self, max_len: int) -> None:
        cos, sin = rope_tables(self.config.layer_config(), max_len)
        self.register_buffer("cos", cos.to(self.fc.weight.device), persistent=False)
        self.register_buffer("sin", sin.to(self.fc.weight.device), persistent=False)

    def rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)


def sdpa_mask(mask: Tensor | None) -> Tensor | None:
    return None if mask is None else mask.view(1, 1, *mask.shape)


def default_target_layers(num_layers: int) -> tuple[int, ...]:
    """The inputs of layers 2, L/2 and L-3 (clipped to the target): EAGLE-3's, and every kind that reads the same
    layers shares one feature cache with it."""
    n = num_layers
    return tuple(sorted({min(max(i, 0), n) for i in (2, n // 2, n - 3)}))
