"""Narrower exact codes for fp32 weights: bf16, and blocks of 32 inputs as int8 times a scale (q8) or 4-bit codes
times a scale plus an offset (q4), the layouts of GGUF's Q8_0 and Q4_1.

Why: a decode step is a pass over the weights, and many fp32 weights carry fewer bits than they take: a bf16
checkpoint loaded in fp32, or a model dequantized from a GGUF file, like the default target (SmolLM2's layers
Q4_1, its embedding Q8_0). A weight is coded only where every value decodes back to its own fp32 bits, by the
arithmetic the kernel decodes with (an fp32 multiply, then an fp32 add, each rounded once; heads/panels.cpp), so a
coded weight gives the same products as the fp32 one; q4's products are exact too, so the kernel decodes q4 with one
FMA. Anything else (a trained head's weights, a NaN or inf, a -0.0 the codes would lose) stays fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

BLOCK = 32  # inputs per q8 and q4 block: heads/panels.cpp's QB
LEVELS = {"q8": (-128, 127), "q4": (0, 15)}


@dataclass
class Blocks:
    """A weight [out, in] as codes q [out, in] (int) with a scale (and an offset for q4) per block of BLOCK inputs,
    [out, in / BLOCK] each: weight = q * scale (+ offset) in fp32."""

    q: Tensor
    scale: Tensor
    offset: Tensor | None


def same_bits(a: Tensor, b: Tensor) -> bool:
    return bool(torch.equal(a.view(torch.int32), b.view(torch.int32)))


def bf16_exact(weight: Tensor) -> bool:
    """Every value is a bf16 value, so widening the bf16 copy gives the weight back bit for bit."""
    return same_bits(weight.to(torch.bfloat16).float(), weight)


def blocks(weight: Tensor, code: str) -> Blocks | None:
    """The weight [out, in] as `code` ("q8" or "q4") blocks that decode back bit for bit, or None where it is not
    such a weight. Its first rows are tried first, so a weight of another kind is turned down quickly."""
    if weight.dim() != 2 or weight.shape[1] % BLOCK or not weight.shape[1] or weight.dtype != torch.float32:
        return None
    if not bool(torch.isfinite(weight).all()):
        return None
    head = weight[: min(len(weight), 32)]
    if len(head) < len(weight) and fit_blocks(head, code) is None:
        return None
    return fit_blocks(weight, code)


def fit_blocks(weight: Tensor, code: str) -> Blocks | None:
    b = weight.reshape(weight.shape[0], -1, BLOCK)
    low, high = LEVELS[code]
    offset = b.amin(-1, keepdim=True) if code == "q4" else None
    span = (b.amax(-1, keepdim=True) - offset) / high if offset is not None else b.abs().amax(-1, keepdim=True) / high
    kept: tuple[Tensor, Tensor, Tensor] | None = None  # codes, scales and fits so far
    # GGUF stores scales in fp16: try that rounding of the span first, then the span itself for the blocks left
    for scale in (span.half().float(), span):
        q, fits = codes(b, scale, offset, low, high)
        if kept is not None:
            q, scale, fits = torch.where(kept[2], kept[0], q), torch.where(kept[2], kept[1], scale), kept[2] | fits
        if bool(fits.all()):
            return Blocks(q.reshape(weight.shape), scale[..., 0], None if offset is None else offset[..., 0])
        kept = q, scale, fits
    return None


def codes(b: Tensor, scale: Tensor, offset: Tensor | None, low: int, high: int) -> tuple[Tensor, Tensor]:
    """Each block's nearest codes under its scale (and offset), and whether they decode to its bits [out, blocks, 1].
    A subnormal scale or offset never fits: under torch.set_flush_denormal(True) the CPU would read it as zero, where
    the fp32 weights it makes are normal numbers and keep their values."""
    q = b / scale if offset is None else (b - offset).div_(scale)
    coded = q.masked_fill_(scale == 0, 0.0).round_().clamp_(low, high).to(torch.int8 if low < 0 else torch.uint8)
    q = coded.float()  # what the kernel reads: a -0.0 is a 0 code
    decoded = torch.mul(q, scale)
    fits = decoded.view(torch.int32) == b.view(torch.int32)
    if offset is not None:  # the product exact, so the kernel's one FMA rounds as this multiply and add do
        fits = decoded.double() == q.double() * scale.double()
        fits &= decoded.add_(offset).view(torch.int32) == b.view(torch.int32)
    fits = fits.all(-1, keepdim=True) & normal_or_zero(scale)
    return coded, fits if offset is None else fits & normal_or_zero(offset)


def normal_or_zero(t: Tensor) -> Tensor:
    return (t == 0) | (t.abs() >= torch.finfo(torch.float32).tiny)


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
