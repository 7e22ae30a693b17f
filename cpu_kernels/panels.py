"""fp32 CPU linears on a small kernel of draftsmith's own (panels.cpp; built and loaded
by native.py).

Why: a decode step multiplies one row by every weight, so it is a pass over the weights and its speed is the memory's.
oneDNN's fp32 kernels stream a decode step's weights well below the memory's pace; this kernel streams them near it, and
also beats oneDNN at 2-32 rows (docs/benchmarks.md, The panel kernel). It keeps the engine's exactness by construction:
every output is one FMA chain over the input features in order, whatever the row count, the tile or the thread, so a
row's product carries the same bits in a decode, a verify and a prefill. The weight is repacked once into panels of
PANEL outputs, [panels, in, PANEL], which a thread streams front to back, in the narrowest format that holds it exactly
(cpu_kernels/panel_codes.py: bf16, or GGUF-like q8 and q4 blocks, which the kernel decodes to the weight's own fp32
bits): the same products from a half to a fifth of the bytes (SmolLM2's decode step twice as fast on an AVX2 EPYC,
docs/benchmarks.md). DRAFTSMITH_PANELS=fp32 keeps every weight in fp32 (to compare the two). Where it runs, and what
happens where it cannot be built: cpu_kernels/native.py. A kernel that fails its self-check is not used either (one
warning)."""

from __future__ import annotations

import ctypes
import functools
import math
import os

import torch
from torch import Tensor

from . import native, panel_codes
from .panel_codes import BLOCK, BLOCK_BYTES

PANEL = 32  # outputs per panel: cpu_kernels/panels.cpp's P
# the packed tensor's dtype names its format (cpu_kernels/panels.h's PanelFormat): fp32 and bf16 [panels, in, PANEL]; q8
# and q4 [panels, in / BLOCK, bytes per block]
FORMATS = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2, torch.uint8: 3}
CODED = {"q4": torch.uint8, "q8": torch.int8, "bf16": torch.bfloat16}  # the narrowest first
NAMES = {dtype: code for code, dtype in CODED.items()} | {torch.float32: "fp32"}
ENV = "DRAFTSMITH_PANELS"
SETTINGS = ("exact", "fp32")


def available() -> bool:
    """fp32 linears take the panel kernel: wanted here, built, and self-checked."""
    return native.wanted() and kernel() is not None


@functools.cache
def kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The bound and self-checked panel_linear, or None (after one warning where it was built but is wrong)."""
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    fn = native.bind("panel_linear", [ptr, i64, i64, ptr, i64, i64, ptr, ptr])
    if fn is not None and not self_check(fn):
        native.warn_unusable(ArithmeticError("the panel kernel's self-check product differs from float64's"))
        return None
    return fn


def self_check(fn: ctypes._CFuncPtr) -> bool:  # type: ignore[name-defined]
    """Small products in every format against float64 and, bit for bit, against fp32 panels, at 1 row, a few and
    more than the verify rows' pass takes (a prefill decodes whole panels), so a kernel built wrong never reaches a
    model."""
    g = torch.Generator().manual_seed(0)
    out, inp = PANEL + 3, 2 * BLOCK  # a whole panel and a padded one; two blocks
    b, w = torch.randn(out, generator=g), torch.randn(out, inp, generator=g)
    exact = {"fp32": w, "bf16": w.bfloat16().float()} | {c: panel_codes.quantized(w, c) for c in ("q8", "q4")}
    for code, w in exact.items():
        packed = pack_as(pad(w), code)
        if packed is None:
            return False
        fp32 = fp32_panels(pad(w))
        for rows in (1, 2, 5, 20):  # each road: in registers (1, 2 rows), per block (up to 16), whole panels
            x = torch.randn(rows, inp, generator=g)
            y, same = torch.empty(rows, out), torch.empty(rows, out)  # held in names: a temporary is freed too soon
            fn(x.data_ptr(), rows, inp, packed.data_ptr(), FORMATS[packed.dtype], out, b.data_ptr(), y.data_ptr())
            fn(x.data_ptr(), rows, inp, fp32.data_ptr(), FORMATS[fp32.dtype], out, b.data_ptr(), same.data_ptr())
            want = torch.nn.functional.linear(x.double(), w.double(), b.double())
            if not torch.allclose(y.double(), want, rtol=1e-5, atol=1e-5) or not torch.equal(y, same):
                return False  # wrong, or not the fp32 panels' bits
    return True


def pack_panels(weight: Tensor) -> Tensor:
    """A [out, in] fp32 weight in panels of PANEL outputs, its outputs padded with zeros to whole panels: in the
    narrowest format that holds it bit for bit (FORMATS), or fp32 under DRAFTSMITH_PANELS=fp32."""
    padded = pad(weight.detach())
    for code in CODED if setting() == "exact" else ():
        packed = pack_as(padded, code)
        if packed is not None:
            return packed
    return fp32_panels(padded)


def setting() -> str:
    value = os.environ.get(ENV, "").strip().lower() or "exact"
    if value not in SETTINGS:
        raise ValueError(f"{ENV}={value!r} is not a setting: use exact (the default) or fp32")
    return value


def pad(weight: Tensor) -> Tensor:
    """[out, in] with zero outputs added up to whole panels."""
    out, inp = weight.shape
    padded = weight.new_zeros(-(-out // PANEL) * PANEL, inp)
    padded[:out] = weight
    return padded


def fp32_panels(padded: Tensor) -> Tensor:
    return padded.view(len(padded) // PANEL, PANEL, padded.shape[1]).transpose(1, 2).contiguous()


def pack_as(padded: Tensor, code: str) -> Tensor | None:
    """The padded weight in `code`'s panels, or None where that format does not hold it exactly."""
    if not padded.numel():
        return None
    if code == "fp32":
        return fp32_panels(padded)
    if code == "bf16":
        return fp32_panels(padded).bfloat16() if panel_codes.bf16_exact(padded) else None
    coded = panel_codes.coded_panels(padded, code)
    return None if coded is None else coded.view(CODED[code])


def in_features(packed: Tensor) -> int:
    return packed.shape[1] * (BLOCK if packed.dtype in (torch.int8, torch.uint8) else 1)


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
    bias_ptr, format = None if b is None else b.data_ptr(), FORMATS[panels.dtype]
    fn(x.data_ptr(), rows, inp, panels.data_ptr(), format, out_features, bias_ptr, y.data_ptr())
    return y


def check_operands(x: Tensor, panels: Tensor, bias: Tensor | None, out_features: int) -> None:
    """The kernel reads raw fp32 memory: shapes and dtypes are checked here, where a mistake can still be named."""
    if x.dtype != torch.float32 or not x.is_cpu:
        raise ValueError(f"the panel kernel multiplies fp32 CPU inputs, got {x.dtype} on {x.device}: cast the input")
    shaped = panels.dim() == 3 and panels.is_contiguous()
    if panels.dtype not in FORMATS or not shaped or panels.shape[2] != block_bytes(panels.dtype):
        raise ValueError(
            f"a {panels.dtype} tensor of shape {tuple(panels.shape)} is not a panel format (fp32 or bf16 [panels, in, "
            f"{PANEL}]; q8 (int8) or q4 (uint8) [panels, in / {BLOCK}, bytes per block]): pack with pack_panels"
        )
    if not holds(panels, None, out_features):
        raise ValueError(f"panels {tuple(panels.shape)} do not hold {out_features} outputs: pack with pack_panels")
    if x.shape[-1] != in_features(panels):
        raise ValueError(f"input has {x.shape[-1]} features, the weight expects {in_features(panels)}")
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (out_features,) or bias.is_cuda):
        raise ValueError(f"bias must be fp32 of shape ({out_features},), got {bias.dtype} {tuple(bias.shape)}")


def holds(packed: Tensor | None, inp: int | None, out: int) -> bool:
    """Packed by pack_panels for `out` outputs (and `inp` inputs, where given)."""
    if packed is None or packed.dim() != 3 or packed.dtype not in FORMATS or not packed.is_contiguous():
        return False
    whole = packed.shape[2] == block_bytes(packed.dtype) and packed.shape[0] * PANEL >= out
    return whole and (inp is None or in_features(packed) == inp)


def block_bytes(dtype: torch.dtype) -> int:
    """The last dimension of a packed tensor of this format: PANEL values, or a block's bytes (cpu_kernels/panels.h)."""
    return {torch.int8: BLOCK_BYTES["q8"], torch.uint8: BLOCK_BYTES["q4"]}.get(dtype, PANEL)
