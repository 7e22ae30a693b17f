"""fp32 CPU linears on a small kernel of draftsmith's own (heads/panels.cpp; built and loaded by heads/kernels.py).

Why: a decode step multiplies one row by every weight, so it is a pass over the weights and its speed is the
memory's. oneDNN's fp32 kernels stream SmolLM2's weights at 18-24 GB/s on an AVX2 EPYC where the memory gives
about 30; this kernel streams them at 31-35 and also beats oneDNN at 2-32 rows (docs/benchmarks.md).
It keeps the engine's exactness by construction: every output is one FMA chain over the input features in order,
whatever the row count, the tile or the thread, so a row's product carries the same bits in a decode, a verify and
a prefill. The weight is repacked once into panels of PANEL outputs, [panels, in, PANEL], which a thread streams
front to back. Where it runs, and what happens where it cannot be built: heads/kernels.py. A kernel that fails its
self-check is not used either (one warning).
"""

from __future__ import annotations

import ctypes
import functools
import math

import torch
from torch import Tensor

from . import kernels

PANEL = 32  # outputs per panel: heads/panels.cpp's P


def available() -> bool:
    """fp32 linears take the panel kernel: wanted here, built, and self-checked."""
    return kernels.wanted() and kernel() is not None


@functools.cache
def kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The bound and self-checked panel_linear, or None (after one warning where it was built but is wrong)."""
    args = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
    fn = kernels.bind("panel_linear", [*args, ctypes.c_void_p, ctypes.c_void_p])
    if fn is not None and not self_check(fn):
        kernels.warn_unusable(ArithmeticError("the panel kernel's self-check product differs from float64's"))
        return None
    return fn


def self_check(fn: ctypes._CFuncPtr) -> bool:  # type: ignore[name-defined]
    """One small product against float64, so a kernel built wrong never reaches a model."""
    g = torch.Generator().manual_seed(0)
    out = PANEL + 3  # a whole panel and a padded one
    w, b, x = torch.randn(out, 7, generator=g), torch.randn(out, generator=g), torch.randn(5, 7, generator=g)
    y, packed = torch.empty(5, out), pack_panels(w)  # held in names: a temporary's memory is freed before the call
    fn(x.data_ptr(), 5, 7, packed.data_ptr(), out, b.data_ptr(), y.data_ptr())
    want = torch.nn.functional.linear(x.double(), w.double(), b.double())
    return torch.allclose(y.double(), want, rtol=1e-5, atol=1e-5)


def pack_panels(weight: Tensor) -> Tensor:
    """A [out, in] fp32 weight as [panels, in, PANEL], its outputs padded with zeros to whole panels."""
    out, inp = weight.shape
    panels = -(-out // PANEL)
    padded = weight.new_zeros(panels * PANEL, inp)
    padded[:out] = weight.detach()
    return padded.view(panels, PANEL, inp).transpose(1, 2).contiguous()


def panel_linear(x: Tensor, panels: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
    """x @ W.T + bias for W packed by pack_panels; x fp32 [..., in]."""
    check_operands(x, panels, bias, out_features)
    inp = x.shape[-1]
    x = x if x.is_contiguous() else x.contiguous()  # held in a name: its memory must outlive the call
    y = x.new_empty(*x.shape[:-1], out_features)
    rows = x.numel() // inp if inp else math.prod(x.shape[:-1])
    if not rows or not inp:  # nothing to multiply: the kernel is not called
        return y.zero_() if bias is None else y.copy_(bias.expand_as(y))
    b = bias if bias is None or bias.is_contiguous() else bias.contiguous()
    fn = kernel()
    assert fn is not None, "panels are only packed where the kernel is built"
    fn(x.data_ptr(), rows, inp, panels.data_ptr(), out_features, None if b is None else b.data_ptr(), y.data_ptr())
    return y


def check_operands(x: Tensor, panels: Tensor, bias: Tensor | None, out_features: int) -> None:
    """The kernel reads raw fp32 memory: shapes and dtypes are checked here, where a mistake can still be named."""
    if x.dtype != torch.float32 or not x.is_cpu:
        raise ValueError(f"the panel kernel multiplies fp32 CPU inputs, got {x.dtype} on {x.device}: cast the input")
    whole = panels.dim() == 3 and panels.shape[2] == PANEL and panels.is_contiguous()
    if not whole or panels.shape[0] * PANEL < out_features or panels.dtype != torch.float32:
        raise ValueError(f"panels {tuple(panels.shape)} do not hold {out_features} fp32 outputs: pack with pack_panels")
    if x.shape[-1] != panels.shape[1]:
        raise ValueError(f"input has {x.shape[-1]} features, the weight expects {panels.shape[1]}")
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (out_features,) or bias.is_cuda):
        raise ValueError(f"bias must be fp32 of shape ({out_features},), got {bias.dtype} {tuple(bias.shape)}")
