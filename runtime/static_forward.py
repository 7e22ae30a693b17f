"""The target's forward with static shapes, written for torch.compile (serve/engine/compiled.py): no
data-dependent Python, so one compiled graph serves a decode step, a chain or tree verify and a chunk of a prefill.

The same arithmetic as runtime/attention.py's batch-invariant attention, in shapes a compiler can keep:
- rows: 2 to MAX_ROWS (cpu_kernels/packed.py: the counts whose half-precision linears give a row the same bits); the
  caller pads a lone row by repeating it, the copy's KV written to a scratch slot;
- keys in blocks of BLOCK positions from position 0. The blocks before the one holding the step's first token are
  read in place by every row (`prefix`, at least MIN_PREFIX blocks, the ones past that token masked); the TAIL blocks
  from there are gathered per row into position order (a tree row's ancestors sit at slots that are not their
  positions). Each block is a GEMM of one fixed shape, and the blocks are added in position order by a cumsum, so
  masked blocks add exact zeros: a row's bits depend neither on the row count nor on where its step started.
The linears are one opaque op (`draftsmith::packed_linear`) calling the packed kernels the eager forward
runs: the compiler neither repacks their weights nor fuses into them. The rest (norms, rope, softmax, residuals) is
the compiler's: its fused loops give a row the same bits whatever the row count, but not the eager forward's bits,
so a compiled engine runs every forward of the target through this graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from draftsmith.cpu_kernels.packed import FusedLinear, PackedLinear, fused_linear, packed_linear

from .attention import BLOCK, MIN_ROWS, first_off_slot, tail_slots, visible_slots
from .kv_cache import KVCache
from .llama import MLP, Attention, DecoderLayer, ModelConfig, Transformer, apply_rope

MIN_PREFIX = 2  # torch.compile specializes a dimension of 0 or 1: the prefix never has fewer blocks (masked ones)
TAIL = 2  # blocks gathered per row, from the block of the step's first token (or of its first draft off its position)
MAX_TREE = (TAIL - 1) * BLOCK  # draft nodes a verify may hold: its deepest row stays inside the tail


@dataclass
class StaticInputs:
    """One step's inputs, every tensor on the model's device."""

    tokens: Tensor  # [rows]
    positions: Tensor  # [rows]
    slots: Tensor  # [rows]: the cache slot each row's KV is written to
    prefix: Tensor  # bool [blocks]: key blocks read in place, True where no row reads the block here (the tail has
    # it); at least MIN_PREFIX, so that a short context compiles no graph of its own
    tail_slots: Tensor  # [rows, TAIL * BLOCK]: per row, the slot holding each position from the prefix's end on
    tail_unseen: Tensor  # bool [rows, TAIL * BLOCK]: the tail positions past the row's own


LIBRARY = torch.library.Library("draftsmith", "DEF")
LIBRARY.define("packed_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor")


@torch.library.impl(LIBRARY, "packed_linear", "CompositeExplicitAutograd")
def packed_linear_op(x: Tensor, packed: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
    return packed_linear(x, packed, bias, out_features)


@torch.library.register_fake("draftsmith::packed_linear")
def packed_linear_fake(x: Tensor, packed: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


def linear(module: nn.Module, x: Tensor) -> Tensor:
    """A packed linear as one opaque op: the compiler neither repacks its weight nor fuses into it, so it runs the
    kernel (and rounding) the eager forward runs. Its staleness checks stay outside the graph (packed.refresh, before
    each compiled call)."""
    if isinstance(module, (PackedLinear, FusedLinear)) and module.packed is not None and x.dtype == module.dtype:
        return torch.ops.draftsmith.packed_linear(x, module.packed, module.bias, module.out_features)
    return module(x)


def projections(attn: Attention, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """x [rows, in] -> q [rows, heads, d], k and v [rows, kv, d], rope applied."""
    rows = x.shape[0]
    h, kv, d = attn.n_heads, attn.n_kv, attn.head_dim
    if (fused := fused_linear(attn, "qkv_proj")) is not None:
        q, k, v = linear(fused, x).split([h * d, kv * d, kv * d], -1)
    else:
        q, k, v = linear(attn.q_proj, x), linear(attn.k_proj, x), linear(attn.v_proj, x)
    q, k, v = q.view(rows, h, d), k.view(rows, kv, d), v.view(rows, kv, d)
    if hasattr(attn, "q_norm"):
        q, k = attn.q_norm(q), attn.k_norm(k)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, inputs: StaticInputs) -> Tensor:
    """q [rows, heads, d]; the cache [1, kv, slots, d] (fp32, this step's KV written) -> [rows, heads * d] fp32.

    Keys in blocks of BLOCK positions from 0, as runtime/attention.py: the `prefix` blocks every row sees whole, read
    in place; then TAIL blocks per row, gathered into position order. Each block is a GEMM of one fixed shape and
    the blocks are added in order, so a row's bits do not depend on the row count or on where the prefix ends."""
    rows, h, d = q.shape
    kv, g = k_cache.shape[1], h // k_cache.shape[1]
    prefix = inputs.prefix.shape[0] * BLOCK
    keys, values = k_cache[0], v_cache[0]  # [kv, slots, d]
    q = (q.float() * d**-0.5).view(rows, kv, g, d).permute(1, 2, 0, 3).reshape(kv, g * rows, d)
    s_pre = torch.bmm(q, keys.narrow(1, 0, prefix).transpose(1, 2)).view(kv, g, rows, prefix // BLOCK, BLOCK)
    s_pre = s_pre.masked_fill(inputs.prefix[:, None], float("-inf")).view(kv, g, rows, prefix)
    heads = max(g, MIN_ROWS)  # one row's heads make the tail GEMM: at least MIN_ROWS rows
    q_row = q.view(kv, g, rows, d).transpose(1, 2)  # [kv, rows, g, d]
    q_row = torch.cat([q_row, q_row[:, :, -1:].expand(kv, rows, heads - g, d)], 2)
    k_tail = keys.index_select(1, inputs.tail_slots.flatten()).view(kv * rows, TAIL * BLOCK, d)
    s_tail = torch.bmm(q_row.reshape(kv * rows, heads, d), k_tail.transpose(1, 2)).view(kv, rows, heads, -1)
    s_tail = s_tail.masked_fill(inputs.tail_unseen[None, :, None], float("-inf"))[:, :, :g]  # [kv, rows, g, T]
    top = torch.maximum(s_pre.amax(-1), s_tail.amax(-1).transpose(1, 2))  # [kv, g, rows]
    p_pre = (s_pre - top[..., None]).exp()
    p_tail = (s_tail - top.transpose(1, 2)[..., None]).exp()  # [kv, rows, g, T]
    blocks = prefix // BLOCK
    p_blocks = p_pre.reshape(kv, g * rows, blocks, BLOCK).transpose(1, 2)  # [kv, blocks, g*rows, BLOCK]
    # one batched GEMM per KV head: the cache's blocks fold into a batch without a copy only head by head
    v_pre = values.narrow(1, 0, prefix)
    o_pre = torch.stack([torch.bmm(p_blocks[i], v_pre[i].view(blocks, BLOCK, d)) for i in range(kv)])
    o_pre = o_pre.view(kv, blocks, g, rows, d).permute(0, 2, 3, 1, 4)  # [kv, g, rows, blocks, d]
    v_tail = values.index_select(1, inputs.tail_slots.flatten()).view(kv, rows, TAIL, BLOCK, d)
    p_tail = torch.cat([p_tail, p_tail[:, :, -1:].expand(kv, rows, heads - g, -1)], 2)
    p_tail = p_tail.view(kv, rows, heads, TAIL, BLOCK).transpose(2, 3)  # [kv, rows, TAIL, heads, BLOCK]
    o_tail = torch.matmul(p_tail, v_tail)[:, :, :, :g].permute(0, 3, 1, 2, 4)  # [kv, g, rows, TAIL, d]
    sums = torch.cat(
        [p_pre.view(kv, g, rows, blocks, BLOCK).sum(-1), p_tail[:, :, :, :g].sum(-1).permute(0, 3, 1, 2)], 3
    )
    out = torch.cat([o_pre, o_tail], 3).cumsum(3)[:, :, :, -1] / sums.cumsum(3)[..., -1:]  # [kv, g, rows, d]
    return out.permute(2, 0, 1, 3).reshape(rows, h * d)


def static_forward(model: Transformer, inputs: StaticInputs, cache: KVCache) -> tuple[Tensor, list[Tensor]]:
    """-> the final normed hidden states [rows, H] and the residual stream entering every layer, then the last
    layer's output (L + 1 of them: a drafter picks its target layers from these). Every caller gets the same graph:
    another graph may round a row differently."""
    backbone = model.model
    x = backbone.embed_tokens(inputs.tokens)
    cos = model.cos[inputs.positions].to(x.dtype)[:, None]
    sin = model.sin[inputs.positions].to(x.dtype)[:, None]
    streams = []
    for i, layer in enumerate(backbone.layers):
        streams.append(x)
        x = decoder_layer(layer, x, cos, sin, cache.k[i], cache.v[i], inputs)
    return backbone.norm(x), [*streams, x]


@torch.compiler.nested_compile_region  # compiled once, called for every layer
def decoder_layer(
    layer: DecoderLayer, x: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor, inputs: StaticInputs
) -> Tensor:
    attn = layer.self_attn
    q, k, v = projections(attn, layer.input_layernorm(x), cos, sin)
    k_cache[:, :, inputs.slots] = k.transpose(0, 1).to(k_cache.dtype)[None]  # the whole tensor, no view:
    v_cache[:, :, inputs.slots] = v.transpose(0, 1).to(v_cache.dtype)[None]  # written in place
    out = attention(q, k_cache, v_cache, inputs).to(x.dtype)
    x = x + linear(attn.o_proj, out)
    return x + mlp(layer.mlp, layer.post_attention_layernorm(x))


def mlp(block: MLP, x: Tensor) -> Tensor:
    if (fused := fused_linear(block, "gate_up_proj")) is not None:
        gate, up = linear(fused, x).chunk(2, -1)
    else:
        gate, up = linear(block.gate_proj, x), linear(block.up_proj, x)
    return linear(block.down_proj, torch.nn.functional.silu(gate) * up)


def min_rows(cfg: ModelConfig) -> int:
    """Rows a step runs at least: two for the linears (MAX_ROWS), and enough that the prefix's score GEMM has
    MIN_ROWS rows (query heads per KV head x rows)."""
    return max(2, -(-MIN_ROWS // (cfg.num_attention_heads // cfg.num_key_value_heads)))


def static_inputs(
    tokens: Tensor, positions: Tensor, start: int, mask: Tensor | None, rows: int, scratch: int
) -> StaticInputs:
    """The step's inputs for n tokens written at slots start..start+n-1, padded to `rows` by repeating the last row
    (its KV goes to the `scratch` slot). mask: the engine's bool [n, start+n], or None for causal rows."""
    n = tokens.shape[0]
    visible = visible_slots(mask, start, n, tokens.device)
    count = visible.sum(-1)  # a row at position p sees p + 1 slots
    off = first_off_slot(visible, count)
    first = (start if off is None else min(start, off)) // BLOCK * BLOCK
    if int(count.max()) > first + TAIL * BLOCK:
        raise ValueError(
            f"a step reaching position {int(count.max()) - 1} from key block {first // BLOCK} overflows the compiled "
            f"step's {TAIL} tail blocks: draft trees of at most {MAX_TREE} nodes"
        )
    slots, beyond = tail_slots(visible, count, first, TAIL)
    pad = rows - n
    slot_ids = torch.arange(start, start + n, device=tokens.device)
    return StaticInputs(
        pad_last(tokens, pad).clone(),  # fresh tensors: a view's storage offset would be one more compiled shape
        pad_last(positions, pad).clone(),
        torch.cat([slot_ids, slot_ids.new_full((pad,), scratch)]),
        torch.arange(max(MIN_PREFIX, first // BLOCK), device=tokens.device) >= first // BLOCK,
        pad_last(slots.view(n, -1), pad).clone(),
        pad_last(beyond.view(n, -1), pad).clone(),
    )


def pad_last(t: Tensor, pad: int) -> Tensor:
    return torch.cat([t, t[-1:].expand(pad, *t.shape[1:])]) if pad else t
