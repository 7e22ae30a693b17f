"""P-EAGLE export: the speculators `peagle` checkpoint, which vLLM loads as eagle3 with
`parallel_drafting: true` (transformers_utils/configs/speculators/algos.py: update_peagle maps mask_token_id to
`pard_token`; models/llama_eagle3.py loads `mask_hidden` into a buffer and runs it through fc for every mask
slot), its validator's pieces, and the Format that puts them together (PEAGLE_VLLM).

Keys and config fields follow speculators 0.9.0 (models/peagle, models/eagle3/config.py) and vLLM's loader,
not memory: layers.{i}.* (layer 0 attends over [embed; feature]), fc, norm, lm_head, d2t/t2d (vLLM drops t2d and
reads d2t), mask_hidden [1, 1, k*H]; no embed_tokens (vLLM shares the target's), norm_before_residual false (the
residual is the raw fc output, as in the drafter).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from draftsmith.heads.drafter_folder import own_state
from draftsmith.heads.peagle import PEagleHead
from draftsmith.runtime.llama import ModelConfig
from draftsmith.serve.export.base import Export, Format, Source, llama_head_config
from draftsmith.serve.export.checks import (
    Probe,
    attention,
    attn_shapes,
    head_config_problems,
    linear,
    mlp,
    mlp_shapes,
    rms,
    t2d_pair,
)
from draftsmith.serve.export.export_eagle3 import eagle3_layer, eagle3_table
from draftsmith.serve.export.speculators import speculators_config, speculators_name


def peagle_speculators(src: Source[PEagleHead]) -> Export:
    """config.json in speculators' layout with a Llama transformer_layer_config; the drafter's own state (its
    names are speculators'), without an identity vocabulary map vLLM has no slot for."""
    c = src.head.config
    state = own_state(src.head)
    if c.draft_vocab_size == c.vocab_size:
        state = {k: v for k, v in state.items() if k not in ("d2t", "t2d")}
    if c.attention_bias:  # the engines' attention_bias gives o_proj a bias too
        state |= {f"layers.{i}.self_attn.o_proj.bias": torch.zeros(c.hidden_size) for i in range(c.num_layers)}
    return Export(expected_config(src), {"model.safetensors": state})


def peagle_config(src: Source[PEagleHead]) -> dict:
    """The top-level keys vLLM and speculators read (the layer config is checked key by key in peagle_problems)."""
    return {k: v for k, v in expected_config(src).items() if k != "transformer_layer_config"}


def expected_config(src: Source[PEagleHead]) -> dict:
    c = src.head.config
    layer = llama_head_config(src, "LlamaForCausalLM") | {"num_hidden_layers": c.num_layers}
    config = speculators_config(src, layer, "peagle", "PEagleSpeculator")
    return config | {"mask_token_id": c.mask_token_id, "embed_requires_grad": False}


# ---------------------------------------------------------------- validation


def peagle_shapes(src: Source[PEagleHead], config: dict) -> dict[str, tuple[int, ...]]:
    """EAGLE-3's table under speculators' names (layer 0), mask_hidden, then plain Llama layers 1.."""
    c = src.head.config
    h, bias = c.hidden_size, bool(c.attention_bias)
    s = {speculators_name(k): v for k, v in eagle3_table(c, bias).items()}
    s["mask_hidden"] = (1, 1, len(c.target_layers) * h)
    for i in range(1, c.num_layers):
        p = f"layers.{i}"
        s |= attn_shapes(f"{p}.self_attn", h, c, bias) | mlp_shapes(f"{p}.mlp", c)
        s |= {f"{p}.{n}.weight": (h,) for n in ("input_layernorm", "post_attention_layernorm")}
    return s


def peagle_problems(src: Source[PEagleHead], folder: Path, config: dict) -> list[str]:
    """Beyond peagle_config's keys: the layer config vLLM builds the drafter from, the mask token, and the layer
    config as a Llama config beside the target (positions, rope)."""
    layer, want_layer = config.get("transformer_layer_config") or {}, expected_config(src)["transformer_layer_config"]
    keys: tuple[str, ...] = ("model_type", "hidden_size", "intermediate_size", "num_attention_heads")
    keys += ("num_key_value_heads",)
    keys += ("head_dim", "num_hidden_layers", "vocab_size", "rms_norm_eps", "attention_bias")
    problems = [
        f"config.json transformer_layer_config.{k}={layer.get(k, '<missing>')!r}, expected {want_layer[k]!r}"
        for k in keys
        if layer.get(k) != want_layer[k]
    ]
    vocab = layer.get("vocab_size", 0)
    if not isinstance(config.get("mask_token_id"), int) or not 0 <= config["mask_token_id"] < vocab:
        problems.append(f"config.json mask_token_id={config.get('mask_token_id')!r} is not a token id below {vocab}")
    return problems + head_config_problems(src, folder, layer)


def vllm_forward(w: dict[str, Tensor], cfg: ModelConfig, embeds: Tensor, aux: Tensor, positions: Tensor) -> Tensor:
    """vLLM's Eagle3LlamaForCausalLM with parallel drafting, from the exported tensors: aux [n, k*H] with NaN
    rows at the mask slots, which read fc(mask_hidden) instead; layer 0: [norm(embed); hidden_norm(feature)] ->
    attention, residual = feature; layers 1..: plain pre-norm Llama layers; final norm, lm_head. Logits [n, Vd]."""
    eps, mask_slot = cfg.rms_norm_eps, aux.isnan().any(-1, keepdim=True)
    feat = torch.where(mask_slot, linear(w["mask_hidden"].view(1, -1), w, "fc"), linear(aux.nan_to_num(), w, "fc"))
    h = eagle3_layer(w, "layers.0", cfg, embeds, feat, positions)
    for i in range(1, cfg.num_hidden_layers):
        p = f"layers.{i}"
        h = h + attention(rms(h, w[f"{p}.input_layernorm.weight"], eps), w, f"{p}.self_attn", cfg, positions)
        h = h + mlp(rms(h, w[f"{p}.post_attention_layernorm.weight"], eps), w, f"{p}.mlp")
    return linear(rms(h, w["norm.weight"], eps), w, "lm_head")


def peagle_pairs(src: Source[PEagleHead], p: Probe[PEagleHead]) -> dict[str, tuple[Tensor, Tensor]]:
    """vLLM's drafting forward vs the drafter's over the probe's real pairs then num_depths-1 mask slots."""
    head, c, w = p.head, src.head.config, p.w
    n, k = p.tokens.numel(), c.num_depths - 1
    tokens = torch.cat([p.tokens, torch.full((k,), c.mask_token_id)])
    aux = torch.randn(n, len(c.target_layers) * c.hidden_size, generator=p.g)
    positions = torch.arange(3, 3 + n + k)
    embeds, cfg = head.embed_tokens(tokens), ModelConfig.from_hf(p.config["transformer_layer_config"])
    theirs = vllm_forward(w, cfg, embeds, torch.cat([aux, torch.full((k, aux.shape[1]), float("nan"))]), positions)
    feats = torch.cat([head.target_features(None, aux), head.mask_feature().expand(k, -1)])
    mine = head.logits(head(feats[None], tokens[None], positions)[0])
    ids = torch.arange(c.draft_vocab_size) + w.get("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
    return {"logits": (theirs, mine), "target ids": (ids, head.vocab_ids)} | t2d_pair(w, head)


# P-EAGLE in speculators' `peagle` layout, which vLLM loads as eagle3 drafting all tokens in one forward
PEAGLE_VLLM = Format(
    export=peagle_speculators,
    shapes=peagle_shapes,
    config=peagle_config,
    forward=peagle_pairs,
    problems=peagle_problems,
    vllm="eagle3",
    vllm_options=(("parallel_drafting", True),),
    vllm_alone=True,
)
