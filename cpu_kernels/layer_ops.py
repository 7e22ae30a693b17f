"""A Llama layer's fp32 element-wise parts on CPU in one call each (cpu_kernels/layer_ops.cpp): RMSNorm, and SwiGLU's
silu(gate) * up on the fused gate-up rows.

Why: PyTorch runs an fp32 RMSNorm as some eight small ops on CPU (61 of them a SmolLM2 decode step), and the gate's
silu, product and split as four more; one call each costs a fraction of that (docs/benchmarks.md, Rope, attention and
norms on draftsmith's kernels). Each row is computed on its own in a fixed order, so, like the panel linears and the
one-call attention, a row's bits do not depend on the rows around it. Where it runs: native.handles (fp32, AVX2 and
AVX-512 CPUs by default)."""

from __future__ import annotations

import ctypes
import functools
from typing import TypeGuard

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import native

P, I64 = ctypes.c_void_p, ctypes.c_int64


@functools.cache
def rms_norm_kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    return native.bind("rms_norm", [P, I64, I64, P, ctypes.c_float, P])


@functools.cache
def silu_mul_kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    return native.bind("silu_mul", [P, I64, I64, P])


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension."""
    dim = x.shape[-1]
    check_input(x)
    if weight.shape != (dim,) or weight.dtype != torch.float32 or not weight.is_cpu:
        raise ValueError(
            f"an RMSNorm over {dim} features needs an fp32 weight of ({dim},), got {weight.dtype} {tuple(weight.shape)}"
        )
    rows, w = x.contiguous(), weight.contiguous()  # held in names: their memory must outlive the call
    out = torch.empty_like(rows)
    fn = rms_norm_kernel()
    assert fn is not None, "handles() said the library is built"
    fn(rows.data_ptr(), rows.numel() // max(dim, 1), dim, w.data_ptr(), eps, out.data_ptr())
    return out


def silu_mul(h: Tensor) -> Tensor:
    """silu(gate) * up for h = [..., gate | up]."""
    check_input(h)
    if h.shape[-1] % 2:
        raise ValueError(f"fused gate-up rows have an even width, got {h.shape[-1]}")
    width = h.shape[-1] // 2
    rows = h.contiguous()
    out = rows.new_empty(*h.shape[:-1], width)
    fn = silu_mul_kernel()
    assert fn is not None, "handles() said the library is built"
    fn(rows.data_ptr(), rows.numel() // max(2 * width, 1), width, out.data_ptr())
    return out


def check_input(x: Tensor) -> None:
    """The kernels read raw fp32 memory: anything else is refused by name before they run."""
    if x.dtype != torch.float32 or not x.is_cpu:
        raise ValueError(f"the fp32 layer kernels take fp32 CPU tensors, got {x.dtype} on {x.device}")


class RMSNorm(nn.Module):
    """Llama's RMSNorm: on fp32 CPU inference one kernel call, row-invariant; elsewhere in HF's order."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        if native.handles(x):  # fp32 CPU inference: one call, row-invariant
            return rms_norm(x, self.weight, self.eps)
        # HF's order: normalize in fp32, round to the input's dtype, then scale
        return self.weight * F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)


def is_rms_norm(module: object) -> TypeGuard[RMSNorm]:
    """An RMSNorm a kernel may stand in for: its class runs RMSNorm's forward (a LayerNorm, or a subclass with a
    forward of its own, would be replaced by arithmetic it does not do)."""
    return getattr(type(module), "forward", None) is RMSNorm.forward
