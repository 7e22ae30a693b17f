"""A whole fp32 Llama decoder layer in one call (cpu_kernels/decoder_layer.cpp) for a batch-1 cached forward on CPU.

Why: a decode step's arithmetic besides its weights is small, and with the kernels of cpu_kernels/panels.py,
cpu_kernels/rope_attention.py and cpu_kernels/layer_ops.py each a single call, what is left is the Python between them:
module calls, wrappers, checks, allocations, a dozen per layer. Measured inside a step, where streaming the weights has
evicted the interpreter's own data from the caches, that Python costs several times what a microbenchmark says
(docs/benchmarks.md, Rope, attention and norms on draftsmith's kernels). One call per layer runs the same kernels in the
same order, so a layer gives the same bits by either road. Where it runs: where rope_attention.handles does, for layers
whose linears are packed in panels (fused qkv and gate-up), q/k norms (Qwen3) included. EAGLE-3's midlayer
(heads/eagle3.py), whose attention reads two normed halves and whose residual is the feature, has a call of its own."""

from __future__ import annotations

import ctypes
import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import Tensor

from . import native, panels, rope_attention
from .layer_ops import is_rms_norm
from .packed import current_packed, fused_linear
from .rope_attention import QKNORM
from .watch import Watch, watching

P, I64 = ctypes.c_void_p, ctypes.c_int64


class PANELS(ctypes.Structure):
    _fields_ = [("data", P), ("format", I64)]


class LAYER(ctypes.Structure):
    _fields_ = [("input_norm", P), ("post_norm", P), ("qkv", PANELS), ("qkv_bias", P)]
    _fields_ += [(name, PANELS) for name in ("o", "gate_up", "down")]
    _fields_ += [(name, I64) for name in ("hidden", "intermediate", "heads", "kv_heads", "head_dim")]
    _fields_ += [("eps", ctypes.c_float), ("qk_norm", QKNORM)]


LINEARS = ("qkv", "o", "gate_up", "down")


class STEP(ctypes.Structure):
    _fields_ = [("cos", P), ("sin", P), ("max_len", I64), ("start", I64), ("cols", I64), ("mask", P)]


@functools.cache
def kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    return native.bind("decoder_layer", [P, I64, ctypes.POINTER(LAYER), ctypes.POINTER(STEP), P, P, P, P])


@functools.cache
def eagle3_kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    return native.bind("eagle3_layer", [P, P, I64, ctypes.POINTER(LAYER), P, ctypes.POINTER(STEP), P, P, P, P])


@functools.cache
def work_kernel(name: str = "decoder_layer_work") -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    return native.bind(name, [ctypes.POINTER(LAYER)], I64)


Caches = tuple[Tensor | None, Tensor | None]
Forward = TypeVar("Forward", bound=Callable)
COMPUTED: set[Callable] = set()  # the attention and MLP forwards the kernel computes itself


def computes(forward: Forward) -> Forward:
    """Marks an attention or MLP forward as one the one-call layer computes (runtime/llama.py's). A subclass with a
    forward of its own is not marked, so a layer that holds one runs module by module, its forward called."""
    COMPUTED.add(forward)
    return forward


@dataclass
class Plan:
    """A layer's weights as the kernel reads them, kept while its watch holds: the links from the layer to each
    module, parameter and eps the plan read, and those tensors unedited where they were (cpu_kernels/watch.py)."""

    weights: LAYER
    held: list[Tensor]  # the tensors the struct points into (kept alive): packed weights, norms, the qkv bias
    width: int  # the fused qkv projection's outputs
    work: int  # floats per row of scratch (cpu_kernels/decoder_layer.h, layer_work)
    watch: Watch
    hidden_norm: int = 0  # EAGLE-3's norm of the feature half (its data pointer; 0: a Llama layer)


# beside the layers, not on them: a deep copy of a layer must not carry pointers into the original's tensors
PLANS: weakref.WeakKeyDictionary[Any, Plan] = weakref.WeakKeyDictionary()
# what a plan reads of a layer; a packed linear's copy is current while its parts' weights and biases are
READS = (
    "input_layernorm.weight",
    "input_layernorm.eps",
    "hidden_norm.weight",
    "hidden_norm.eps",
    "post_attention_layernorm.weight",
    "post_attention_layernorm.eps",
    *(f"self_attn.{norm}.{p}" for norm in ("q_norm", "k_norm") for p in ("weight", "eps")),
    "self_attn.qkv_proj",
    *(f"self_attn.{part}.{p}" for part in ("q_proj", "k_proj", "v_proj", "o_proj") for p in ("weight", "bias")),
    "mlp.gate_up_proj",
    *(f"mlp.{part}.{p}" for part in ("gate_proj", "up_proj", "down_proj") for p in ("weight", "bias")),
)


def step_plan(layer: Any, x: Tensor, caches: Caches, start: object, mask: object) -> Plan | None:
    """The layer's plan for a cached batch-1 fp32 step, where its projections are packed in panels; else None. A
    drafter's layers take it one by one; a target's take the whole stack (cpu_kernels/decoder_stack.py)."""
    if caches[0] is None or caches[1] is None or not isinstance(start, int) or not rope_attention.handles(x, mask):
        return None
    return plan(layer) if kernel() is not None else None


def plan(layer: Any) -> Plan | None:
    """The layer's current plan, or None where the layer does not fit the kernel."""
    kept = PLANS.get(layer)
    if kept is not None and kept.watch.holds():
        return kept
    held = current_tensors(layer)  # a stale packed linear repacks here
    seen = watch(layer) if held is not None else None
    if held is None or seen is None:
        PLANS.pop(layer, None)
        return None
    kept = PLANS[layer] = make_plan(layer, held, seen)
    return kept


def watch(layer: Any) -> Watch | None:
    """What the layer's plan reads, and the classes of the modules it stands in for; None where one of those has a
    forward hook, a forward set on the instance, or an attention or MLP forward the kernel does not compute (the kernel
    would skip it)."""
    attn, mlp = layer.self_attn, layer.mlp
    if type(attn).forward not in COMPUTED or type(mlp).forward not in COMPUTED:
        return None
    seen = watching([layer], READS)
    called = [attn, mlp, layer.input_layernorm, layer.post_attention_layernorm]
    called += [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
    called += [attn.q_norm, attn.k_norm] if hasattr(attn, "q_norm") else []
    called += [layer.hidden_norm] if hasattr(layer, "hidden_norm") else []
    return seen if seen.keep_plain(called) else None


def current_tensors(layer: Any) -> dict[str, Tensor] | None:
    """What the kernel reads of the layer, up to date (a stale packed linear repacks here), by its LAYER field: the 4
    packed weights, the 2 norms, and the qkv bias, q and k norms and EAGLE-3's hidden_norm where the layer has them.
    None where a norm or a projection does not fit: q/k norms the kernel cannot apply (rope_attention.norms_fit), a
    norm that is not an RMSNorm (EAGLE-1's Identity, a LayerNorm, a subclass with its own forward), two eps, linears
    not packed in fp32 panels (any format), a bias past the q/k/v projections, or a module that is not a Llama layer
    at all."""
    if not all(hasattr(layer, name) for name in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")):
        return None
    attn, mlp = layer.self_attn, layer.mlp
    norms = (layer.input_layernorm, layer.post_attention_layernorm, *layer_norms_past(layer))
    if not rope_attention.norms_fit(attn) or not all(map(is_rms_norm, norms)) or len({n.eps for n in norms}) > 1:
        return None
    weights = [n.weight for n in norms]
    hidden = weights[0].shape[0]
    qk = rope_attention.qk_norms(attn)
    vectors = weights[:2] + list(qk[:2] if qk is not None else ())
    fp32 = all(v.dtype == torch.float32 and v.is_contiguous() for v in vectors + weights[2:])
    if not fp32 or any(w.shape != (hidden,) for w in weights[1:]):
        return None  # the modules run it (and name a wrong dtype)
    qkv, gate_up = fused_linear(attn, "qkv_proj"), fused_linear(mlp, "gate_up_proj")
    if qkv is None or gate_up is None or any(m.bias is not None for m in (attn.o_proj, gate_up, mlp.down_proj)):
        return None
    packs = [current_packed(m) for m in (qkv, attn.o_proj, gate_up, mlp.down_proj)]
    inter, d = mlp.down_proj.in_features, attn.head_dim
    width = hidden * (len(norms) - 1)  # attention reads the normed stream, or EAGLE-3's two normed halves
    expected = ((width, qkv.out_features), (attn.n_heads * d, hidden), (hidden, 2 * inter), (inter, hidden))
    if not all(panels.holds(p, i, o) for p, (i, o) in zip(packs, expected, strict=True)):
        return None
    names = (*LINEARS, "input_norm", "post_norm", "q_norm", "k_norm")[: len(packs + vectors)]
    named = dict(zip(names, packs + vectors, strict=True))
    named |= {"hidden_norm": weights[2]} if len(weights) > 2 else {}
    return named | ({"qkv_bias": qkv.bias} if qkv.bias is not None else {})


def layer_norms_past(layer: Any) -> tuple:
    """Norms a layer has beyond Llama's two: EAGLE-3's hidden_norm over the feature half of its attention's input."""
    return (layer.hidden_norm,) if hasattr(layer, "hidden_norm") else ()


def make_plan(layer: Any, held: dict[str, Tensor], seen: Watch) -> Plan:
    attn, mlp = layer.self_attn, layer.mlp
    linears = {name: PANELS(t.data_ptr(), panels.FORMATS[t.dtype]) for name, t in held.items() if name in LINEARS}
    vectors = {name: t.data_ptr() for name, t in held.items() if name in ("input_norm", "post_norm", "qkv_bias")}
    weights = LAYER(**linears, **vectors)
    weights.hidden, weights.intermediate = held["input_norm"].shape[0], mlp.down_proj.in_features
    weights.heads, weights.kv_heads, weights.head_dim = attn.n_heads, attn.n_kv, attn.head_dim
    weights.eps = layer.input_layernorm.eps
    if "q_norm" in held:
        weights.qk_norm = QKNORM(held["q_norm"].data_ptr(), held["k_norm"].data_ptr(), attn.q_norm.eps)
    eagle3 = "hidden_norm" in held
    work = work_kernel("eagle3_layer_work" if eagle3 else "decoder_layer_work")
    assert work is not None, "the library that has decoder_layer has its work sizes"
    width = (attn.n_heads + 2 * attn.n_kv) * attn.head_dim
    norm = held["hidden_norm"].data_ptr() if eagle3 else 0
    return Plan(weights, list(held.values()), width, work(weights), seen, norm)


def run(
    made: Plan,
    x: Tensor,
    rope: tuple[Tensor, Tensor],
    caches: tuple[Tensor, Tensor],
    start: int,
    mask,
    feature: Tensor | None = None,
) -> Tensor:
    """x [1, n, hidden] through the layer `made` was planned for (EAGLE-3's midlayer, a plan with its hidden_norm: x
    the embeddings, feature [1, n, hidden] the other half and the residual); k and v written to the caches at slots
    start .. start+n-1."""
    rows, n = input_rows(x, made), x.shape[1]
    step, held = step_struct(made, n, rope, caches, start, mask)  # held: what step points into, alive through the call
    work, out = rows.new_empty(n * made.work), torch.empty_like(rows)
    k, v = caches
    tail = (k.data_ptr(), v.data_ptr(), work.data_ptr(), out.data_ptr())
    if not made.hidden_norm:
        fn = kernel()
        assert fn is not None, "step_plan() found the kernel"
        fn(rows.data_ptr(), n, made.weights, step, *tail)
        return out
    assert feature is not None, "EAGLE-3's midlayer reads the feature too"
    feats = input_rows(feature, made)
    if feats.shape != rows.shape:
        raise ValueError(f"feature {tuple(feats.shape)} must match the embeddings {tuple(rows.shape)}")
    fn = eagle3_kernel()
    assert fn is not None, "the library that has decoder_layer has eagle3_layer"
    fn(rows.data_ptr(), feats.data_ptr(), n, made.weights, made.hidden_norm, step, *tail)
    return out


def input_rows(x: Tensor, made: Plan) -> Tensor:
    """x [1, n, hidden] as the kernels read it: contiguous, as wide as the layer."""
    rows = x if x.is_contiguous() else x.contiguous()
    if rows.dim() != 3 or rows.shape[0] != 1 or rows.shape[-1] != made.weights.hidden:
        raise ValueError(f"input {tuple(rows.shape)} must be one sequence [1, n, {made.weights.hidden}]")
    return rows


def step_struct(
    made: Plan, n: int, rope: tuple[Tensor, Tensor], caches: tuple[Tensor, Tensor], start: int, mask
) -> tuple[STEP, tuple]:
    """The step's operands for the kernel, checked against the layer (cpu_kernels/rope_attention.py step_operands), and
    the tensors the struct points into (the caller keeps them until the kernel returns)."""
    w = made.weights
    if caches[0].dim() != 4 or caches[0].shape[1] != w.kv_heads or caches[0].shape[3] != w.head_dim:
        raise ValueError(f"cache {tuple(caches[0].shape)} is not the layer's [1, {w.kv_heads}, max_len, {w.head_dim}]")
    cos, sin, seen = rope_attention.step_operands((1, n, made.width), rope, caches, start, mask, w.heads)
    step = STEP(cos.data_ptr(), sin.data_ptr(), caches[0].shape[2], start, 0 if seen is None else seen.shape[1])
    step.mask = None if seen is None else seen.data_ptr()
    return step, (cos, sin, seen)
