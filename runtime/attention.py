"""Batch-invariant attention for CPU bf16/fp16 targets: a token at a position gets the same bits whether it runs alone
(a decode step), among k rows (a chain or tree verify) or in a prefill (whole, or chunked after a prefix-cache hit).
With the packed linears (row-invariant in bf16, cpu_kernels/packed.py) this makes the whole forward row-invariant, so
bf16 speculative output equals bf16 plain output token for token, and a prefix-cache hit equals a cold prefill.

Attention runs in fp32 on MKL GEMMs, which change a row's bits in two ways (PyTorch 2.13, AVX-512): a GEMM of 1-3
rows takes another kernel than one of 4 or more (whose rows all agree, however many), and a reduction over K terms
changes with K, even when the extra terms are masked zeros. Hence:
- every GEMM has at least MIN_ROWS rows (a short call repeats its last row), and runs in a batch of two or more:
  with several threads MKL splits a lone GEMM's rows between them, and a piece under MIN_ROWS rows takes the other
  kernel (a batch keeps each GEMM whole on one thread);
- keys are cut into blocks of BLOCK positions counted from position 0, and each block is one GEMM of fixed shape:
  scores [rows, d] x [d, BLOCK], then [rows, BLOCK] x [BLOCK, d] for the values, and the softmax sum per block.
  The blocks are added in order by a cumsum, which is sequential: blocks past a row's position add exact zeros.
  The softmax subtracts the row's max over all its blocks (exact in any order), so blocks need no rescaling;
- a tree row's draft ancestors sit at cache slots that are not their positions, so the blocks holding draft
  positions ("tail" blocks) are gathered per row into position order; blocks before them are read in place;
- the KV cache is kept in fp32 (values rounded to bf16 first, so the same numbers), read in place without a copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

BLOCK = 64  # positions per key block: faster long prefills than 32, the same decode (docs/benchmarks.md)
MIN_ROWS = 4  # MKL's fp32 GEMM gives other bits below 4 rows
CHUNK = 32  # query rows per pass: its per-block partial sums stay in cache (a long prefill gains; see BLOCK)


@dataclass
class BlockPlan:
    """How the query rows of one forward read the cache, shared by every layer. Rows see positions 0..p in order."""

    rows: int  # query rows
    padded: int  # rows of the in-place GEMMs: rows * heads-per-group >= MIN_ROWS
    in_place: int  # leading blocks read straight from the cache (slot = position for every row)
    unseen: Tensor  # bool [1, 1, padded, in_place * BLOCK]: which of those slots each row does not attend
    tail: int  # further blocks, gathered per row
    tail_slots: Tensor | None  # long [rows * tail * BLOCK]: the cache slot of each tail position, row by row
    tail_unseen: Tensor | None  # bool [1, rows, tail, 1, BLOCK]: tail positions a row does not reach
    length: int  # cache slots read (past the cache's end: zeros)


def visible_slots(mask: Tensor | None, start: int, n: int, device) -> Tensor:
    """bool [n, slots]: the engine's mask, or (None) causal rows at start..start+n-1."""
    if mask is not None:
        return mask.reshape(n, -1)
    return torch.arange(start + n, device=device) <= torch.arange(start, start + n, device=device)[:, None]


def make_plans(mask: Tensor | None, start: int, n: int, group: int, device) -> list[BlockPlan]:
    """One plan per CHUNK query rows. group: query heads per KV head."""
    visible = visible_slots(mask, start, n, device)
    return [make_plan(visible[i : i + CHUNK], group) for i in range(0, n, CHUNK)]


def make_plan(visible: Tensor, group: int) -> BlockPlan:
    n = visible.shape[0]
    used = visible.any(0).nonzero()
    visible = visible[:, : int(used[-1]) + 1]
    count = visible.sum(-1)  # a row at position p sees p + 1 slots
    blocks = (int(count.max()) - 1) // BLOCK + 1
    off = first_off_slot(visible, count)
    in_place = blocks if off is None else min(off // BLOCK, blocks)
    padded = max(n, -(-MIN_ROWS // group))
    seen = pad_columns(visible[:, : in_place * BLOCK], in_place * BLOCK)
    seen = torch.cat([seen, seen[-1:].expand(padded - n, -1)])
    unseen = ~seen.view(1, 1, padded, in_place * BLOCK)
    plan = BlockPlan(
        n, padded, in_place, unseen, blocks - in_place, None, None, max(in_place * BLOCK, visible.shape[1])
    )
    if plan.tail:
        plan.tail_slots, plan.tail_unseen = tail_slots(visible, count, in_place * BLOCK, plan.tail)
    return plan


def first_off_slot(visible: Tensor, count: Tensor) -> int | None:
    """The first slot where some row's view is not positions 0..p (a tree's sibling onwards); None if none is.
    count: slots each row sees (a row at position p sees p + 1)."""
    slots = torch.arange(visible.shape[1], device=visible.device)
    off = (visible != (slots < count[:, None])).any(0).nonzero()
    return int(off[0]) if off.numel() else None


def tail_slots(visible: Tensor, count: Tensor, first: int, tail: int) -> tuple[Tensor, Tensor]:
    """Per row, the slot holding each position first..first + tail*BLOCK - 1 (the row's rank-th visible slot holds
    position rank: nodes are topologically ordered), and which of those positions the row does not reach."""
    n, width = visible.shape[0], tail * BLOCK
    rank = visible.cumsum(-1) - 1
    column = torch.where(visible & (rank >= first), rank - first, width)  # width: a spill column, dropped
    out = torch.zeros(n, width + 1, dtype=torch.long, device=visible.device)
    out.scatter_(1, column, torch.arange(visible.shape[1], device=visible.device).expand(n, -1))
    beyond = first + torch.arange(width, device=visible.device) >= count[:, None]
    return out[:, :width].reshape(-1), beyond.view(1, n, tail, 1, BLOCK)


def pad_columns(t: Tensor, width: int) -> Tensor:
    return F.pad(t, (0, width - t.shape[-1])) if t.shape[-1] < width else t


def read_fp32(cache: Tensor, length: int) -> Tensor:
    """Cache slots [0, length) as fp32 [kv, length, d]: a view of an fp32 cache (Transformer.new_cache keeps the
    batch-invariant path's cache in fp32, so a step copies nothing), else a copy, zeros past the cache's end."""
    kv, slots, d = cache.shape[1], cache.shape[2], cache.shape[3]
    if cache.dtype == torch.float32 and length <= slots:
        return cache[0, :, :length]
    out = torch.zeros(kv, length, d, dtype=torch.float32, device=cache.device)
    filled = min(slots, length)
    out[:, :filled] = cache[0, :, :filled]
    return out


def batched_mm(a: Tensor, b: Tensor, out: Tensor | None = None) -> Tensor:
    """torch.bmm, a batch of one run as two (see the module docstring)."""
    if a.shape[0] > 1:
        return torch.bmm(a, b, out=out)
    two = torch.bmm(a.expand(2, *a.shape[1:]), b.expand(2, *b.shape[1:]))[:1]
    return two if out is None else out.copy_(two)


def attend(q: Tensor, k_cache: Tensor, v_cache: Tensor, plans: list[BlockPlan]) -> Tensor:
    """q [1, heads, n, d]; the whole K and V cache [1, kv_heads, slots, d], new tokens written -> [1, heads, n, d]."""
    length = max(p.length for p in plans)
    keys, values = read_fp32(k_cache, length), read_fp32(v_cache, length)
    q32 = q[0].float() * q.shape[-1] ** -0.5
    outs, row = [], 0
    for plan in plans:
        outs.append(attend_rows(q32[:, row : row + plan.rows], keys, values, plan))
        row += plan.rows
    return (outs[0] if len(outs) == 1 else torch.cat(outs, 1)).unsqueeze(0).to(q.dtype)


def attend_rows(q: Tensor, keys: Tensor, values: Tensor, plan: BlockPlan) -> Tensor:
    """q fp32 [heads, n, d], scaled; keys and values [kv, L, d] -> [heads, n, d]."""
    h, n, d = q.shape
    kv = keys.shape[0]
    q = q.view(kv, h // kv, n, d)
    top: Tensor | None = None  # each row's max score over all its blocks: [kv, g, rows]
    if plan.in_place:
        s_in = in_place_scores(q, keys, plan)  # [kv, g, padded, in_place * BLOCK]
        top = s_in.amax(-1)
    if plan.tail:
        s_tail = tail_scores(q, keys, plan)  # [kv, n, tail, heads, BLOCK]
        t = s_tail.amax((2, 4)).transpose(1, 2)[:, : h // kv]
        top = t if top is None else torch.cat([torch.maximum(top[:, :, :n], t), top[:, :, n:]], 2)
    assert top is not None, "a plan reads in-place or tail blocks"
    parts = []  # (outputs [kv, g, n, blocks, d], softmax sums [kv, g, n, blocks]) per block, in position order
    if plan.in_place:
        parts.append(in_place_values(s_in, top, values, plan, n))
    if plan.tail:
        parts.append(tail_values(s_tail, top[:, :, :n], values, plan))
    out, sums = (torch.cat(x, 3) if len(parts) > 1 else x[0] for x in zip(*parts, strict=True))
    return (in_order(out) / in_order(sums).unsqueeze(-1)).reshape(h, n, d)


def in_order(blocks: Tensor) -> Tensor:
    """The sum over dim 3 (blocks), added in position order: cumsum is sequential, so the exact zeros of blocks past
    a row's position leave its sum as it was (a reduction's order, and so its bits, would change with the count)."""
    return blocks.cumsum(3).select(3, -1)


def pad_rows(t: Tensor, rows: int) -> Tensor:
    """Repeat the last row (dim 2) up to rows."""
    return torch.cat([t, t[:, :, -1:].expand(-1, -1, rows - t.shape[2], *t.shape[3:])], 2) if rows > t.shape[2] else t


def in_place_scores(q: Tensor, keys: Tensor, plan: BlockPlan) -> Tensor:
    """One GEMM per KV head over every in-place slot: a score reduces over d only, and MKL gives a column the
    same bits for any width from 12 columns up (and any row count from MIN_ROWS), so no per-block GEMMs here."""
    kv, g, _, d = q.shape
    q = pad_rows(q, plan.padded).reshape(kv, g * plan.padded, d)
    k = keys[:, : plan.in_place * BLOCK]
    s = batched_mm(q, k.transpose(1, 2)).view(kv, g, plan.padded, -1)  # a batch of one with a single KV head
    return s.masked_fill_(plan.unseen, float("-inf"))


def in_place_values(scores: Tensor, top: Tensor, values: Tensor, plan: BlockPlan, n: int) -> tuple[Tensor, Tensor]:
    """-> each block's unnormalized output [kv, g, n, in_place, d] and softmax sum [kv, g, n, in_place]. One batched
    GEMM per KV head (blocks as the batch): the cache's slices fold into a batch without a copy only head by head."""
    kv, g, rows, length = scores.shape
    blocks, d = plan.in_place, values.shape[-1]
    p = (scores - top[..., None]).exp_().view(kv, g * rows, blocks, BLOCK)
    v = values[:, :length].view(kv, blocks, BLOCK, d)
    out = torch.empty(kv, blocks, g * rows, d, dtype=p.dtype, device=p.device)
    for h in range(kv):
        batched_mm(p[h].transpose(0, 1), v[h], out=out[h])  # a batch of one below BLOCK positions
    out = out.view(kv, blocks, g, rows, d)[:, :, :, :n].permute(0, 2, 3, 1, 4)
    return out, p.sum(-1).view(kv, g, rows, blocks)[:, :, :n]


def tail_scores(q: Tensor, keys: Tensor, plan: BlockPlan) -> Tensor:
    kv, g, n, d = q.shape
    assert plan.tail_slots is not None and plan.tail_unseen is not None, "make_plan sets them when plan.tail"
    heads = max(g, MIN_ROWS)  # one row's heads make one GEMM: padded to MIN_ROWS
    q = pad_rows(q.transpose(1, 2), heads)
    k = keys.index_select(1, plan.tail_slots).view(kv, n, plan.tail, BLOCK, d)
    q = q.reshape(kv, n, 1, heads, d).expand(kv, n, plan.tail, heads, d).reshape(-1, heads, d)
    s = batched_mm(q, k.view(-1, BLOCK, d).transpose(1, 2)).view(kv, n, plan.tail, heads, BLOCK)
    return s.masked_fill_(plan.tail_unseen, float("-inf"))


def tail_values(scores: Tensor, top: Tensor, values: Tensor, plan: BlockPlan) -> tuple[Tensor, Tensor]:
    """-> outputs [kv, g, n, tail, d] and sums [kv, g, n, tail]. top [kv, g, n]; padded heads take the last head's
    max."""
    kv, n, tail, heads, _ = scores.shape
    g = top.shape[1]
    assert plan.tail_slots is not None, "make_plan sets it when plan.tail"
    m = pad_rows(top.transpose(1, 2), heads)  # [kv, n, heads]
    p = (scores - m[:, :, None, :, None]).exp_()  # [kv, n, tail, heads, BLOCK]: a GEMM of MIN_ROWS rows or more
    v = values.index_select(1, plan.tail_slots).view(kv, n, tail, BLOCK, -1)
    out = batched_mm(p.view(-1, heads, BLOCK), v.view(-1, BLOCK, v.shape[-1])).view(kv, n, tail, heads, -1)[..., :g, :]
    return out.permute(0, 3, 1, 2, 4), p[:, :, :, :g].sum(-1).permute(0, 3, 1, 2)
