"""The fp32 panel kernel (cpu_kernels/panels.py): right products, the same bits for a row whatever the row count, the
tile or the thread count, and oneDNN's kernels where it is off or cannot be built."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.cpu_kernels import native, panels
from draftsmith.cpu_kernels.packed import PackedLinear, can_pack, pack_weight, packed_linear
from helpers import exactly

needs_kernel = pytest.mark.skipif(not panels.available(), reason="the panel kernel runs fp32 on AVX2 and AVX-512 CPUs")


def weights(out: int, inp: int, bias: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(out * 1000 + inp)
    w = torch.randn(out, inp, generator=g) * 0.05
    return w, (torch.randn(out, generator=g) if bias else None)


@needs_kernel
@pytest.mark.parametrize(("out", "inp"), [(96, 64), (70, 50), (1, 3), (33, 576)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 5, 6, 7, 13, 16, 17, 300])
def test_panels_compute_the_linear(out, inp, bias, rows):
    w, b = weights(out, inp, bias)
    x = torch.randn(rows, inp, generator=torch.Generator().manual_seed(rows))
    got = panels.panel_linear(x, panels.pack_panels(w), b, out)
    assert got.shape == (rows, out) and got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(x.double(), w.double(), None if b is None else b.double()).float())


@needs_kernel
@pytest.mark.parametrize(("out", "inp"), [(70, 50), (40, 200), (960, 576)])  # 200: a last k-block of 8
def test_a_row_gets_the_same_bits_whatever_the_rows_around_it(out, inp):
    """Decode (1 row), verify (a few) and prefill (many) must agree bit for bit: speculative output then equals
    plain output token for token, and a prefix-cache hit equals a cold prefill."""
    w, b = weights(out, inp)
    packed = panels.pack_panels(w)
    x = torch.randn(40, inp, generator=torch.Generator().manual_seed(1))
    whole = panels.panel_linear(x, packed, b, out)
    for start in range(8):
        for n in (1, 2, 3, 4, 5, 6, 7, 11, 12, 13, 16, 17, 32 - start):
            part = panels.panel_linear(x[start : start + n], packed, b, out)
            assert torch.equal(part, whole[start : start + n]), (start, n)


@needs_kernel
@pytest.mark.parametrize("code", ["fp32", "q4"])  # q4: the coded roads (in registers, per block, whole panels)
def test_the_thread_count_changes_no_bits(code):
    w, b = weights(200, 96)
    packed = panels.pack_panels(w if code == "fp32" else exactly(code, w))
    assert panels.NAMES[packed.dtype] == code
    x = torch.randn(20, 96, generator=torch.Generator().manual_seed(2))
    threads = torch.get_num_threads()
    try:
        runs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            runs.append(panels.panel_linear(x, packed, b, 200))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(r, runs[0]) for r in runs)


@needs_kernel
def test_packed_linears_take_the_panels_for_fp32_and_keep_their_parameters():
    lin = nn.Linear(50, 70)
    packed = PackedLinear(lin)
    assert packed.packed is not None and packed.packed.dim() == 3
    assert packed.weight is lin.weight and packed.bias is lin.bias
    x = torch.randn(4, 50)
    with torch.no_grad():
        torch.testing.assert_close(packed(x), lin(x))
    x3 = torch.randn(2, 3, 50)  # leading dimensions are kept
    with torch.no_grad():
        assert packed(x3).shape == (2, 3, 70)
        torch.testing.assert_close(packed(x3), lin(x3))


def test_turned_off_fp32_packs_for_onednn(monkeypatch):
    if not can_pack(torch.zeros(1)):
        pytest.skip("no oneDNN on this CPU build")
    monkeypatch.setenv(native.ENV, "0")
    w, b = weights(70, 50)
    packed = pack_weight(w)
    assert packed.dim() == 2  # oneDNN's blocked layout
    x = torch.randn(3, 50)
    torch.testing.assert_close(packed_linear(x, packed, b, 70), F.linear(x, w, b))


@needs_kernel
@pytest.mark.parametrize(
    ("x", "bias", "problem"),
    [
        (torch.randn(2, 49), None, "input has 49 features, the weight expects 50"),
        (torch.randn(2, 50, dtype=torch.float64), None, "fp32 CPU inputs, got torch.float64"),
        (torch.randn(2, 50).bfloat16(), None, "fp32 CPU inputs, got torch.bfloat16"),
        (torch.randn(2, 50), torch.randn(69), "bias must be fp32 of shape \\(70,\\)"),
        (torch.randn(2, 50), torch.randn(70).double(), "bias must be fp32"),
    ],
)
def test_operands_that_do_not_fit_are_named_before_the_kernel_reads_them(x, bias, problem):
    w, _ = weights(70, 50)
    with pytest.raises(ValueError, match=problem):
        panels.panel_linear(x, panels.pack_panels(w), bias, 70)


@needs_kernel
def test_weights_not_packed_into_panels_are_refused():
    w, b = weights(70, 50)
    with pytest.raises(ValueError, match="pack with pack_panels"):
        panels.panel_linear(torch.randn(2, 50), w.t().contiguous(), b, 70)
    with pytest.raises(ValueError, match="do not hold 100 outputs"):
        panels.panel_linear(torch.randn(2, 50), panels.pack_panels(w), b, 100)  # 3 panels hold 96 outputs
    with pytest.raises(ValueError, match="torch.float16 tensor of shape \\(3, 50, 32\\) is not a panel format"):
        panels.panel_linear(torch.randn(2, 50), panels.pack_panels(w).half(), b, 70)


@needs_kernel
def test_no_input_features_leave_the_bias():
    b, x, packed = torch.randn(5), torch.randn(3, 0), panels.pack_panels(torch.zeros(5, 0))
    assert torch.equal(panels.panel_linear(x, packed, b, 5), b.expand(3, 5))
    assert torch.equal(panels.panel_linear(x, packed, None, 5), torch.zeros(3, 5))


@needs_kernel
def test_a_strided_bias_is_read_as_its_values():
    w, _ = weights(70, 50)
    b = torch.randn(140)[::2]
    x = torch.randn(3, 50)
    torch.testing.assert_close(panels.panel_linear(x, panels.pack_panels(w), b, 70), F.linear(x, w, b))
