"""llama.cpp's graph ops in plain torch, as the GGUF validators' forwards run them from a GGUF's own tensors: its
two ropes, grouped-query attention (kq_scale 1/sqrt(head_dim)) and the SiLU-gated feed-forward of `blk.{i}`."""

from __future__ import annotations

import torch
from torch import Tensor

from draftsmith.serve.export.checks import mlp


def ggml_rope(x: Tensor, positions: Tensor, base: float, dims: int, neox: bool = False) -> Tensor:
    """x [n, heads, dims] turned by pos * base^(-2i/dims): LLAMA_ROPE_TYPE_NORM turns adjacent pairs (2i, 2i+1),
    LLAMA_ROPE_TYPE_NEOX the halves' pairs (i, i + dims/2), as HF's rotate-half does."""
    theta = positions.float()[:, None, None] * base ** (-torch.arange(0, dims, 2).float() / dims)
    cos, sin = theta.cos(), theta.sin()
    if neox:
        x0, x1 = x[..., : dims // 2], x[..., dims // 2 :]
        return torch.cat((x0 * cos - x1 * sin, x0 * sin + x1 * cos), -1)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), -1).flatten(-2)


def ggml_attend(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Tensor:
    """q [n, heads, d] over k, v [m, kv_heads, d] (query head h reads kv head h // (heads / kv_heads)) -> [n,
    heads * d]. causal: query i sees keys 0..i (n == m); otherwise every key, as a non-causal ubatch sees its cache."""
    n, heads, d = q.shape
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    k, v = k.repeat_interleave(heads // k.shape[0], 0), v.repeat_interleave(heads // v.shape[0], 0)
    scores = (q @ k.transpose(-1, -2)) / d**0.5
    if causal:
        scores = scores.masked_fill(~torch.ones(n, k.shape[1], dtype=torch.bool).tril(), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, heads * d)


def ggml_mlp(x: Tensor, w: dict[str, Tensor], block: str = "blk.0") -> Tensor:
    """build_ffn(LLM_FFN_SILU, LLM_FFN_PAR): ffn_down(silu(ffn_gate(x)) * ffn_up(x))."""
    names = {"gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    return mlp(x, {f"m.{k}.weight": w[f"{block}.{v}.weight"] for k, v in names.items()}, "m")
