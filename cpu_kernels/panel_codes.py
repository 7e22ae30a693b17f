"""Narrower exact codes for fp32 weights: bf16, and blocks of 32 inputs as int8 codes times a scale (q8) or 4-bit codes
times a scale plus an offset (q4), the layouts of GGUF's Q8_0 and Q4_1.

Why: a decode step is a pass over the weights, and many fp32 weights carry fewer bits than they take: a bf16
checkpoint loaded in fp32, or a model dequantized from a GGUF file, like the default target (SmolLM2's layers
Q4_1, its embedding Q8_0). A weight is coded only where every value decodes back to its own fp32 bits, checked by
decoding each block with the kernel's own arithmetic (cpu_kernels/panel_codes.cpp, on cpu_kernels/panel_decode.h), so a
coded weight gives the same products as the fp32 one. Anything else (a trained head's weights, a NaN or inf, a -0.0 the
codes would lose, a subnormal scale) stays fp32. Here: the candidate scales, in torch; the codes, in C++ (one pass).
"""

from __future__ import annotations

import ctypes
import functools

import torch
from torch import Tensor

from . import native

BLOCK = 32  # inputs per q8 and q4 block: cpu_kernels/panel_decode.h's QB
LEVELS = {"q8": (-128, 127), "q4": (0, 15)}
FORMAT = {"q8": 2, "q4": 3}  # cpu_kernels/panels.h's PanelFormat
BLOCK_BYTES = {"q8": 32 * 4 + BLOCK * 32, "q4": 2 * 32 * 4 + BLOCK * 32 // 2}  # a block of a panel of 32 outputs


def bf16_exact(weight: Tensor) -> bool:
    """Every value is a bf16 value, so widening the bf16 copy gives the weight back bit for bit."""
    return bool(torch.equal(weight.to(torch.bfloat16).float().view(torch.int32), weight.view(torch.int32)))


@functools.cache
def coder() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    return native.bind("code_panels", [ptr, i64, i64, i64, ptr, i64, ptr, ptr], i64)


def coded_panels(padded: Tensor, code: str) -> Tensor | None:
    """The padded fp32 weight [out, in] (out a multiple of 32) as `code` ("q8" or "q4") panels, [out / 32, in / BLOCK,
    bytes per block] of uint8, or None where it is not such a weight (or not on the CPU, or the kernels are not
    built)."""
    fn = coder()
    out, inp = padded.shape
    if fn is None or inp % BLOCK or not inp or out % 32 or padded.dtype != torch.float32 or not padded.is_cpu:
        return None
    w = padded.contiguous()
    scales, offsets = candidates(w, code)
    dst = torch.empty(out // 32, inp // BLOCK, BLOCK_BYTES[code], dtype=torch.uint8)
    offset_ptr = None if offsets is None else offsets.data_ptr()
    failed = fn(w.data_ptr(), out, inp, FORMAT[code], scales.data_ptr(), len(scales), offset_ptr, dst.data_ptr())
    return None if failed else dst


def candidates(w: Tensor, code: str) -> tuple[Tensor, Tensor | None]:
    """Each block's candidate scales, [2, out, in / BLOCK], and offsets (q4), [out, in / BLOCK]: the span to the top
    code rounded to fp16, as GGUF stores scales, then the span itself."""
    b = w.view(w.shape[0], -1, BLOCK)
    high = LEVELS[code][1]
    if code == "q4":
        offset = b.amin(-1)
        span = (b.amax(-1) - offset) / high
    else:
        offset, span = None, b.abs().amax(-1) / high
    return torch.stack([span.half().float(), span]), offset


def quantized(weight: Tensor, code: str) -> Tensor:
    """The weight [out, in] rounded to `code` blocks as GGUF's Q8_0 and Q4_1 round it (fp16 scales and offsets): a
    weight that codes exactly, for tests and the kernel's self-check, where its values sit well inside fp16's range
    (about 1e-3 to 1e4)."""
    if weight.dim() != 2 or weight.shape[1] % BLOCK:
        raise ValueError(f"a weight of shape {tuple(weight.shape)} is not [out, in] with in a multiple of {BLOCK}")
    b = weight.reshape(weight.shape[0], -1, BLOCK)
    low, high = LEVELS[code]
    offset = b.amin(-1, keepdim=True).half().float() if code == "q4" else torch.zeros(())
    span = (b.amax(-1, keepdim=True) - offset) if code == "q4" else b.abs().amax(-1, keepdim=True)
    scale = (span / high).half().float()
    q = torch.where(scale > 0, (b - offset) / scale, torch.zeros_like(b)).round().clamp(low, high)
    return torch.mul(q, scale).add_(offset).reshape(weight.shape)
