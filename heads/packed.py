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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

PACKABLE = (torch.float32, torch.bfloat16)
ROWS_HINT = 16  # oneDNN picks the weight layout for this many rows; any number of rows stays correct
# In bf16, oneDNN runs a 1-row input through another kernel than 2 or more rows, and on real activations some
# of its rows round differently (SmolLM2's down_proj: 5 of 120 rows), while every count from 2 up gives each row
# the same bits. So a half-precision row runs as two: a decode step then matches a verify or prefill row bit for
# bit (heads/attention.py), and bf16 costs about the same for 2 rows as for 1.


def can_pack(weight: Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype in PACKABLE
        and torch.backends.mkldnn.is_available()
        and (weight.dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


def version(t: Tensor) -> int:
    """Bumped by every in-place edit; inference tensors keep no counter (and cannot be edited outside it)."""
    return -1 if t.is_inference() else t._version


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.repack()

    def repack(self) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach().contiguous(), ROWS_HINT)
        self.packed_version = version(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        if self.takes_packed(x):
            if version(self.weight) != self.packed_version:
                self.repack()
            if x.dtype != torch.float32 and x.numel() == self.in_features:  # one row: run it as two, see ROWS_HINT
                two = torch.ops.mkldnn._linear_pointwise(
                    x.reshape(1, -1).expand(2, -1), self.packed, self.bias, "none", [], ""
                )
                return two[:1].view(*x.shape[:-1], self.out_features)
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def takes_packed(self, x: Tensor) -> bool:
        return (
            x.device.type == "cpu"
            and x.dtype == self.packed.dtype
            and not torch.is_grad_enabled()
            and not torch.is_autocast_enabled("cpu")
        )

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed={self.packed.dtype}"


def pack_linears(model: nn.Module) -> int:
    """Replace the frozen model's CPU nn.Linear layers by PackedLinear in place; returns how many."""
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and can_pack(child.weight)
    ]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child))
    return len(swaps)
