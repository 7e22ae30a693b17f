"""A model's whole stack of fp32 decoder layers in one call (cpu_kernels/decoder_stack.cpp) for a batch-1 cached forward
on CPU.

Why: with each layer one call (cpu_kernels/decoder_layer.py), what is left of a decode step's Python is per layer: the
module call, checking the step's rope rows, caches and mask, proving the layer's plan current, allocating its output, a
sizeable share of a small model's step (docs/benchmarks.md, The whole stack in one call). Here the step's operands are
checked once, one watch proves every layer's plan current (cpu_kernels/watch.py), and one call runs the layers in order,
each as decoder_layer runs it alone, so the bits are the same by either road. Where it runs: a model on the cpu_kernels
path (runtime/llama.py, Transformer.path), whose every layer takes the one-layer call, the layers sharing their
attention's shape."""

from __future__ import annotations

import ctypes
import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn

from . import decoder_layer, native, rope_attention
from .decoder_layer import LAYER, STEP, Plan
from .watch import Watch

P, I64 = ctypes.c_void_p, ctypes.c_int64


class LayerCaches(Protocol):
    """What the stack reads of a model's cache (runtime/kv_cache.py's KVCache): each layer's K and V."""

    k: list[Tensor]
    v: list[Tensor]


@functools.cache
def kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    return native.bind("decoder_stack", [P, I64, ctypes.POINTER(LAYER), I64, ctypes.POINTER(STEP), P, P, P, P, P])


@functools.cache
def work_kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    return native.bind("stack_work", [ctypes.POINTER(LAYER), I64], I64)


@dataclass
class Stack:
    """Every layer's plan, in order, kept while one watch holds: the layer list's links to each layer, and every
    plan's own watch."""

    plans: list[Plan]
    layers: ctypes.Array  # the plans' LAYER structs, one array
    work: int  # floats per row of scratch
    watch: Watch


STACKS: weakref.WeakKeyDictionary[nn.Module, Stack] = weakref.WeakKeyDictionary()


def steps(x: Tensor, cache: LayerCaches | None, start: object, mask: object) -> bool:
    """A call the stack runs: a cached batch-1 no-grad fp32 CPU step at a slot number, its mask causal (None) or a bool
    tensor, where the library is built."""
    return cache is not None and isinstance(start, int) and rope_attention.handles(x, mask) and kernel() is not None


def current(layers: nn.Module, forward: Callable) -> Stack | None:
    """The stack's plans, kept while its watch holds and made anew when not; None where a layer is not a plain one (its
    class's `forward`, no hooks) that takes the one-layer call, or the library is not built."""
    if not isinstance(layers, nn.Module) or kernel() is None:
        return None
    kept = STACKS.get(layers)
    if kept is not None and kept.watch.holds():
        return kept
    kept = make_stack(layers, forward)
    if kept is None:
        STACKS.pop(layers, None)
        return None
    STACKS[layers] = kept
    return kept


def shape(made: Plan) -> tuple[int, ...]:
    """What the layers of one stack share: the residual stream's width and the attention's heads."""
    w = made.weights
    return w.hidden, w.heads, w.kv_heads, w.head_dim


def make_stack(layers: nn.Module, forward: Callable) -> Stack | None:
    """The layers' plans and their watch; None where a layer is not plain or does not fit, or the layers differ in
    their attention's shape."""
    members = [layer for layer in layers._modules.values() if isinstance(layer, nn.Module)]  # as iterated
    if not members or len(members) < len(layers._modules) or any(type(m).forward is not forward for m in members):
        return None
    found = [decoder_layer.plan(layer) for layer in members]
    plans = [made for made in found if made is not None]
    if len(plans) < len(found) or len({shape(made) for made in plans}) != 1:
        return None
    seen = Watch()
    seen.keep(layers.__dict__, "_modules", layers._modules)
    seen.keep_size(layers._modules)  # a layer added or removed
    for key, layer in layers._modules.items():
        seen.keep(layers._modules, key, layer)
    if not seen.keep_plain(members):
        return None
    for made in plans:
        seen.extend(made.watch)
    structs = (LAYER * len(plans))(*(made.weights for made in plans))
    work = work_kernel()
    assert work is not None, "the library that has decoder_stack has stack_work"
    return Stack(plans, structs, work(structs, len(plans)), seen)


def run(
    stack: Stack, x: Tensor, rope: tuple[Tensor, Tensor], cache: LayerCaches, start: int, mask, taps: tuple[int, ...]
) -> tuple[Tensor, list[Tensor]]:
    """x [1, n, hidden] through every layer, each writing its k and v to its cache at slots start .. start+n-1.
    Returns the last layer's output and, for each index in taps (as Transformer.layers_forward reads them: ascending,
    0 .. layers), the residual stream entering that layer (the index past the last: its output)."""
    n, count, first = x.shape[1], len(stack.plans), stack.plans[0]
    rows = decoder_layer.input_rows(x, first)
    k_ptrs, v_ptrs = cache_pointers(cache, count)
    step, held = decoder_layer.step_struct(first, n, rope, (cache.k[0], cache.v[0]), start, mask)  # held: alive
    tapped = [i for i in range(count + 1) if i in taps]
    aux = rows.new_empty(len(tapped), *rows.shape)
    tap_ptrs = (P * (count + 1))()
    for j, i in enumerate(tapped):
        tap_ptrs[i] = aux[j].data_ptr()
    work, out = rows.new_empty(n * stack.work), torch.empty_like(rows)
    fn = kernel()
    assert fn is not None, "steps() found the kernel"
    fn(rows.data_ptr(), n, stack.layers, count, step, k_ptrs, v_ptrs, tap_ptrs, work.data_ptr(), out.data_ptr())
    return out, list(aux)


def cache_pointers(cache: LayerCaches, count: int) -> tuple[ctypes.Array, ctypes.Array]:
    """Each layer's K and V cache, checked to be laid out as the first layer's (which the step's check reads)."""
    first = cache.k[0]
    if len(cache.k) != count or len(cache.v) != count:
        raise ValueError(f"the cache holds {len(cache.k)} layers' K and {len(cache.v)} V, the model {count}")
    for t in (*cache.k, *cache.v):
        if t.shape != first.shape or t.dtype != torch.float32 or not t.is_cpu or not t.is_contiguous():
            raise ValueError(
                f"every layer's cache must be a contiguous fp32 CPU {tuple(first.shape)}, got {t.dtype} "
                f"{tuple(t.shape)} on {t.device}"
            )
    return (P * count)(*(t.data_ptr() for t in cache.k)), (P * count)(*(t.data_ptr() for t in cache.v))
