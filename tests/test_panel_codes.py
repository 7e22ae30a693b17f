"""Exact narrower codes for fp32 weights (cpu_kernels/panel_codes.py) and the panel kernel over them
(cpu_kernels/panels.py): a coded weight decodes to its own bits, so every format gives the fp32 panels' products bit
for bit, from fewer bytes; a weight no format holds exactly stays fp32."""

from __future__ import annotations

import pytest
import torch

from draftsmith.cpu_kernels import panel_codes, panels
from draftsmith.cpu_kernels.packed import PackedLinear, pack_linears
from helpers import exactly

needs_kernel = pytest.mark.skipif(not panels.available(), reason="the panel kernel runs fp32 on AVX2 and AVX-512 CPUs")
CODES = ("bf16", "q8", "q4")


def randn(out: int, inp: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(out, inp, generator=torch.Generator().manual_seed(seed)) * 0.05


def coded(w: torch.Tensor, code: str) -> torch.Tensor | None:
    return panels.pack_as(panels.pad(w), code)


def decoded(packed: torch.Tensor, out: int) -> torch.Tensor:
    """The weights a packed tensor holds, as the kernel reads them: the identity's rows times them, each output one
    FMA chain that adds the one weight to zeros."""
    inp = panels.in_features(packed)
    return panels.panel_linear(torch.eye(inp), packed, None, out).T.contiguous()


@needs_kernel
@pytest.mark.parametrize("code", ["q8", "q4"])
def test_codes_decode_to_the_weights_bits(code):
    w = exactly(code, randn(40, 96))
    packed = coded(w, code)
    assert packed is not None and packed.shape == (2, 3, panels.block_bytes(panels.CODED[code]))
    assert torch.equal(decoded(packed, 40).view(torch.int32), w.view(torch.int32))


@needs_kernel
@pytest.mark.parametrize("code", ["q8", "q4"])
def test_weights_the_codes_cannot_hold_are_turned_down(code):
    w = randn(40, 96)
    assert coded(w, code) is None  # plain fp32 values
    assert coded(exactly(code, w)[:, :80], code) is None  # not whole blocks of 32 inputs
    nudged = exactly(code, w)
    nudged[39, 95] = torch.nextafter(nudged[39, 95], torch.tensor(1.0))  # one value off, in the last block
    assert coded(nudged, code) is None
    for bad in (float("nan"), float("inf"), float("-inf")):
        broken = exactly(code, w)
        broken[5, 5] = bad
        assert coded(broken, code) is None


@needs_kernel
def test_a_negative_zero_is_not_coded_as_a_zero():
    w = exactly("q8", randn(4, 32))
    w[0] = 0.0
    w[0, 3] = -0.0  # a 0 code decodes to +0.0: a different bit pattern
    assert coded(w, "q8") is None
    w[0, 3] = 0.0
    assert coded(w, "q8") is not None


@needs_kernel
def test_a_subnormal_scale_is_not_coded():
    """2**-128 is subnormal: under torch.set_flush_denormal(True) the CPU would read it as 0, though the weights it
    scales (q * 2**-128, |q| >= 4) are normal numbers the fp32 panels keep."""
    q = torch.randint(4, 128, (4, 32), generator=torch.Generator().manual_seed(0)).float()
    q[:, 0] = 127  # each block's largest code, as GGUF's Q8_0 makes it
    w = q * torch.sign(torch.randn(4, 32)) * 2.0**-128
    assert bool((w.abs() >= torch.finfo(torch.float32).tiny).all())
    assert coded(w, "q8") is None
    assert coded(w * 2.0**30, "q8") is not None  # the same codes at a normal scale


def test_a_weight_off_the_cpu_is_not_coded():
    """The coder reads host memory: a weight elsewhere (CUDA; here the meta device) is left to fp32."""
    assert panel_codes.coded_panels(torch.zeros(32, 32, device="meta"), "q8") is None


def test_quantized_names_a_width_that_is_not_whole_blocks():
    with pytest.raises(ValueError, match="in a multiple of 32"):
        panel_codes.quantized(torch.randn(4, 50), "q4")


def test_bf16_values_are_found_exactly():
    w = randn(8, 10)
    assert panel_codes.bf16_exact(w.bfloat16().float()) and not panel_codes.bf16_exact(w)


@needs_kernel
def test_a_block_takes_the_raw_span_where_the_fp16_scale_fails():
    """A scale GGUF never stores (not an fp16 value): the span itself fits where its fp16 rounding does not."""
    q = torch.randint(-127, 128, (32, 64), generator=torch.Generator().manual_seed(1)).float()
    q[:, ::32] = 127  # each block's largest code
    scale = (1 + 2.0**-15) * 2.0**-7  # 16 significant bits: q * scale is exact, its fp16 rounding is 2**-7
    scales, _ = panel_codes.candidates(q * scale, "q8")
    assert bool((scales[0] == 2.0**-7).all()) and bool((scales[1] == scale).all())
    packed = coded(q * scale, "q8")
    assert packed is not None and torch.equal(decoded(packed, 32), q * scale)


@needs_kernel
@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize(("out", "inp"), [(70, 64), (33, 576), (960, 576), (1, 32)])
def test_coded_panels_give_the_fp32_panels_bits_at_every_row_count(code, out, inp):
    """Decode (1 row), verify (a few, decoded per k-block into L1) and prefill (past 16 rows, decoded whole) all equal
    the fp32 panels bit for bit, so the engine's row invariance and lossless output carry over."""
    w = exactly(code, randn(out, inp, seed=out))
    packed, fp32 = panels.pack_panels(w), panels.pack_as(panels.pad(w), "fp32")
    assert packed.dtype == panels.CODED[code] and panels.holds(packed, inp, out)
    assert packed.nbytes < fp32.nbytes
    b = torch.randn(out)
    x = torch.randn(40, inp, generator=torch.Generator().manual_seed(1))
    want = panels.panel_linear(x, fp32, b, out)
    for n in (0, 1, 2, 3, 4, 7, 16, 17, 40):
        assert torch.equal(panels.panel_linear(x[:n], packed, b, out), want[:n]), n


@needs_kernel
def test_bf16_panels_take_any_input_width():
    w = exactly("bf16", randn(40, 50))  # not whole blocks of 32: bf16 still holds it
    packed = panels.pack_panels(w)
    assert packed.dtype == torch.bfloat16
    x = torch.randn(5, 50)
    fp32 = panels.pack_as(panels.pad(w), "fp32")
    assert torch.equal(panels.panel_linear(x, packed, None, 40), panels.panel_linear(x, fp32, None, 40))


@needs_kernel
def test_the_narrowest_exact_format_is_chosen():
    w = randn(64, 64)
    q4 = exactly("q4", w)
    assert panels.pack_panels(q4).dtype == torch.uint8  # q4 values are bf16 values too, often: the smaller wins
    assert panels.pack_panels(exactly("q8", w)).dtype == torch.int8
    assert panels.pack_panels(exactly("bf16", w)).dtype == torch.bfloat16
    assert panels.pack_panels(w).dtype == torch.float32


@needs_kernel
def test_the_setting_keeps_every_weight_in_fp32(monkeypatch):
    w = exactly("q4", randn(64, 64))
    monkeypatch.setenv(panels.ENV, "fp32")
    assert panels.pack_panels(w).dtype == torch.float32
    monkeypatch.setenv(panels.ENV, "small")
    with pytest.raises(ValueError, match="DRAFTSMITH_PANELS='small' is not a setting: use exact"):
        panels.pack_panels(w)


@needs_kernel
def test_a_packed_model_repacks_an_edited_weight_in_its_new_format():
    """An in-place edit that leaves q4 values turns the packed copy back to fp32 (and the products follow it)."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 40))
    with torch.no_grad():
        model[0].weight.copy_(exactly("q4", model[0].weight))
    pack_linears(model)
    layer = model[0]
    assert isinstance(layer, PackedLinear) and layer.current().dtype == torch.uint8
    x = torch.randn(3, 64)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
        layer.weight.add_(1e-3)
        assert layer.current().dtype == torch.float32
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
