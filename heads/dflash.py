"""DFlash head (arXiv 2602.06036): a block drafter conditioned on the target's hidden states.

The context is the target's inputs to a few layers, fused: hidden_norm(fc(aux)). Each draft layer projects it
with its own k_proj / v_proj (k_norm, rope at the token's position) into keys and values; the block's queries
come from the embedded block [last accepted token, mask, ..., mask] at the next positions. A block attends to
all context before its first token and to the whole block (non-causal), so one forward drafts block_size - 1
tokens: slot i predicts the token i places after the first. The layers are Qwen3-style (q_norm / k_norm), the
parameter names those of vLLM's and speculators' DFlash (fc, hidden_norm, layers.{i}.*, norm, lm_head, d2t, t2d).

The embedding is the target's (frozen, not saved): the mask slots read the target's row of mask_token_id. The
output layer is the target's lm_head restricted to a draft vocabulary (the training answers' most frequent
tokens; on a CPU the full 49k-row lm_head would cost more than the layers): a frozen copy of those rows, saved
with d2t / t2d so that serving and export need no target weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from draftsmith.heads.eagle3 import DRAFT_VOCAB
from draftsmith.runtime.kv_cache import KVCache
from draftsmith.runtime.llama import DecoderLayer, ModelConfig, RMSNorm, Transformer, apply_rope

from .draft_vocab import DraftVocabHead
from .head_base import EagleConfig, borrow, default_target_layers
from .kinds import DraftShape, Kind

MAX_LAYERS = 4


@dataclass
class DFlashConfig(EagleConfig):
    target_layers: tuple[int, ...] = (2, 16, 29)  # inputs of these target layers (L = the last layer's output)
    num_layers: int = 1  # draft decoder layers, 1..4 (head.num_layers sweeps draft size)
    block_size: int = 4  # slots per forward: the last accepted token + block_size - 1 mask slots (the drafts)
    mask_token_id: int = 0  # the mask slots' token, a target id (default: the target's first EOS id)
    draft_vocab_size: int = DRAFT_VOCAB

    def __post_init__(self) -> None:
        self.target_layers = tuple(self.target_layers)  # a list after a JSON round trip
        layers = self.target_layers
        if not layers or list(layers) != sorted(set(layers)) or layers[0] < 0:
            raise ValueError(f"target_layers must be distinct, ascending and >= 0, got {layers}")
        if not 1 <= self.num_layers <= MAX_LAYERS:
            raise ValueError(f"dflash num_layers must be in [1, {MAX_LAYERS}], got {self.num_layers}")
        if not 2 <= self.block_size <= self.max_position_embeddings:
            raise ValueError(
                f"dflash block_size must be in [2, {self.max_position_embeddings}] (the target's context), got "
                f"{self.block_size}: a block is the last accepted token and block_size - 1 drafts"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"dflash mask_token_id={self.mask_token_id} is not in the target's vocabulary of {self.vocab_size} "
                f"tokens: retrain with head.args.mask_token_id in [0, {self.vocab_size})"
            )
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, {self.vocab_size}], got {self.draft_vocab_size}")

    @classmethod
    def from_target(cls, cfg: ModelConfig, **overrides) -> DFlashConfig:
        n = cfg.num_hidden_layers
        layers = tuple(overrides.pop("target_layers", None) or default_target_layers(n))
        check_layers(layers, n, "the target")
        if overrides.get("mask_token_id") is None:
            overrides["mask_token_id"] = cfg.eos_token_ids[0] if cfg.eos_token_ids else 0
        overrides.setdefault("draft_vocab_size", min(DRAFT_VOCAB, cfg.vocab_size))
        return super().from_target(cfg, target_layers=layers, **overrides)

    def layer_config(self) -> ModelConfig:
        """The draft layers' Llama config, with Qwen3's per-head q/k norms (vLLM's DFlash layer has them)."""
        c = super().layer_config()
        c.num_hidden_layers, c.qk_norm = self.num_layers, True
        return c


def check_layers(layers: tuple[int, ...], num_layers: int, what: str) -> None:
    """Refuse target layers past the target's last (L = the last layer's output is the highest there is)."""
    if max(layers) > num_layers:
        raise ValueError(
            f"dflash target_layers {list(layers)} name layers {what} does not have (it has {num_layers} layers, "
            f"the last being {num_layers}): set head.target_layers within them, or train a drafter for this target"
        )


class DFlashHead(DraftVocabHead):
    config: DFlashConfig

    def __init__(self, cfg: DFlashConfig, model: Transformer | None = None) -> None:
        super().__init__()
        self.config = cfg
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        if model is not None:
            check_layers(cfg.target_layers, model.config.num_hidden_layers, "the target")
        self.embed_tokens, self.target_lm_head = borrow(model, cfg)
        self.fc = nn.Linear(len(cfg.target_layers) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, eps)
        self.layers = nn.ModuleList(DecoderLayer(cfg.layer_config()) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(h, eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False).requires_grad_(False)  # target rows, frozen
        self.vocab_buffers()
        self.rope_cache(cfg.max_position_embeddings)
        if model is not None:
            with torch.no_grad():
                self.norm.weight.copy_(model.model.norm.weight)
            self.copy_target_rows()

    def target_features(self, hidden: Tensor | None, aux: Tensor | None) -> Tensor:
        """The context: hidden_norm(fc(the target's layer inputs [.., k*H])) [.., H]."""
        if aux is None:
            raise ValueError(f"DFlash needs the target's inputs to layers {self.config.target_layers}")
        return self.hidden_norm(self.fc(aux.to(self.fc.weight.dtype)))

    def embed(self, tokens: Tensor) -> Tensor:
        return self.embed_tokens(tokens).to(self.fc.weight.dtype)  # the borrowed embedding may be wider

    def decoder_layers(self) -> Sequence[DecoderLayer]:
        """`layers`, typed as what they are (nn.ModuleList types its items as plain Modules)."""
        return cast("Sequence[DecoderLayer]", self.layers)

    def block_tokens(self, first: Tensor) -> Tensor:
        """[..] first tokens -> [.., block_size] blocks: the token, then mask slots."""
        mask = torch.full((*first.shape, self.config.block_size - 1), self.config.mask_token_id, device=first.device)
        return torch.cat([first[..., None], mask], dim=-1)

    def write_context(self, context: Tensor, positions: Tensor, cache: KVCache, start: int) -> None:
        """Each layer's keys and values of context [n, H] (at positions [n]) into cache slots [start, start+n)."""
        cos, sin = self.rope(positions, context.dtype)
        for i, layer in enumerate(self.decoder_layers()):
            k, v = context_kv(layer, context[None], cos, sin)
            cache.k[i][:, :, start : start + k.shape[2]] = k
            cache.v[i][:, :, start : start + v.shape[2]] = v

    def draft(self, tokens: Tensor, start: int, cache: KVCache) -> Tensor:
        """One block: tokens [block_size] at positions start.. (slots start..), attending to cache slots [0, start)
        (context, written by write_context) and to the whole block. Returns the layers' output [block_size, H]."""
        n = tokens.numel()
        cos, sin = self.rope(torch.arange(start, start + n, device=tokens.device), self.fc.weight.dtype)
        visible = torch.ones(1, 1, n, start + n, dtype=torch.bool, device=tokens.device)  # non-causal block
        x = self.embed(tokens)[None]
        for i, layer in enumerate(self.decoder_layers()):
            x = layer(x, cos, sin, cache.k[i], cache.v[i], start, visible)
        return x[0]

    def anchored(self, context: Tensor, tokens: Tensor, anchors: Tensor) -> Tensor:
        """Training: context [b, n, H] (target_features of every position), tokens [b, n], anchors [b, A] -> the
        layers' output [b, A, block_size, H]. The block of anchor a holds token a then mask slots at positions
        a, a+1, ...; it sees the context of positions < a and its own block, as drafting with a as the pending
        token does. All blocks run in one forward under that mask."""
        b, n, _ = context.shape
        blocks = self.block_tokens(tokens.gather(1, anchors))  # [b, A, B]
        a, s = anchors.shape[1], self.config.block_size
        pos = (anchors[..., None] + torch.arange(s, device=anchors.device)).flatten(1)  # [b, A*B]
        cos, sin = self.rope(pos, context.dtype)
        ccos, csin = self.rope(torch.arange(n, device=tokens.device), context.dtype)
        mask = anchored_mask(anchors, n, s)[:, None]
        x = self.embed(blocks.flatten(1)).to(context.dtype)
        for layer in self.decoder_layers():
            x = layer_with_context(layer, x, context, (cos[:, None], sin[:, None]), (ccos, csin), mask)
        return x.view(b, a, s, -1)


def context_kv(layer: DecoderLayer, context: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """The layer's keys and values of context [b, n, H]: [b, kv_heads, n, head_dim] each, k normed and roped.
    The context enters without the layer's input norm: it is hidden_norm'ed once for all layers."""
    attn = layer.self_attn
    b, n, _ = context.shape
    k = attn.k_norm(attn.k_proj(context).view(b, n, attn.n_kv, attn.head_dim))
    v = attn.v_proj(context).view(b, n, attn.n_kv, attn.head_dim)
    return apply_rope(k.transpose(1, 2), cos, sin), v.transpose(1, 2)


def layer_with_context(layer: DecoderLayer, x: Tensor, context: Tensor, rope_x, rope_c, mask: Tensor) -> Tensor:
    """x [b, m, H] through the layer, attending to the context's keys and values then its own, under mask
    [b, 1, m, n + m] (True = attend)."""
    attn = layer.self_attn
    b, m, _ = x.shape
    q, k, v = attn.qkv(layer.input_layernorm(x), *rope_x)
    ck, cv = context_kv(layer, context, *rope_c)
    out = F.scaled_dot_product_attention(
        q, torch.cat([ck, k], dim=2), torch.cat([cv, v], dim=2), attn_mask=mask, enable_gqa=True
    )
    x = x + attn.o_proj(out.transpose(1, 2).reshape(b, m, -1))
    return x + layer.mlp(layer.post_attention_layernorm(x))


def anchored_mask(anchors: Tensor, n: int, block_size: int) -> Tensor:
    """bool [b, A*B, n + A*B]: a block's rows see context positions before its anchor and its own block."""
    b, a = anchors.shape
    dev = anchors.device
    owner = torch.arange(a, device=dev).repeat_interleave(block_size)  # [A*B]: the anchor of each block row
    context = torch.arange(n, device=dev) < anchors[:, owner, None]  # [b, A*B, n]
    own = (owner[:, None] == owner[None, :]).expand(b, -1, -1)  # [b, A*B, A*B]
    return torch.cat([context, own], dim=-1)


KIND = Kind(
    name="dflash",
    config=DFlashConfig,
    module=DFlashHead,
    features=("hidden", "aux"),  # aux: the fused context; hidden: the loss's target distribution
    loss="draftsmith.train.loss_dflash:dflash_loss",
    proposer="draftsmith.serve.proposers.propose_dflash:dflash_proposer",
    formats={
        "vllm": "draftsmith.serve.export.export_dflash:DFLASH_VLLM",
        "gguf": "draftsmith.serve.export.export_dflash_gguf:DFLASH_GGUF",
    },
    # a chain of the default block's 3 drafts (block_size 4): on a CPU one block forward costs about one EAGLE-3
    # level whatever B is (a few rows through weights read once), but each verified row costs ~0.04 of a
    # target step in fp32 and a quick drafter accepts little past position 3; conf/tuning/dflash-quick.yaml
    draft_shape=DraftShape(num_tokens=3, topk=1, total_tokens=0),
    draft_keys=("num_tokens", "topk", "total_tokens"),
    max_depth="block_size",
    max_depth_less=1,
)
