"""fp32 rope, cache write and attention in one call (cpu_kernels/rope_attention.py): the same numbers as rope + SDPA in
float64, the cache written at the right slots, and operands that do not fit refused by name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from draftsmith.cpu_kernels import native, rope_attention
from draftsmith.runtime.llama import Attention, ModelConfig, RMSNorm, apply_rope, rope_tables
from draftsmith.serve.engine.tree import DraftTree

pytestmark = pytest.mark.skipif(not native.usable(), reason="draftsmith's fp32 kernels run on AVX2 and AVX-512 CPUs")
SLOTS = 80


def tables(d: int) -> tuple[torch.Tensor, torch.Tensor]:
    return rope_tables(ModelConfig(hidden_size=d, num_attention_heads=1, head_dim=d), SLOTS)


def reference(qkv, positions, caches, start, mask, heads, kv, d):
    """rope + cache write + SDPA in float64, the layer's torch path."""
    n = qkv.shape[1]
    cos, sin = (t[positions].double() for t in tables(d))
    x = qkv.double().view(1, n, heads + 2 * kv, d).transpose(1, 2)
    qk = apply_rope(x[:, : heads + kv], cos, sin)
    k_cache, v_cache = (c.double() for c in caches)
    k_cache[:, :, start : start + n], v_cache[:, :, start : start + n] = qk[:, heads:], x[:, heads + kv :]
    cols = start + n if mask is None else mask.shape[-1]
    seen = torch.ones(n, cols, dtype=torch.bool).tril(start) if mask is None else mask
    out = F.scaled_dot_product_attention(
        qk[:, :heads], k_cache[:, :, :cols], v_cache[:, :, :cols], attn_mask=seen.view(1, 1, n, cols), enable_gqa=True
    )
    return out.transpose(1, 2).reshape(1, n, -1), k_cache, v_cache


def run(qkv, positions, caches, start, mask, heads):
    cos, sin = tables(caches[0].shape[-1])
    with torch.no_grad():
        return rope_attention.rope_attention(qkv, cos[positions], sin[positions], caches, start, mask, heads)


def filled_caches(kv: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, kv, SLOTS, d, generator=g), torch.randn(1, kv, SLOTS, d, generator=g)


# groups of 3, 1, 2, 3 heads; 8 (taken 3, 3, 2 at a time) and 4 (3, 1)
@pytest.mark.parametrize(("heads", "kv", "d"), [(9, 3, 64), (4, 4, 16), (2, 1, 12), (6, 2, 40), (8, 1, 8), (8, 2, 20)])
@pytest.mark.parametrize(("start", "n"), [(0, 1), (0, 17), (30, 1), (30, 5), (60, 20)])
def test_the_call_computes_rope_and_attention(heads, kv, d, start, n):
    qkv = torch.randn(1, n, (heads + 2 * kv) * d, generator=torch.Generator().manual_seed(n))
    positions = torch.arange(start, start + n)
    caches = filled_caches(kv, d, start)
    want, k_want, v_want = reference(qkv, positions, caches, start, None, heads, kv, d)
    got = run(qkv, positions, caches, start, None, heads)
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(caches[0], k_want.float(), rtol=1e-6, atol=1e-6)  # k roped at its slots
    assert torch.equal(caches[1], v_want.float())  # v copied as is


def test_a_tree_mask_is_followed():
    heads, kv, d, start = 6, 2, 16, 25
    tree = DraftTree(torch.zeros(6, dtype=torch.long), torch.tensor([-1, -1, 0, 0, 2, 1]))
    n = 7  # the root row and six nodes
    qkv = torch.randn(1, n, (heads + 2 * kv) * d, generator=torch.Generator().manual_seed(4))
    positions, mask = tree.positions(start), tree.attention_mask(start)
    caches = filled_caches(kv, d, 5)
    want, _, _ = reference(qkv, positions, caches, start, mask, heads, kv, d)
    torch.testing.assert_close(run(qkv, positions, caches, start, mask, heads), want.float(), rtol=1e-5, atol=1e-5)


def test_a_row_reads_the_same_bits_alone_or_among_others():
    heads, kv, d = 9, 3, 64
    qkv = torch.randn(1, 40, (heads + 2 * kv) * d, generator=torch.Generator().manual_seed(5))
    whole = run(qkv, torch.arange(40), filled_caches(kv, d, 0), 0, None, heads)
    caches = filled_caches(kv, d, 0)
    run(qkv[:, :20], torch.arange(20), caches, 0, None, heads)
    for p in range(20, 40):
        assert torch.equal(run(qkv[:, p : p + 1], torch.tensor([p]), caches, p, None, heads), whole[:, p : p + 1])


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"start": 79}, "rows at slots 79..80 do not fit a cache of 80 slots"),
        ({"heads": 5}, "does not hold 5 q heads and 3 kv heads"),
        ({"mask": torch.ones(2, 31, dtype=torch.bool)}, "mask has 31 slots; rows at 30..31 need 32..80"),
        (
            {"mask": torch.ones(1, 64, dtype=torch.bool)},
            "mask (1, 64) must hold one bool row of slots per query row (2)",
        ),
        ({"dtype": torch.float64}, "qkv must be fp32 on the CPU, got torch.float64"),
        ({"cache": torch.zeros(1, 3, SLOTS, 64)[..., ::2]}, "caches must be contiguous"),
    ],
)
def test_operands_that_do_not_fit_are_named(change, problem):
    heads, kv, d = change.get("heads", 9), 3, 32
    qkv = torch.randn(1, 2, (9 + 2 * kv) * d, dtype=change.get("dtype", torch.float32))
    caches = (change.get("cache", torch.zeros(1, kv, SLOTS, d)), torch.zeros(1, kv, SLOTS, d))
    start = change.get("start", 30)
    cos, sin = tables(d)
    with pytest.raises(ValueError, match=problem.replace("(", "\\(").replace(")", "\\)")):
        rope_attention.rope_attention(qkv, cos[:2], sin[:2], caches, start, change.get("mask"), heads)


@pytest.mark.parametrize("d", [12, 20, 64])
def test_masked_and_causal_rows_agree_bit_for_bit(d):
    """A chunk after a prefix (masked) and a prefill from 0 (causal) compute a row on two code paths; the compiler
    must not fuse one path's scalar tail into an FMA and not the other's (a head_dim that is not a multiple of 8)."""
    heads, kv = 4, 2
    qkv = torch.randn(1, 30, (heads + 2 * kv) * d, generator=torch.Generator().manual_seed(d))
    whole = run(qkv, torch.arange(30), filled_caches(kv, d, 1), 0, None, heads)
    caches = filled_caches(kv, d, 1)
    run(qkv[:, :12], torch.arange(12), caches, 0, None, heads)
    mask = torch.ones(18, 30, dtype=torch.bool).tril(12)
    assert torch.equal(run(qkv[:, 12:], torch.arange(12, 30), caches, 12, mask, heads), whole[:, 12:])


def test_non_finite_values_are_not_hidden():
    heads, kv, d = 2, 1, 16
    qkv = torch.randn(1, 2, (heads + 2 * kv) * d)
    caches = filled_caches(kv, d, 2)
    blind = torch.ones(2, 12, dtype=torch.bool)
    blind[1] = False  # a row that may see nothing attends to nothing, as in torch's SDPA
    out = run(qkv, torch.arange(10, 12), caches, 10, blind, heads)
    assert out[0, 0].isfinite().all() and torch.equal(out[0, 1], torch.zeros(heads * d))
    caches[0][0, 0, 3] = float("nan")  # a NaN key poisons the rows that read it
    assert run(qkv[:, :1], torch.tensor([10]), caches, 10, None, heads).isnan().all()


@pytest.mark.parametrize(("heads", "kv", "d"), [(9, 3, 64), (4, 2, 20)])
def test_q_and_k_norms_inside_equal_the_norm_modules_outside(heads, kv, d):
    """Qwen3: each q and k head RMSNormed before rope, in the call, gives the bits of the RMSNorm modules applied to
    the projection's rows first, q and k, cache included."""
    g = torch.Generator().manual_seed(d)
    qkv = torch.randn(1, 6, (heads + 2 * kv) * d, generator=g)
    q_norm, k_norm = RMSNorm(d, 1e-6), RMSNorm(d, 1e-6)
    with torch.no_grad():
        q_norm.weight.copy_(torch.rand(d, generator=g) + 0.5), k_norm.weight.copy_(torch.rand(d, generator=g) + 0.5)
        rows = qkv.view(1, 6, heads + 2 * kv, d)
        normed = torch.cat(
            [q_norm(rows[:, :, :heads]), k_norm(rows[:, :, heads : heads + kv]), rows[:, :, heads + kv :]], 2
        )
    cos, sin = tables(d)
    caches, outside = filled_caches(kv, d, 3), filled_caches(kv, d, 3)
    norms = (q_norm.weight.detach(), k_norm.weight.detach(), 1e-6)
    with torch.no_grad():
        got = rope_attention.rope_attention(qkv, cos[20:26], sin[20:26], caches, 20, None, heads, norms)
    want = run(normed.reshape(1, 6, -1), torch.arange(20, 26), outside, 20, None, heads)
    assert torch.equal(got, want) and torch.equal(caches[0], outside[0]) and torch.equal(caches[1], outside[1])


def test_norms_the_kernel_cannot_apply_stay_modules():
    attn = Attention(ModelConfig(hidden_size=64, num_attention_heads=4, head_dim=16, qk_norm=True))
    assert rope_attention.norms_fit(attn)
    attn.k_norm.eps = 1e-3  # two eps
    assert not rope_attention.norms_fit(attn)
    attn.k_norm.eps = attn.q_norm.eps
    handle = attn.q_norm.register_forward_hook(lambda *_: None)  # the kernel would skip the hook
    assert not rope_attention.norms_fit(attn)
    handle.remove()
    attn.q_norm.forward = attn.q_norm.forward  # a forward of its own
    assert not rope_attention.norms_fit(attn)
    del attn.q_norm.forward
    attn.k_norm.to(torch.float64)
    assert not rope_attention.norms_fit(attn)
    attn.k_norm.to(torch.float32)
    assert rope_attention.norms_fit(attn)
    attn.q_norm = torch.nn.LayerNorm(16, eps=attn.k_norm.eps)  # a weight and an eps, other arithmetic
    assert not rope_attention.norms_fit(attn)
    attn.q_norm = Halved(16, attn.k_norm.eps)  # an RMSNorm with a forward of its own
    assert not rope_attention.norms_fit(attn)
    with pytest.raises(ValueError, match="q and k norms must weigh the head's 16 features"):
        qkv, caches = torch.zeros(1, 1, 8 * 16), filled_caches(2, 16, 0)
        cos, sin = (t[:1] for t in tables(16))
        rope_attention.rope_attention(qkv, cos, sin, caches, 0, None, 4, (torch.ones(8), torch.ones(16), 1e-6))


class Halved(RMSNorm):
    def forward(self, x):
        return super().forward(x) / 2
