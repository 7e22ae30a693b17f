"""EAGLE-3 heads out: vLLM's and SGLang's LlamaForCausalLMEagle3 (our parameter names are theirs), with its
validator's table, config keys and forward; speculators.py writes the same head in vLLM's speculators format."""

from __future__ import annotations

import torch
from torch import Tensor

from draftsmith.heads.drafter_folder import own_state
from draftsmith.heads.eagle3 import Eagle3Head
from draftsmith.runtime.llama import ModelConfig
from draftsmith.serve.export.base import NORM_SWITCHES, Export, Format, Source, llama_head_config
from draftsmith.serve.export.checks import (
    Probe,
    Shapes,
    attention,
    attn_shapes,
    head_config_problems,
    linear,
    mlp,
    mlp_shapes,
    rms,
    t2d_pair,
)
from draftsmith.serve.export.export_eagle import eagle_config


def eagle3_vllm(src: Source[Eagle3Head]) -> Export:
    """vLLM's and SGLang's LlamaForCausalLMEagle3: our parameter names already are theirs."""
    c = src.head.config
    state = own_state(src.head)
    if c.draft_vocab_size == c.vocab_size:  # no draft vocabulary: vLLM has no slot for an identity d2t
        state = {k: v for k, v in state.items() if k not in ("d2t", "t2d")}
    if c.attention_bias:
        state["midlayer.self_attn.o_proj.bias"] = torch.zeros(c.hidden_size)  # engines' attention_bias has o bias
    eagle = {"eagle_aux_hidden_state_layer_ids": list(c.target_layers), "use_aux_hidden_state": True}
    config = llama_head_config(src, "LlamaForCausalLMEagle3") | {
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.hidden_size,
        "eagle_config": eagle | ({"norm_before_fc": True} if c.norm_before_fc else {}),
    }
    # EAGLE-3.1's switches where set (vLLM reads both at the top, norm_before_fc in eagle_config first; llama.cpp
    # reads norm_before_fc at the top): unset, the folder stays what engines without them load
    config |= {k: True for k in EAGLE31_KEYS if getattr(c, k, False)}
    # llama.cpp's converter reads the layer ids only at the top (else it assumes [2, L/2, L-3]); vLLM in eagle_config
    config["eagle_aux_hidden_state_layer_ids"] = list(c.target_layers)
    return Export(config, {"model.safetensors": state})


EAGLE31_KEYS = NORM_SWITCHES  # Eagle3Config's norm switches


def eagle3_shapes(src: Source[Eagle3Head], config: dict) -> Shapes:
    return eagle3_table(src.head.config, bool(config.get("attention_bias")))


def eagle3_table(c, bias: bool) -> Shapes:
    """An EAGLE-3 head of config c in the LlamaForCausalLMEagle3 names (also what serve/export/external_heads.py
    reads)."""
    h = c.hidden_size
    s = {"fc.weight": (h, len(c.target_layers) * h), **attn_shapes("midlayer.self_attn", 2 * h, c, bias)}
    s |= mlp_shapes("midlayer.mlp", c)
    s |= {f"midlayer.{n}.weight": (h,) for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")}
    s |= {"norm.weight": (h,), "lm_head.weight": (c.draft_vocab_size, h)}
    if c.draft_vocab_size < c.vocab_size:
        s |= {"d2t": (c.draft_vocab_size,), "t2d": (c.vocab_size,)}
    if getattr(c, "norm_before_fc", False):
        s["input_norm.weight"] = (len(c.target_layers) * h,)
    return s


def eagle3_config(src: Source[Eagle3Head]) -> dict:
    """What vLLM reads: the layer ids in eagle_config; the EAGLE-3.1 switches that are on, at the top (and
    norm_before_fc in eagle_config too, where vLLM looks first)."""
    c = src.head.config
    ids = {"eagle_aux_hidden_state_layer_ids": list(c.target_layers), "use_aux_hidden_state": True}
    on = {k: True for k in EAGLE31_KEYS if getattr(c, k, False)}
    want = eagle_config(src, "LlamaForCausalLMEagle3") | on
    ids |= {k: v for k, v in on.items() if k == "norm_before_fc"}
    want |= {"eagle_aux_hidden_state_layer_ids": list(c.target_layers)}
    return want | {"draft_vocab_size": c.draft_vocab_size, "target_hidden_size": c.hidden_size, "eagle_config": ids}


def eagle3_forward(
    w, cfg: ModelConfig, embeds: Tensor, aux: Tensor, positions: Tensor, norms: dict | None = None
) -> tuple[Tensor, ...]:
    """vLLM's Eagle3LlamaForCausalLM: feature = fc(aux) (aux normed first under norm_before_fc); [norm(embed);
    norm(feature)] -> attention, residual = feature; returns the feature fed back (normed under norm_output),
    logits over the draft vocabulary and each draft id's target id."""
    norms, eps = norms or {}, cfg.rms_norm_eps
    if norms.get("norm_before_fc"):
        aux = rms(aux, w["input_norm.weight"], eps)
    h = eagle3_layer(
        w, "midlayer", cfg, embeds, linear(aux, w, "fc"), positions, norms.get("norm_before_residual", False)
    )
    normed = rms(h, w["norm.weight"], eps)
    logits, vd = linear(normed, w, "lm_head"), w["lm_head.weight"].shape[0]
    ids = torch.arange(vd) + w.get("d2t", torch.zeros(vd, dtype=torch.long))
    return normed if norms.get("norm_output") else h, logits, ids


def eagle3_layer(
    w, p: str, cfg: ModelConfig, embeds: Tensor, feat: Tensor, positions: Tensor, norm_before_residual: bool = False
) -> Tensor:
    """The EAGLE-3 layer `p`: [norm(embed); hidden_norm(feature)] -> attention, residual = feature (vLLM's
    _norm_after_residual) or hidden_norm(feature) (_norm_before_residual); then the MLP."""
    eps = cfg.rms_norm_eps
    normed = rms(feat, w[f"{p}.hidden_norm.weight"], eps)
    x = torch.cat([rms(embeds, w[f"{p}.input_layernorm.weight"], eps), normed], -1)
    h = (normed if norm_before_residual else feat) + attention(x, w, f"{p}.self_attn", cfg, positions)
    return h + mlp(rms(h, w[f"{p}.post_attention_layernorm.weight"], eps), w, f"{p}.mlp")


def eagle3_pairs(src: Source[Eagle3Head], p: Probe[Eagle3Head]) -> dict[str, tuple]:
    c, head, n = src.head.config, p.head, p.tokens.numel()
    aux = torch.randn(n, len(c.target_layers) * c.hidden_size, generator=p.g)
    embeds, cfg = head.embed_tokens(p.tokens), ModelConfig.from_hf(p.config)
    norms = {k: bool(p.config.get(k) or (p.config.get("eagle_config") or {}).get(k)) for k in EAGLE31_KEYS}
    h, logits, ids = eagle3_forward(p.w, cfg, embeds, aux, p.positions, norms)
    mine = head(head.target_features(None, aux[None]), p.tokens[None], p.positions)[0]
    pairs = {"feature": (h, mine), "logits": (logits, head.logits(mine)), "target ids": (ids, head.vocab_ids)}
    return pairs | t2d_pair(p.w, head)


# vLLM's and SGLang's LlamaForCausalLMEagle3: one folder for both
EAGLE3 = Format(
    export=eagle3_vllm,
    shapes=eagle3_shapes,
    config=eagle3_config,
    forward=eagle3_pairs,
    problems=head_config_problems,
    vllm="eagle3",
    sglang="EAGLE3",
)
