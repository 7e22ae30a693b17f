"""fp32 CPU attention for a batch-1 cached forward in one call (cpu_kernels/rope_attention.cpp): rope on q and k, k and
v into the cache, and each query row's softmax over the cache slots it may see.

Why: in eager PyTorch these are some twenty small ops per layer (views, rope's halves, two cache writes, SDPA),
whose dispatch costs more than their arithmetic in a decode step. And SDPA's bits for a row change with the rows
around it; here a row reads its visible slots one at a time in slot order, so it gets the same bits decoded alone,
verified among k rows (chain or tree) or prefilled, and with the panel linears (cpu_kernels/panels.py) the whole fp32
forward is row-invariant. A row's heads that share a key and value head (a GQA group) are taken three at a time, so
each key and value is loaded once for them; every head's sums stay its own, in the same order. Where it runs:
cpu_kernels/native.py (fp32, AVX2 and AVX-512 CPUs by default).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch
from torch import Tensor

from . import native
from .layer_ops import is_rms_norm
from .watch import plain

P, I64 = ctypes.c_void_p, ctypes.c_int64


class QKNORM(ctypes.Structure):
    """Qwen3's per-head q and k norms as the kernel applies them before rope (cpu_kernels/rope_attention.h)."""

    _fields_ = [("q", P), ("k", P), ("eps", ctypes.c_float)]


ARGS = [P, I64, I64, I64, I64, P, P, P, P, I64, I64, P, I64, ctypes.POINTER(QKNORM), P]
QKNorms = tuple[Tensor, Tensor, float]  # q's weight, k's weight [head_dim] each, their eps


@functools.cache
def kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    return native.bind("rope_attention", ARGS)


def handles(x: Tensor, mask: object) -> bool:
    """A no-grad fp32 CPU batch-1 step whose mask is None (causal) or a bool tensor, where the kernel is built."""
    plain_mask = mask is None or (isinstance(mask, Tensor) and mask.dtype == torch.bool)
    return x.shape[0] == 1 and plain_mask and native.handles(x)


def rope_attention(
    qkv: Tensor,
    cos: Tensor,
    sin: Tensor,
    caches: tuple[Tensor, Tensor],
    start: int,
    mask: Tensor | None,
    heads: int,
    norms: QKNorms | None = None,
) -> Tensor:
    """qkv [1, n, (heads + 2 kv) d] from the fused projection; cos, sin [n, d]; caches [1, kv, max_len, d] each,
    written at slots start .. start+n-1; mask bool [.., n, cols] (True = may see) or None: row r sees slots up to
    start + r; norms: RMSNorms of each q and k head before rope (Qwen3), or None. Returns the attention output
    [1, n, heads d]."""
    k_cache, v_cache = caches
    _, kv, max_len, d = k_cache.shape
    n = qkv.shape[1]
    check_fp32((("qkv", qkv),))
    cos, sin, seen = step_operands(tuple(qkv.shape), (cos, sin), caches, start, mask, heads)
    rows = qkv.reshape(n, -1).contiguous()
    weights, struct = norm_struct(norms, d)  # weights held in a name: their memory must outlive the call
    out = qkv.new_empty(1, n, heads * d)
    fn = kernel()
    assert fn is not None, "handles() said the kernel is built"
    mask_ptr, cols = (None, 0) if seen is None else (seen.data_ptr(), seen.shape[1])
    fn(
        rows.data_ptr(),
        n,
        heads,
        kv,
        d,
        cos.data_ptr(),
        sin.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        max_len,
        start,
        mask_ptr,
        cols,
        struct,
        out.data_ptr(),
    )
    return out


def norm_struct(norms: QKNorms | None, d: int) -> tuple[tuple[Tensor, ...], QKNORM | None]:
    """The q and k norms as the kernel reads them (contiguous fp32 weights of d), and the tensors it points into."""
    if norms is None:
        return (), None
    q, k, eps = norms
    check_fp32((("q norm", q), ("k norm", k)))
    if q.shape != (d,) or k.shape != (d,):
        raise ValueError(f"q and k norms must weigh the head's {d} features, got {tuple(q.shape)}, {tuple(k.shape)}")
    q, k = q.contiguous(), k.contiguous()
    return (q, k), QKNORM(q.data_ptr(), k.data_ptr(), eps)


def qk_norms(attn: Any) -> QKNorms | None:
    """An attention module's q and k norms (Qwen3's) as the kernel applies them; None where it has none."""
    if not hasattr(attn, "q_norm"):
        return None
    return attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps


def norms_fit(attn: Any) -> bool:
    """Whether the kernel can stand in for the module's q and k norms: it has none, or two plain RMSNorms (of the
    class whose arithmetic the kernel does, no hook or forward of their own, cpu_kernels/watch.py) of fp32 CPU weights
    over head_dim with one eps."""
    if not hasattr(attn, "q_norm"):
        return True
    q, k, d = attn.q_norm, getattr(attn, "k_norm", None), getattr(attn, "head_dim", None)
    if not (is_rms_norm(q) and is_rms_norm(k)) or not plain([q, k]):
        return False
    weights = [q.weight, k.weight]
    fp32 = all(isinstance(w, Tensor) and w.dtype == torch.float32 and w.is_cpu and w.shape == (d,) for w in weights)
    return fp32 and isinstance(q.eps, float) and q.eps == k.eps


def step_operands(
    qkv: tuple[int, ...], rope: tuple[Tensor, Tensor], caches: tuple[Tensor, Tensor], start: int, mask, heads: int
) -> tuple[Tensor, Tensor, Tensor | None]:
    """A step's rope rows, cache and mask checked against the fused qkv rows' shape [1, n, width], as the kernel
    reads them: contiguous cos and sin [n, d], and the mask as [n, cols] bytes (None: causal)."""
    cos, sin = (t if t.is_contiguous() else t.contiguous() for t in rope)
    check_fp32((("cos", cos), ("sin", sin), ("k cache", caches[0]), ("v cache", caches[1])))
    check_layout(qkv, cos, sin, caches, start, heads)
    return cos, sin, visible_rows(mask, qkv[1], start, caches[0].shape[2])


def visible_rows(mask: Tensor | None, n: int, start: int, max_len: int) -> Tensor | None:
    """The mask as contiguous [n, cols] bytes, checked against the rows and the cache; None stays None (causal)."""
    if mask is None:
        return None
    if mask.dim() < 2 or mask.shape[-2] != n or mask.numel() != n * mask.shape[-1] or mask.dtype != torch.bool:
        raise ValueError(f"mask {tuple(mask.shape)} must hold one bool row of slots per query row ({n})")
    seen = mask.reshape(n, -1).contiguous()
    if not start + n <= seen.shape[1] <= max_len:
        raise ValueError(
            f"mask has {seen.shape[1]} slots; rows at {start}..{start + n - 1} need {start + n}..{max_len}"
        )
    return seen


def check_fp32(named: tuple[tuple[str, Tensor], ...]) -> None:
    for name, t in named:
        if t.dtype != torch.float32 or not t.is_cpu:
            raise ValueError(f"{name} must be fp32 on the CPU, got {t.dtype} on {t.device}")


def check_layout(
    qkv: tuple[int, ...], cos: Tensor, sin: Tensor, caches: tuple[Tensor, Tensor], start: int, heads: int
) -> None:
    """qkv: the shape of the fused projection's rows, [1, n, (heads + 2 kv) d]."""
    k_cache, v_cache = caches
    _, kv, max_len, d = k_cache.shape
    n = qkv[1]
    if (
        v_cache.shape != k_cache.shape
        or k_cache.shape[0] != 1
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
    ):
        raise ValueError(
            f"caches must be contiguous [1, kv, max_len, d] pairs, got {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    if heads % kv or qkv[0] != 1 or qkv[-1] != (heads + 2 * kv) * d or cos.numel() != n * d or sin.numel() != n * d:
        raise ValueError(f"qkv {qkv} does not hold {heads} q heads and {kv} kv heads of {d}, or rope tables miss rows")
    if not 0 <= start <= start + n <= max_len:
        raise ValueError(f"rows at slots {start}..{start + n - 1} do not fit a cache of {max_len} slots")
