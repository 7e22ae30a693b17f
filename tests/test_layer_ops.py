"""fp32 RMSNorm and SwiGLU in one call each (cpu_kernels/layer_ops.py): torch's numbers, a row's bits whatever the rows
around it, and torch's ops wherever gradients flow, another dtype runs, or the forward is being compiled."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from draftsmith.cpu_kernels import layer_ops, native
from draftsmith.cpu_kernels.packed import pack_linears
from draftsmith.runtime.llama import MLP, ModelConfig, RMSNorm

needs_kernels = pytest.mark.skipif(not native.usable(), reason="draftsmith's fp32 kernels run on AVX2 and AVX-512 CPUs")


@needs_kernels
@pytest.mark.parametrize("dim", [576, 64, 13, 1])
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_rms_norm_is_torchs(dim, rows):
    g = torch.Generator().manual_seed(dim + rows)
    x, w = torch.randn(rows, dim, generator=g) * 3, torch.randn(dim, generator=g)
    with torch.no_grad():
        torch.testing.assert_close(layer_ops.rms_norm(x, w, 1e-5), F.rms_norm(x, (dim,), w, 1e-5))


@needs_kernels
@pytest.mark.parametrize("width", [1536, 64, 13, 1])
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_silu_mul_is_torchs(width, rows):
    h = torch.randn(rows, 2 * width, generator=torch.Generator().manual_seed(width)) * 8
    with torch.no_grad():
        got = layer_ops.silu_mul(h)
    torch.testing.assert_close(got, F.silu(h[:, :width]) * h[:, width:], rtol=2e-6, atol=1e-6)


@needs_kernels
def test_a_row_gets_the_same_bits_among_others():
    x, h, w = torch.randn(40, 576), torch.randn(40, 3072), torch.randn(576)
    with torch.no_grad():
        norms, gates = layer_ops.rms_norm(x, w, 1e-6), layer_ops.silu_mul(h)
        for r in (0, 7, 39):
            assert torch.equal(layer_ops.rms_norm(x[r : r + 1], w, 1e-6), norms[r : r + 1])
            assert torch.equal(layer_ops.silu_mul(h[r : r + 1]), gates[r : r + 1])


@needs_kernels
def test_norm_modules_take_the_call_only_in_fp32_inference():
    norm = RMSNorm(64, 1e-5)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        assert native.handles(x) and not native.handles(x.bfloat16()) and not native.handles(x.double())
        torch.testing.assert_close(norm(x), F.rms_norm(x, (64,), norm.weight, 1e-5))
    assert not native.handles(x)  # gradients flow: torch's ops, which autograd knows
    norm(x.requires_grad_()).sum().backward()
    assert x.grad is not None


@needs_kernels
def test_a_compiled_forward_keeps_torchs_ops():
    norm = RMSNorm(16, 1e-5)
    compiled = torch.compile(norm, backend="eager", fullgraph=True)  # a ctypes call would break the graph
    x = torch.randn(3, 16)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), norm(x))


@needs_kernels
def test_bad_operands_are_named():
    with torch.no_grad(), pytest.raises(ValueError, match="needs an fp32 weight of \\(8,\\)"):
        layer_ops.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-5)
    with torch.no_grad(), pytest.raises(ValueError, match="even width, got 7"):
        layer_ops.silu_mul(torch.randn(2, 7))


@needs_kernels
def test_autocast_keeps_torchs_ops():
    """Under CPU autocast the fused linears give bf16: the fp32 kernels must not read it as fp32."""
    mlp = MLP(ModelConfig(hidden_size=32, intermediate_size=48))
    pack_linears(mlp)
    x = torch.randn(2, 32)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert not native.handles(x)
        assert mlp(x).dtype == torch.bfloat16
    with torch.no_grad(), pytest.raises(ValueError, match="fp32 CPU tensors, got torch.bfloat16"):
        layer_ops.silu_mul(torch.randn(2, 8).bfloat16())
