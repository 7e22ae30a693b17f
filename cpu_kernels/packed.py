"""oneDNN-prepacked linears for CPU inference.

A decode step multiplies one row by every weight matrix, and `aten::mm` on a plain row-major
weight is much slower than oneDNN on a weight reordered once into its blocked layout.
The layout is chosen for a batch of ROWS_HINT rows: verifying a draft tree runs 4-16 rows, and a
1-row layout makes multi-row steps far slower while a multi-row one serves decode and verify alike
(figures: docs/benchmarks.md, CPU kernels).
`pack_linears` swaps every nn.Linear of a frozen model for a PackedLinear that keeps the same
`weight` / `bias` parameters (state_dict keys, tied embeddings and readers of `.weight` are
unchanged) plus the packed copy, rebuilt when the weight is edited in place. Only no-grad calls
on CPU in the packed dtype take the packed path; anything else (autograd, autocast to another
dtype) runs F.linear on the original weight. The packed copy costs a second set of linear weights
in memory.
fp32 linears take draftsmith's own panel kernel instead where it runs (cpu_kernels/panels.py: it streams a decode
step's weights faster and gives a row the same bits whatever the row count).
Linears that read the same input (q/k/v, gate/up: a module's `FUSED` map) then run as one GEMM over their
concatenated weights (`FusedLinear`): a decode step makes 4 weight calls per layer instead of 7, and one long
GEMM streams its weights faster than three short ones.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import native, panels
from .watch import Watch, watching

NATIVE = {  # does this CPU's oneDNN have kernels for the dtype
    torch.float32: lambda: True,
    torch.bfloat16: lambda: torch.ops.mkldnn._is_mkldnn_bf16_supported(),
    torch.float16: lambda: torch.ops.mkldnn._is_mkldnn_fp16_supported(),
}
ROWS_HINT = 16  # oneDNN picks the weight layout for this many rows; any number of rows stays correct
# A half-precision row must get the same bits in a decode step, a verify and a prefill (runtime/attention.py), but
# oneDNN's bf16 kernels round a row differently with the row count. On AVX512-BF16 a 1-row input takes another
# kernel than 2 or more rows (SmolLM2's down_proj: 5 of 120 rows differ), and every count from 2 up agrees. On AMX
# its brgemm blocks K by the row count: 2 to 32 rows agree with each other, and larger counts differ among
# themselves (1-40 of 64 rows, by shape). So a half-precision GEMM runs 2 to MAX_ROWS rows: a single row as two,
# a prefill in pieces of MAX_ROWS. bf16 costs about the same for 2 rows as for 1; the pieces slow an AMX prefill's
# linears down, yet leave them faster than fp32's (docs/benchmarks.md, AMX needs pieces of 32 rows). fp16
# (AVX512-FP16, AMX) is cut the same way.
# Under 32 input features AMX rounds 3+ rows differently again (toy models only; real targets are far wider).
MAX_ROWS = 32


def can_pack(weight: Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype in NATIVE
        and torch.backends.mkldnn.is_available()
        and NATIVE[weight.dtype]()
    )


def pack_weight(weight: Tensor) -> Tensor:
    """A [out, in] weight packed for its kernel: fp32 in panels where cpu_kernels/panels.py's kernel runs (a 3-D
    [panels, in, PANEL] tensor), else oneDNN's blocked layout, chosen for ROWS_HINT rows."""
    if weight.dtype == torch.float32 and panels.available():
        return panels.pack_panels(weight)
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), ROWS_HINT)


def packed_linear(x: Tensor, packed: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
    """x @ packed.T + bias on the kernel pack_weight packed for: fp32 panels, else oneDNN, whose half precision
    runs 2 to MAX_ROWS rows per GEMM (see MAX_ROWS)."""
    if packed.dim() == 3:
        return panels.panel_linear(x, packed, bias, out_features)
    n = x.numel() // x.shape[-1]
    if x.dtype == torch.float32 or n == 0 or 2 <= n <= MAX_ROWS:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    rows = x.reshape(-1, x.shape[-1])
    pieces = [invariant_rows(rows[i : i + MAX_ROWS], packed, bias) for i in range(0, len(rows), MAX_ROWS)]
    return torch.cat(pieces).view(*x.shape[:-1], out_features)


def invariant_rows(rows: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    """A GEMM of up to MAX_ROWS half-precision rows; a single row runs as two."""
    if len(rows) == 1:
        return torch.ops.mkldnn._linear_pointwise(rows.expand(2, -1), packed, bias, "none", [], "")[:1]
    return torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")


def handles_packed(x: Tensor, dtype: torch.dtype) -> bool:
    """Only no-grad CPU calls in the packed dtype: autograd and autocast need the plain weight, and so do fp32 panels
    while draftsmith's kernels are switched off (a model on the reference path: oneDNN's packed layouts stay, as
    torch's own)."""
    eager = not torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu")
    switched_off = native.SWITCHED_OFF.get() and dtype == torch.float32 and panels.available()  # pack_weight's choice
    return x.is_cpu and x.dtype == dtype and eager and not switched_off


class PackedLinear(nn.Module):
    packed: Tensor | None  # None once released
    seen: Watch | None  # what the packed copy was made from; None once released

    def __init__(self, linear: nn.Linear, pack: bool = True) -> None:
        """pack=False leaves it released (packed on first use): pack_linears packs only the linears it does not fuse,
        as finding a weight's exact format (cpu_kernels/panel_codes.py) is a pass over it."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.dtype = linear.weight.dtype
        self.packed, self.seen = None, None
        if pack:
            self.repack()

    def repack(self) -> None:
        self.packed, self.seen = pack_weight(self.weight), watching([self], ("weight",))

    def release(self) -> None:
        """Drop the packed copy (a FusedLinear holds this weight now); it is rebuilt if this linear runs alone."""
        self.packed, self.seen = None, None

    def current(self) -> Tensor:
        """The packed weight, repacked first if it was released, or its weight edited or replaced."""
        if self.seen is None or not self.seen.holds():
            self.repack()
        assert self.packed is not None  # repack() made it
        return self.packed

    def forward(self, x: Tensor) -> Tensor:
        if handles_packed(x, self.dtype):
            return packed_linear(x, self.current(), self.bias, self.out_features)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed={self.dtype}"


class FusedLinear(nn.Module):
    """PackedLinears that read the same input, run as one GEMM; forward returns their outputs concatenated.
    The parts stay where they are (state_dict keys, training and export see them unchanged): they are held in a
    tuple, which nn.Module does not register."""

    def __init__(self, parts: list[PackedLinear]) -> None:
        super().__init__()
        self.parts = tuple(parts)
        self.sizes = [p.out_features for p in parts]
        self.out_features = sum(self.sizes)
        self.dtype = parts[0].dtype
        self.repack()
        for p in parts:
            p.release()

    def repack(self) -> None:
        weight = torch.cat([p.weight.detach() for p in self.parts])
        self.packed, self.bias = pack_weight(weight), fused_bias(self.parts)
        self.seen = watching(self.parts, ("weight", "bias"))

    def current(self) -> Tensor:
        """The packed weight, repacked first if a part's weight or bias was edited, replaced, added or dropped."""
        if not self.seen.holds():
            self.repack()
        return self.packed

    def forward(self, x: Tensor) -> Tensor:
        if handles_packed(x, self.dtype):
            return packed_linear(x, self.current(), self.bias, self.out_features)
        return torch.cat([p(x) for p in self.parts], -1)

    def extra_repr(self) -> str:
        return f"sizes={self.sizes}, packed={self.dtype}"


def fused_bias(parts: tuple[PackedLinear, ...]) -> Tensor | None:
    """The parts' biases end to end, zeros for a part without one (a bias set to None after fusing); None if none has
    one."""
    if all(p.bias is None for p in parts):
        return None
    return torch.cat([p.weight.new_zeros(p.out_features) if p.bias is None else p.bias.detach() for p in parts])


def panel_formats(model: nn.Module) -> dict[str, int]:
    """How many of the model's packed linears run from each panel format ("q4": 91, ...); empty where none is in
    panels (oneDNN's layouts, or not packed)."""
    counts: dict[str, int] = {}
    refresh(packed_linears(model))  # an edited weight may have changed its format
    for module in model.modules():
        packed = module.packed if isinstance(module, (PackedLinear, FusedLinear)) else None
        if packed is not None and packed.dim() == 3:
            name = panels.NAMES[packed.dtype]
            counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items()))


def packed_linears(model: nn.Module) -> list[PackedLinear | FusedLinear]:
    return [m for m in model.modules() if isinstance(m, (PackedLinear, FusedLinear))]


def refresh(linears: list[PackedLinear | FusedLinear]) -> None:
    """Repack every packed copy whose weights were edited or replaced (released parts stay released): what a forward
    that reads `packed` directly (a compiled graph, runtime/static_forward.py) must run before each call. The caller
    keeps the list (packed_linears): walking a model's modules costs as much as the checks."""
    for module in linears:
        if isinstance(module, FusedLinear) or module.packed is not None:
            module.current()


def current_packed(module: nn.Module) -> Tensor | None:
    """A PackedLinear's or FusedLinear's up-to-date packed weight; None for a plain linear, or for a subclass with a
    forward of its own (a kernel reading the weight would skip it)."""
    if not isinstance(module, (PackedLinear, FusedLinear)):
        return None
    return module.current() if type(module).forward in (PackedLinear.forward, FusedLinear.forward) else None


class Fuses(Protocol):
    """A module with a `FUSED` map: fused linear name -> the names of its parts."""

    FUSED: ClassVar[dict[str, tuple[str, ...]]]


def fused_linear(module: Fuses, name: str) -> FusedLinear | None:
    """module's FusedLinear `name`, if pack_linears made one and its parts are still the module's (a part module
    replaced after packing leaves the fused copy behind)."""
    fused = getattr(module, name)
    if fused is None or any(getattr(module, n) is not p for n, p in zip(module.FUSED[name], fused.parts, strict=True)):
        return None
    return fused


def pack_linears(model: nn.Module) -> int:
    """Replace the frozen model's CPU nn.Linear layers by PackedLinear in place, then fuse each module's `FUSED`
    groups (name -> parts) into a FusedLinear set as that name; returns how many linears were packed."""
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and can_pack(child.weight)
    ]
    linears = [PackedLinear(child, pack=False) for _, _, child in swaps]
    for (parent, name, _), linear in zip(swaps, linears, strict=True):
        setattr(parent, name, linear)
    fused_parts: set[int] = set()
    for module in list(model.modules()):
        for fused, names in getattr(module, "FUSED", {}).items():
            parts = [getattr(module, n) for n in names]
            if getattr(module, fused) is None and all(type(p) is PackedLinear for p in parts):
                if len({(p.dtype, p.in_features, p.bias is None) for p in parts}) == 1:
                    setattr(module, fused, FusedLinear(parts))
                    fused_parts |= {id(p) for p in parts}
    for linear in linears:
        if id(linear) not in fused_parts:
            linear.repack()
    return len(swaps)
