"""EAGLE-1/2 heads out: vLLM's EagleLlamaForCausalLM (fc's bias moved exactly into the attention) and SGLang's
LlamaForCausalLMEagle (with the FR-Spec token map), each with its validator's table, config keys and forward."""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor

from draftsmith.heads.drafter_folder import frequent_ids, own_state
from draftsmith.heads.eagle import EagleHead
from draftsmith.heads.eagle3 import DRAFT_VOCAB
from draftsmith.heads.head_base import HeadBase
from draftsmith.runtime.llama import ModelConfig
from draftsmith.serve.export.base import Export, Format, Source, llama_head_config
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
    sizes_config,
)


def eagle_vllm(src: Source[EagleHead]) -> Export:
    """vLLM's EagleLlamaForCausalLM: its fc has no bias. fc(x) + b enters the layer as its residual stream and
    attention input, so b is moved exactly into the attention: q/k/v biases W b, o_proj bias b."""
    state = own_state(src.head)
    b = state.pop("fc.bias")
    bias = src.head.config.attention_bias or bool(b.any())
    if bias:
        for p in "qkv":
            w = state[f"layers.0.self_attn.{p}_proj.weight"]
            old = state.get(f"layers.0.self_attn.{p}_proj.bias", torch.zeros(w.shape[0]))
            state[f"layers.0.self_attn.{p}_proj.bias"] = (old.double() + w.double() @ b.double()).float()
        state["layers.0.self_attn.o_proj.bias"] = b
    config = llama_head_config(src, "EagleLlamaForCausalLM") | {"attention_bias": bias}
    return Export(config, {"model.safetensors": state})


def eagle_sglang(src: Source[EagleHead]) -> Export:
    """SGLang's LlamaForCausalLMEagle: the original EAGLE layout, fc with its bias. With the training answers'
    token counts, also a token map of the most frequent quarter of the vocabulary (at least 8k ids; FR-Spec
    kept 32k of Llama-3's 128k) for --speculative-token-map."""
    c = src.head.config
    state = own_state(src.head)
    if c.attention_bias:
        state["layers.0.self_attn.o_proj.bias"] = torch.zeros(c.hidden_size)
    return Export(llama_head_config(src, "LlamaForCausalLMEagle"), {"model.safetensors": state}, [], token_map(src))


def token_map(src: Source[EagleHead]) -> Tensor | None:
    """The ids an SGLang EAGLE export's token map keeps: the training answers' most frequent quarter, at least the
    default draft vocabulary."""
    if src.token_counts is None:
        return None
    v = src.head.config.vocab_size
    return frequent_ids(src.token_counts, min(v, max(DRAFT_VOCAB, v // 4)))


def eagle_shapes(src: Source[EagleHead], config: dict, fc_bias: bool = False) -> Shapes:
    c, bias = src.head.config, bool(config.get("attention_bias"))
    h = c.hidden_size
    s = {"fc.weight": (h, 2 * h), **attn_shapes("layers.0.self_attn", h, c, bias), **mlp_shapes("layers.0.mlp", c)}
    s["layers.0.post_attention_layernorm.weight"] = (h,)
    return s | ({"fc.bias": (h,)} if fc_bias else {})


def eagle_config(src: Source[HeadBase], arch: str = "EagleLlamaForCausalLM") -> dict:
    return sizes_config(src.head.config) | {"architectures": [arch], "model_type": "llama", "num_hidden_layers": 1}


def eagle_forward(w, cfg: ModelConfig, embeds: Tensor, feature: Tensor, positions: Tensor, lm_head: Tensor):
    """EAGLE-1: x = fc([embed; feature]) (+ bias where the format has one); one layer without input norm,
    no final norm; the target's lm_head gives the logits."""
    x = linear(torch.cat([embeds, feature], -1), w, "fc")
    h = x + attention(x, w, "layers.0.self_attn", cfg, positions)
    h = h + mlp(rms(h, w["layers.0.post_attention_layernorm.weight"], cfg.rms_norm_eps), w, "layers.0.mlp")
    return h, h @ lm_head.T


def eagle_pairs(src: Source[EagleHead], p: Probe[EagleHead]) -> dict[str, tuple]:
    c, head, w = src.head.config, p.head, p.w
    feature = torch.randn(p.tokens.numel(), c.hidden_size, generator=p.g)
    if bias_moved(w):  # the exact product: the rounding of the exported one is checked apart
        own = head.state_dict()
        w = w | {k: v.float() for k, v in moved_bias(w, own, w["layers.0.self_attn.o_proj.bias"]).items()}
    embeds, cfg = head.embed_tokens(p.tokens), ModelConfig.from_hf(p.config)
    h, logits = eagle_forward(w, cfg, embeds, feature, p.positions, head.lm_head.weight)
    mine = head(feature[None], p.tokens[None], p.positions)[0]
    return {"feature": (h, mine), "logits": (logits, head.logits(mine))}


def moved_bias(state: dict[str, Tensor], own: dict[str, Tensor], b: Tensor) -> dict[str, Tensor]:
    """EAGLE for vLLM moves fc's bias b into the attention (o_proj's bias is b): q/k/v biases W b + their own, in
    float64, W from `state`, the own biases from `own`."""
    out = {}
    for p in "qkv":
        name = f"layers.0.self_attn.{p}_proj"
        w = state[f"{name}.weight"].double()
        out[f"{name}.bias"] = own.get(f"{name}.bias", torch.zeros(w.shape[0])).double() + w @ b.double()
    return out


def bias_moved(w: dict[str, Tensor]) -> bool:
    return "fc.bias" not in w and "layers.0.self_attn.o_proj.bias" in w


def moved_bias_problems(src: Source[EagleHead], w: dict[str, Tensor], dtype: torch.dtype) -> list[str]:
    """Each moved bias must be the drafter's own float32 product rounded to the export dtype: the one rounding
    the forward comparison cannot see (it puts the exact product in its place)."""
    state = own_state(src.head)
    want = moved_bias(state, state, state["fc.bias"]) if bias_moved(w) else {}
    return [
        f"{k} is not q/k/v_proj.weight @ fc.bias (+ its own bias) of the drafter, rounded to {dtype}"
        for k, v in want.items()
        if not torch.equal(w[k], v.float().to(dtype))
    ]


EAGLE_VLLM = Format(
    export=eagle_vllm,
    shapes=eagle_shapes,
    config=eagle_config,
    forward=eagle_pairs,
    problems=head_config_problems,
    tensor_checks=moved_bias_problems,
    vllm="eagle",
)


EAGLE_SGLANG = Format(
    export=eagle_sglang,
    shapes=partial(eagle_shapes, fc_bias=True),
    config=partial(eagle_config, arch="LlamaForCausalLMEagle"),
    forward=eagle_pairs,
    problems=head_config_problems,
    token_map=token_map,
    sglang="EAGLE",
)
