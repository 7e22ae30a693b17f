"""DFlash export: vLLM's native `dflash` layout, and its validator.

Checked against vLLM 0.32's loader, not memory (model_executor/models/qwen3_dflash.py, config/speculative.py,
transformers_utils/configs/eagle.py, v1/worker/gpu/spec_decode/eagle/eagle3_utils.py):
- config.json: a Qwen3 config (`model_type: qwen3`, the draft's sizes, num_hidden_layers = its layers, the
  target's vocab_size and rope) with `architectures: ["DFlashDraftModel"]` (registry: DFlashQwen3ForCausalLM),
  `draft_vocab_size`, `block_size` and `dflash_config: {mask_token_id, target_layer_ids, block_size}`. vLLM's
  target_layer_ids count one lower than the layer inputs draftsmith (and EAGLE-3's aux ids) name: it adds 1 back
  to pick the target's captured hidden states. No layer_types / is_causal / dflash_config.causal: every layer is
  then non-causal, as trained.
- weights: fc, hidden_norm, layers.{i}.self_attn.{q,k,v,o}_proj / q_norm / k_norm, layers.{i}.mlp.*,
  layers.{i}.input_layernorm / post_attention_layernorm, norm, lm_head and d2t (draft_id_to_target_id; t2d is
  skipped) when the draft vocabulary is smaller than the target's; no embed_tokens (vLLM shares the target's) and
  no mask_hidden (its loader refuses one). The context enters each layer's k/v projections as
  hidden_norm(fc(aux)) with no input norm, k_norm then rope: precompute_and_store_context_kv.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from draftsmith.heads.dflash import DFlashHead
from draftsmith.heads.drafter_folder import own_state
from draftsmith.runtime.kv_cache import KVCache
from draftsmith.runtime.llama import ModelConfig, rope_inv_freq
from draftsmith.serve.export.base import Export, Format, Source, llama_head_config
from draftsmith.serve.export.checks import (
    Probe,
    attn_shapes,
    head_config_problems,
    linear,
    mlp,
    mlp_shapes,
    rms,
    rotate,
)


def dflash_vllm(src: Source[DFlashHead]) -> Export:
    return Export(expected_config(src), {"model.safetensors": vllm_state(src)})


def vllm_state(src: Source[DFlashHead]) -> dict[str, Tensor]:
    """The head's own tensors as vLLM's DFlash backbone loads them (DSpark's heads ride along by their names)."""
    c = src.head.config
    state = own_state(src.head)
    if c.draft_vocab_size == c.vocab_size:  # vLLM then uses the target's lm_head and needs no id map
        state = {k: v for k, v in state.items() if k not in ("lm_head.weight", "d2t", "t2d")}
    if c.attention_bias:  # vLLM's DFlash gives o_proj a bias whenever the attention has one
        state |= {f"layers.{i}.self_attn.o_proj.bias": torch.zeros(c.hidden_size) for i in range(c.num_layers)}
    return state


def expected_config(src: Source[DFlashHead]) -> dict:
    return backbone_config(src, "DFlashDraftModel")


def backbone_config(src: Source[DFlashHead], arch: str) -> dict:
    """A Qwen3 config of the draft layers under `arch`, with the block and the context's target layers."""
    c = src.head.config
    config = llama_head_config(src, arch) | {"model_type": "qwen3", "num_hidden_layers": c.num_layers}
    return config | {
        "draft_vocab_size": c.draft_vocab_size,
        "block_size": c.block_size,
        "dflash_config": {
            "mask_token_id": c.mask_token_id,
            "target_layer_ids": [i - 1 for i in c.target_layers],
            "block_size": c.block_size,
        },
    }


def dflash_shapes(src: Source[DFlashHead], config: dict) -> dict[str, tuple[int, ...]]:
    c, bias = src.head.config, bool(config.get("attention_bias"))
    h, d = c.hidden_size, c.head_dim
    s = {"fc.weight": (h, len(c.target_layers) * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for i in range(c.num_layers):
        p = f"layers.{i}"
        s |= attn_shapes(f"{p}.self_attn", h, c, bias) | mlp_shapes(f"{p}.mlp", c)
        s |= {f"{p}.self_attn.q_norm.weight": (d,), f"{p}.self_attn.k_norm.weight": (d,)}
        s |= {f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,)}
    if c.draft_vocab_size < c.vocab_size:
        s |= {"lm_head.weight": (c.draft_vocab_size, h), "d2t": (c.draft_vocab_size,), "t2d": (c.vocab_size,)}
    return s


def dflash_config(src: Source[DFlashHead]) -> dict:
    """The config.json keys vLLM's DFlash path reads, with the values the drafter implies."""
    return {k: v for k, v in expected_config(src).items() if k in KEYS_READ}


def dflash_problems(src: Source[DFlashHead], folder: Path, config: dict) -> list[str]:
    problems = head_config_problems(src, folder, config)
    if "layer_types" in config or "is_causal" in config or "causal" in config.get("dflash_config", {}):
        problems.append("config.json sets layer_types / is_causal / dflash_config.causal: vLLM may run it causal")
    return problems


KEYS_READ = (  # what vLLM's DFlash path reads from config.json
    "architectures",
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_hidden_layers",
    "rms_norm_eps",
    "vocab_size",
    "attention_bias",
    "draft_vocab_size",
    "dflash_config",
)


# ---------------------------------------------------------------- vLLM's DFlash forward, from exported tensors


def roped(x: Tensor, positions: Tensor, cfg: ModelConfig) -> Tensor:
    freqs = positions.float()[:, None] * rope_inv_freq(cfg)[None]
    return rotate(x, torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin())


def heads(x: Tensor, n_heads: int, d: int) -> Tensor:
    return x.view(x.shape[0], n_heads, d).transpose(0, 1)


def dflash_forward(
    w, cfg: ModelConfig, aux: Tensor, embeds: Tensor, start: int
) -> tuple[Tensor, Tensor | None, Tensor]:
    """precompute_and_store_context_kv then the model's forward: context = hidden_norm(fc(aux)) [start, k*H] at
    positions 0..start-1 gives each layer's keys and values; the block embeds [B, H] at start.. attends to all of
    them and to itself (non-causal). Returns the last hidden states (after norm), the draft-vocabulary logits (None
    without a draft vocabulary) and each draft id's target id."""
    eps, d, nh, nkv = cfg.rms_norm_eps, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    context = rms(linear(aux, w, "fc"), w["hidden_norm.weight"], eps)
    ctx_pos, pos = torch.arange(start), torch.arange(start, start + embeds.shape[0])
    x = embeds
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}.self_attn"
        norm = w[f"{p}.k_norm.weight"]
        ck = roped(rms(heads(linear(context, w, f"{p}.k_proj"), nkv, d), norm, eps), ctx_pos, cfg)
        cv = heads(linear(context, w, f"{p}.v_proj"), nkv, d)
        h = rms(x, w[f"layers.{i}.input_layernorm.weight"], eps)
        q = roped(rms(heads(linear(h, w, f"{p}.q_proj"), nh, d), w[f"{p}.q_norm.weight"], eps), pos, cfg)
        k = torch.cat([ck, roped(rms(heads(linear(h, w, f"{p}.k_proj"), nkv, d), norm, eps), pos, cfg)], 1)
        v = torch.cat([cv, heads(linear(h, w, f"{p}.v_proj"), nkv, d)], 1)
        k, v = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
        out = ((q @ k.transpose(-1, -2)) * d**-0.5).softmax(-1) @ v  # no mask: context and the whole block
        x = x + linear(out.transpose(0, 1).reshape(x.shape[0], nh * d), w, f"{p}.o_proj")
        x = x + mlp(rms(x, w[f"layers.{i}.post_attention_layernorm.weight"], eps), w, f"layers.{i}.mlp")
    hidden = rms(x, w["norm.weight"], eps)
    if "lm_head.weight" not in w:  # the full vocabulary: vLLM runs the target's own lm_head
        return hidden, None, torch.arange(cfg.vocab_size)
    vd = w["lm_head.weight"].shape[0]
    return hidden, hidden @ w["lm_head.weight"].T, torch.arange(vd) + w.get("d2t", torch.zeros(vd, dtype=torch.long))


Forward = Callable[[Tensor, Tensor, int], tuple[Tensor, Tensor | None, Tensor]]  # (aux, block, start) -> outputs


def drafted_block(head: DFlashHead, g: torch.Generator, first: Tensor) -> tuple[Tensor, int, Tensor]:
    """A random context of 7 positions (its target features [7, k*H]), where the block starts (7), and the
    drafter's own layers' output [block_size, H] on the block from token `first` there."""
    c, start = head.config, 7
    aux = torch.randn(start, len(c.target_layers) * c.hidden_size, generator=g)
    slots = start + c.block_size
    cache = KVCache.allocate(c.num_layers, c.num_key_value_heads, c.head_dim, slots, torch.float32, "cpu")
    head.write_context(head.target_features(None, aux), torch.arange(start), cache, 0)
    return aux, start, head.draft(head.block_tokens(first), start, cache)


def block_pairs(head: DFlashHead, g: torch.Generator, first: Tensor, forward: Forward) -> dict[str, tuple]:
    """name -> (an export's forward, the drafter's own drafting) of the block from token `first` at position 7,
    after a random context of 7 positions. forward(the context's target features [7, k*H], the block's tokens,
    7) -> (the last hidden states after norm, the draft vocabulary's logits or None, each draft id's target id)."""
    aux, start, mine = drafted_block(head, g, first)
    block = head.block_tokens(first)
    hidden, logits, ids = forward(aux, block, start)
    pairs = {"hidden": (hidden, head.norm(mine)), "target ids": (ids, head.vocab_ids)}
    return pairs | ({"logits": (logits, head.logits(mine))} if logits is not None else {})


def dflash_pairs(src: Source[DFlashHead], p: Probe[DFlashHead]) -> dict[str, tuple]:
    """name -> (vLLM's forward from the export, the drafter's own drafting) on the same random context and block."""
    cfg = ModelConfig.from_hf(p.config | {"model_type": "qwen3"})

    def forward(aux: Tensor, block: Tensor, start: int):
        return dflash_forward(p.w, cfg, aux, p.head.embed_tokens(block), start)

    return block_pairs(p.head, p.g, p.tokens[0], forward)


# vLLM's DFlashDraftModel (dflash_config, non-causal block)
DFLASH_VLLM = Format(
    export=dflash_vllm,
    shapes=dflash_shapes,
    config=dflash_config,
    forward=dflash_pairs,
    problems=dflash_problems,
    vllm="dflash",
)
