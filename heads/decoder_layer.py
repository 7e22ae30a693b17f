"""A whole fp32 Llama decoder layer in one call (heads/decoder_layer.cpp) for a batch-1 cached forward on CPU.

Why: a decode step's arithmetic besides its weights is small, and with the kernels of heads/panels.py,
heads/rope_attention.py and heads/layer_ops.py each a single call, what is left is the Python between them: module
calls, wrappers, checks, allocations, a dozen per layer. Measured inside a step, where streaming the weights has
evicted the interpreter's own data from the caches, that Python costs several times what a microbenchmark says (an
RMSNorm's wrapper: ~18 us in a step against ~3 us alone). One call per layer runs the same kernels in the same
order, so a layer gives the same bits by either road. Where it runs: where rope_attention.takes does, for layers
whose linears are packed in panels (fused qkv and gate-up) and whose attention has no q/k norm.
"""

from __future__ import annotations

import ctypes
import functools
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from . import kernels, rope_attention
from .packed import current_packed, fresh, fused_linear, stamp

P, I64 = ctypes.c_void_p, ctypes.c_int64


class LAYER(ctypes.Structure):
    _fields_ = [(name, P) for name in ("input_norm", "post_norm", "qkv", "qkv_bias", "o", "gate_up", "down")]
    _fields_ += [(name, I64) for name in ("hidden", "intermediate", "heads", "kv_heads", "head_dim")]
    _fields_ += [("eps", ctypes.c_float)]


class STEP(ctypes.Structure):
    _fields_ = [("cos", P), ("sin", P), ("max_len", I64), ("start", I64), ("cols", I64), ("mask", P)]


@functools.cache
def kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    return kernels.bind("decoder_layer", [P, I64, ctypes.POINTER(LAYER), ctypes.POINTER(STEP), P, P, P, P])


Caches = tuple[Tensor | None, Tensor | None]


@dataclass
class Plan:
    """A layer's weights as the kernel reads them, with what they were made from: rebuilt once a source tensor is
    replaced or edited in place (a repack), so each step checks versions instead of rebuilding."""

    weights: LAYER
    held: list[Tensor]  # the tensors the struct points into, kept alive
    stamp: list[tuple[Tensor, int]]  # every source tensor and its in-place version
    width: int  # the fused qkv projection's outputs


# beside the layers, not on them: a deep copy of a layer must not carry pointers into the original's tensors
PLANS: weakref.WeakKeyDictionary[Any, Plan] = weakref.WeakKeyDictionary()


def takes(layer: Any, x: Tensor, caches: Caches, start: object, mask: object) -> Plan | None:
    """The layer's plan for a cached batch-1 fp32 step, where its projections are packed in panels; else None."""
    if caches[0] is None or caches[1] is None or not isinstance(start, int) or not rope_attention.takes(x, mask):
        return None
    return plan(layer) if kernel() is not None else None


def plan(layer: Any) -> Plan | None:
    """The layer's current plan, or None where the layer does not fit the kernel."""
    kept = PLANS.get(layer)
    if kept is not None and fresh(kept.stamp, sources(layer)):
        return kept
    made = make_plan(layer)
    if made is None:
        PLANS.pop(layer, None)
    else:
        PLANS[layer] = made
    return made


def sources(layer: Any) -> list[Tensor]:
    """Every tensor a plan is made from: the norms' weights, and the linears' weights and biases."""
    attn, mlp = layer.self_attn, layer.mlp
    modules = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    tensors = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
    return tensors + [t for m in modules for t in (m.weight, m.bias) if t is not None]


def make_plan(layer: Any) -> Plan | None:
    attn, mlp = layer.self_attn, layer.mlp
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if hasattr(attn, "q_norm") or getattr(norms[0], "eps", None) != getattr(norms[1], "eps", 0):  # Identity: no eps
        return None
    qkv, gate_up = fused_linear(attn, "qkv_proj"), fused_linear(mlp, "gate_up_proj")
    if qkv is None or gate_up is None:
        return None
    packs = [current_packed(m) for m in (qkv, attn.o_proj, gate_up, mlp.down_proj)]  # repacked if stale
    hidden, inter, d = norms[0].weight.shape[0], mlp.down_proj.in_features, attn.head_dim
    expected = ((hidden, qkv.out_features), (attn.n_heads * d, hidden), (hidden, 2 * inter), (inter, hidden))
    if not all(fits(p, i, o) for p, (i, o) in zip(packs, expected, strict=True)):
        return None
    held = [t for t in (*packs, *(n.weight for n in norms), qkv.bias) if t is not None]
    pointers = [p.data_ptr() for p in held[:4]]
    bias = None if qkv.bias is None else qkv.bias.data_ptr()
    weights = LAYER(norms[0].weight.data_ptr(), norms[1].weight.data_ptr(), pointers[0], bias, *pointers[1:])
    weights.hidden, weights.intermediate, weights.heads, weights.kv_heads = hidden, inter, attn.n_heads, attn.n_kv
    weights.head_dim, weights.eps = d, norms[0].eps
    return Plan(weights, held, stamp(sources(layer)), qkv.out_features)


def fits(packed: Tensor | None, inp: int, out: int) -> bool:
    """Packed in fp32 panels for in -> out features."""
    if packed is None or packed.dim() != 3 or packed.dtype != torch.float32:
        return False
    return packed.shape[1] == inp and packed.shape[0] * packed.shape[2] >= out


def run(made: Plan, x: Tensor, rope: tuple[Tensor, Tensor], caches: tuple[Tensor, Tensor], start: int, mask) -> Tensor:
    """x [1, n, hidden] through the layer `made` was planned for; k and v written to the caches at slots
    start .. start+n-1."""
    n, (k_cache, v_cache) = x.shape[1], caches
    max_len, d = k_cache.shape[2], k_cache.shape[3]
    rows = x if x.is_contiguous() else x.contiguous()
    cos, sin = (t if t.is_contiguous() else t.contiguous() for t in rope)
    if rows.shape[-1] != made.weights.hidden:
        raise ValueError(f"input has {rows.shape[-1]} features, the layer {made.weights.hidden}")
    rope_attention.check_fp32((("cos", cos), ("sin", sin), ("k cache", k_cache), ("v cache", v_cache)))
    rope_attention.check_layout((1, n, made.width), cos, sin, caches, start, made.weights.heads)
    seen = rope_attention.visible_rows(mask, n, start, max_len)
    step = STEP(cos.data_ptr(), sin.data_ptr(), max_len, start, 0 if seen is None else seen.shape[1])
    step.mask = None if seen is None else seen.data_ptr()
    w = made.weights
    work = rows.new_empty(n * (3 * w.hidden + made.width + w.heads * d + 3 * w.intermediate))
    out = torch.empty_like(rows)
    fn = kernel()
    assert fn is not None, "takes() found the kernel"
    fn(rows.data_ptr(), n, w, step, k_cache.data_ptr(), v_cache.data_ptr(), work.data_ptr(), out.data_ptr())
    return out
