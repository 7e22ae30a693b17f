"""oneDNN-prepacked linears (cpu_kernels/packed.py): same outputs, same parameters, autograd falls back."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.cpu_kernels.packed import FusedLinear, PackedLinear, can_pack, pack_linears
from draftsmith.runtime.llama import MLP, Attention, ModelConfig
from draftsmith.serve.models.loader import load_model
from helpers import build_tiny

pytestmark = pytest.mark.skipif(not can_pack(torch.zeros(1)), reason="no oneDNN on this CPU build")


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_packed_matches_linear(dtype, tol, rows):
    if not can_pack(torch.zeros(1, dtype=dtype)):
        pytest.skip(f"oneDNN has no {dtype} kernels on this CPU (bf16 needs AVX512-BF16 or AVX-NE-CONVERT)")
    torch.manual_seed(0)
    lin = nn.Linear(64, 96, bias=True).to(dtype)
    x = torch.randn(1, rows, 64, dtype=dtype)
    with torch.no_grad():
        want = lin(x)
        got = PackedLinear(lin)(x)
    assert got.shape == want.shape and got.dtype == dtype
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_grad_and_other_dtypes_fall_back_to_the_weight():
    lin = PackedLinear(nn.Linear(8, 4))
    x = torch.randn(3, 8, requires_grad=True)
    lin(x).sum().backward()  # the oneDNN op has no autograd: must not be taken
    assert x.grad is not None and x.grad.shape == x.shape
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = lin(x)  # autocast turns F.linear bf16; the fp32 packed weight must not be used
    assert out.dtype == torch.bfloat16


def test_load_model_packs_and_keeps_state_dict_and_tied_weights(tmp_path):
    folder = build_tiny(tmp_path / "t", tie_word_embeddings=True)
    packed, plain = load_model(folder), load_model(folder, pack=False)
    assert any(isinstance(m, PackedLinear) for m in packed.modules())
    assert not any(isinstance(m, PackedLinear) for m in plain.modules())
    assert packed.state_dict().keys() == plain.state_dict().keys()
    assert packed.lm_head.weight is packed.model.embed_tokens.weight
    tokens = torch.arange(20)
    with torch.inference_mode():
        a = packed(tokens, torch.arange(20), packed.new_cache(32), 0).logits
        b = plain(tokens, torch.arange(20), plain.new_cache(32), 0).logits
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert pack_linears(packed) == 0  # already packed: nothing left to swap


def test_an_in_place_weight_edit_repacks():
    lin = PackedLinear(nn.Linear(16, 8))
    x = torch.randn(2, 16)
    with torch.no_grad():
        lin.weight.add_(1.0)  # e.g. a test perturbing a loaded model's parameters
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_new_data_under_the_same_parameter_repacks(dtype):
    """A `.data` swap (or model.to and back) keeps the Parameter and its version counter; the data address moves."""
    if not can_pack(torch.zeros(1, dtype=dtype)):
        pytest.skip(f"no oneDNN {dtype} kernels on this CPU")
    lin = PackedLinear(nn.Linear(16, 8).to(dtype))
    fused = FusedLinear([PackedLinear(nn.Linear(16, 8).to(dtype)), PackedLinear(nn.Linear(16, 4).to(dtype))])
    x = torch.randn(2, 16, dtype=dtype)
    with torch.no_grad():
        lin(x), fused(x)
        lin.weight.data = torch.randn(8, 16, dtype=dtype)
        fused.parts[1].bias.data = torch.randn(4, dtype=dtype)
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias))
        square = PackedLinear(nn.Linear(16, 16).to(dtype))
        square(x)
        square.weight.data = square.weight.data.t()  # the same address and version
        torch.testing.assert_close(square(x), F.linear(x, square.weight, square.bias))
        want = torch.cat([F.linear(x, p.weight, p.bias) for p in fused.parts], -1)
        torch.testing.assert_close(fused(x), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("k", "n"), [(1536, 576), (576, 960), (576, 3072)])  # SmolLM2's down, qkv, gate_up
def test_a_half_precision_row_gets_the_same_bits_alone_as_among_other_rows(k, n, dtype):
    """oneDNN rounds some bf16 rows differently by row count: alone on AVX512-BF16 (down_proj: 7 of 64 rows here),
    past 32 rows on AMX (1-40 of 64 by shape). A decode step must match the same row in a verify or a prefill of any
    length, bit for bit."""
    if not can_pack(torch.zeros(1, dtype=dtype)):
        pytest.skip(f"oneDNN has no {dtype} kernels on this CPU")
    torch.manual_seed(0)
    lin = PackedLinear(nn.Linear(k, n, bias=False).to(dtype))
    x = torch.randn(1, 300, k, dtype=dtype)
    with torch.inference_mode():
        alone = torch.cat([lin(x[:, i : i + 1]) for i in range(80)], 1)
        assert lin(x[0, 0]).shape == (n,)  # a bare vector keeps its shape
        assert lin(x[:, :0]).shape == (1, 0, n)  # so does an empty one (a draft model with nothing new to read)
        for start, rows in [(0, 2), (3, 7), (0, 32), (1, 33), (0, 64), (5, 65), (0, 300)]:
            together = lin(x[:, start : start + rows])[:, : 80 - start]
            assert torch.equal(together, alone[:, start : start + rows]), (start, rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_qkv_and_gate_up_equal_their_parts(dtype, bias):
    """pack_linears fuses q/k/v and gate/up into one GEMM each; outputs stay those of the separate linears, the
    parameters and state_dict keys stay the parts'."""
    if not can_pack(torch.zeros(1, dtype=dtype)):
        pytest.skip(f"oneDNN has no {dtype} kernels on this CPU")
    torch.manual_seed(0)
    cfg = ModelConfig(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, attention_bias=bias
    )
    attn, mlp = Attention(cfg).to(dtype), MLP(cfg).to(dtype)
    keys = (attn.state_dict().keys(), mlp.state_dict().keys())
    x = torch.randn(1, 5, 64, dtype=dtype)
    cos, sin = torch.ones(5, 16, dtype=dtype), torch.zeros(5, 16, dtype=dtype)
    with torch.inference_mode():
        want = attn.qkv(x, cos, sin), mlp(x)
        pack_linears(attn), pack_linears(mlp)
        assert isinstance(attn.qkv_proj, FusedLinear) and isinstance(mlp.gate_up_proj, FusedLinear)
        got = attn.qkv(x, cos, sin), mlp(x)
    assert (attn.state_dict().keys(), mlp.state_dict().keys()) == keys
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for g, w in zip((*got[0], got[1]), (*want[0], want[1]), strict=True):
        torch.testing.assert_close(g, w, atol=tol, rtol=tol)


def test_a_fused_linear_repacks_when_a_part_is_edited_and_falls_back_under_autograd():
    torch.manual_seed(0)
    parts = [PackedLinear(nn.Linear(16, n)) for n in (8, 4)]
    fused = FusedLinear(parts)
    x = torch.randn(3, 16)
    with torch.no_grad():
        parts[1].weight.add_(1.0)
        torch.testing.assert_close(fused(x), torch.cat([F.linear(x, p.weight, p.bias) for p in parts], -1))
        torch.testing.assert_close(parts[0](x), F.linear(x, parts[0].weight, parts[0].bias))  # a part runs alone
    x.requires_grad_(True)
    fused(x).sum().backward()
    assert x.grad is not None


def test_a_replaced_part_or_parameter_is_not_served_from_a_stale_packed_copy():
    torch.manual_seed(0)
    cfg = ModelConfig(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2)
    attn, mlp = Attention(cfg), MLP(cfg)
    pack_linears(attn), pack_linears(mlp)
    x = torch.randn(1, 3, 32)
    cos, sin = torch.ones(3, 8), torch.zeros(3, 8)
    with torch.no_grad():
        attn.k_proj = PackedLinear(nn.Linear(32, 16))  # a part module replaced after fusing
        mlp.up_proj.weight = nn.Parameter(torch.randn(48, 32))  # a parameter replaced (its version counter is 0)
        _, k, _ = attn.qkv(x, cos, sin)
        want_k = (x @ attn.k_proj.weight.T + attn.k_proj.bias).view(1, 3, 2, 8).transpose(1, 2)
        torch.testing.assert_close(k, want_k, atol=1e-5, rtol=1e-5)
        want = mlp.down_proj(F.silu(F.linear(x, mlp.gate_proj.weight)) * F.linear(x, mlp.up_proj.weight))
        torch.testing.assert_close(mlp(x), want, atol=1e-5, rtol=1e-5)
