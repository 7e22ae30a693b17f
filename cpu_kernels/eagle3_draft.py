"""EAGLE-3's draft forward in one call (cpu_kernels/eagle3_draft.cpp) for a batch-1 drafter on CPU: the target outputs
kept since the last draft projected by fc into the head's feature store, the midlayer over the new slots, and the last
slot's logits over the draft vocabulary.

Why: a one-level draft streams about a tenth of the target's weights, and the Python between the head's kernels (module
calls, wrappers, the packed copies' and the layer plan's checks, allocations) cost nearly as much again, measured inside
decoding, where the target's step has evicted the interpreter's data from the caches (docs/benchmarks.md, Cheaper draft
steps). One call runs the same kernels in the same order, so the bits are those of the head's modules. Where it runs:
a head whose midlayer takes the one-layer call (cpu_kernels/decoder_layer.py), whose fc and lm_head are packed in panels
(any format), whose final norm is a plain fp32 RMSNorm and whose borrowed embedding is an fp32 table; the head itself
(heads/eagle3.py) says which of its options the call computes."""

from __future__ import annotations

import ctypes
import functools
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from . import decoder_layer, native, panels
from .decoder_layer import LAYER, PANELS, Plan
from .layer_ops import is_rms_norm
from .packed import current_packed
from .watch import Watch, watching

P, I64 = ctypes.c_void_p, ctypes.c_int64


class HEAD(ctypes.Structure):
    _fields_ = [("layer", LAYER), ("hidden_norm", P), ("fc", PANELS), ("fc_in", I64), ("norm", P)]
    _fields_ += [("norm_eps", ctypes.c_float), ("lm_head", PANELS), ("vocab", I64), ("embed", P), ("embed_rows", I64)]


@functools.cache
def kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    # head, taps, m, projected, tokens, features, n, step, k and v caches, work, out, logits
    step = ctypes.POINTER(decoder_layer.STEP)
    args = [ctypes.POINTER(HEAD), ctypes.POINTER(P), I64, P, P, P, I64, step, P, P, P, P, P]
    return native.bind("eagle3_draft", args, I64)


@functools.cache
def work_kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    return native.bind("eagle3_draft_work", [ctypes.POINTER(HEAD)], I64)


@dataclass
class DraftPlan:
    """A head's weights as the kernel reads them, kept while its watch holds: the midlayer's plan's watch, and the links
    from the head to fc, lm_head and their packed copies, the norm, the embedding and the tensors they hold."""

    head: HEAD
    held: list[Tensor]  # the tensors the struct points into, kept alive
    layer: Plan  # the midlayer's
    work: int  # floats per row of scratch
    watch: Watch


PLANS: weakref.WeakKeyDictionary[Any, DraftPlan] = weakref.WeakKeyDictionary()
# what a plan reads of a head beside its midlayer's plan: fc and lm_head (packed copies too), the norm, the embedding
READS = (
    *(f"{linear}{part}" for linear in ("fc", "lm_head") for part in ("", ".weight", ".bias", ".packed")),
    *("norm", "norm.weight", "norm.eps", "embed_tokens", "embed_tokens.weight", "midlayer"),
)


def plan(head: Any) -> DraftPlan | None:
    """The head's current plan, or None where it does not fit the kernel (or the library is not built)."""
    kept = PLANS.get(head)
    if kept is not None and kept.watch.holds():
        return kept
    made = make_plan(head) if kernel() is not None else None
    if made is None:
        PLANS.pop(head, None)
        return None
    PLANS[head] = made
    return made


def make_plan(head: Any) -> DraftPlan | None:
    layer = decoder_layer.plan(head.midlayer)
    fc, lm_head = current_packed(head.fc), current_packed(head.lm_head)  # a stale packed copy repacks here
    norm, embed = head.norm, head.embed_tokens.weight
    if layer is None or not layer.hidden_norm or fc is None or lm_head is None or not is_rms_norm(norm):
        return None
    hidden = layer.weights.hidden
    vocab = head.lm_head.out_features
    fits = panels.holds(fc, None, hidden) and panels.holds(lm_head, hidden, vocab)
    vectors = (norm.weight, embed)
    fp32 = all(t.dtype == torch.float32 and t.is_cpu and t.is_contiguous() for t in vectors)
    if not fits or head.fc.bias is not None or head.lm_head.bias is not None or not fp32:
        return None
    if norm.weight.shape != (hidden,) or embed.dim() != 2 or embed.shape[1] != hidden:
        return None
    seen = watching([head], READS)
    if not seen.keep_plain([head, head.fc, head.lm_head, norm, head.embed_tokens, head.midlayer]):
        return None
    seen.extend(layer.watch)
    struct = HEAD(layer.weights, layer.hidden_norm, PANELS(fc.data_ptr(), panels.FORMATS[fc.dtype]))
    struct.fc_in, struct.norm, struct.norm_eps = panels.in_features(fc), norm.weight.data_ptr(), norm.eps
    struct.lm_head = PANELS(lm_head.data_ptr(), panels.FORMATS[lm_head.dtype])
    struct.vocab, struct.embed, struct.embed_rows = vocab, embed.data_ptr(), embed.shape[0]
    work = work_kernel()
    assert work is not None, "the library that has eagle3_draft has its work size"
    return DraftPlan(struct, [fc, lm_head, *vectors], layer, work(struct), seen)


def run(
    made: DraftPlan,
    taps: list[Tensor],
    projected: Tensor,
    tokens: Tensor,
    features: Tensor,
    rope: tuple[Tensor, Tensor],
    caches: tuple[Tensor, Tensor],
    start: int,
    mask: Tensor,
) -> tuple[Tensor, Tensor]:
    """taps (the target's tapped layers, m rows of hidden each; m may be 0), end to end a row, through fc into projected
    [m, hidden] (rows of the head's feature store); then tokens
    [n] at slots start .. start+n-1, each reading its row of features [n, hidden] (store rows, which may be among those
    just projected), through the midlayer, k and v written to the caches. Returns the midlayer's output [n, hidden] and
    the last row's logits [vocab]."""
    h, n = made.head, tokens.numel()
    hidden, vocab = h.layer.hidden, h.vocab
    m = projected.shape[0]
    if len(taps) * hidden != h.fc_in:
        raise ValueError(f"fc reads {h.fc_in // hidden} tapped layers, got {len(taps)}")
    for tap in taps:
        check_rows("a tapped layer", tap, m, hidden, any_lead=True)
    check_rows("projected", projected, m, hidden)
    check_rows("features", features, n, hidden)
    if n == 0 or tokens.dtype != torch.long or tokens.dim() != 1 or not tokens.is_contiguous():
        raise ValueError(f"tokens must be a contiguous int64 row of ids, got {tokens.dtype} {tuple(tokens.shape)}")
    step, held = decoder_layer.step_struct(made.layer, n, rope, caches, start, mask)  # held: alive through the call
    work, out, logits = (
        features.new_empty(max(m, n) * made.work),
        features.new_empty(n, hidden),
        features.new_empty(vocab),
    )
    fn = kernel()
    assert fn is not None, "plan() found the kernel"
    k, v = caches
    pointers = (projected.data_ptr(), tokens.data_ptr(), features.data_ptr(), n, step, k.data_ptr(), v.data_ptr())
    tap_ptrs = (P * len(taps))(*(tap.data_ptr() for tap in taps))
    past = fn(h, tap_ptrs, m, *pointers, work.data_ptr(), out.data_ptr(), logits.data_ptr())
    if past >= 0:
        raise ValueError(f"token id {int(tokens[past])} is past the embedding's {h.embed_rows} rows")
    return out, logits


def check_rows(name: str, t: Tensor, rows: int, width: int, any_lead: bool = False) -> None:
    """The kernel reads raw fp32 memory: a tensor of another shape or layout is refused by name. any_lead: rows may
    come in any leading dimensions ([1, rows, width], as a target's forward gives them)."""
    shaped = t.shape[-1:] == (width,) and t.numel() == rows * width if any_lead else t.shape == (rows, width)
    if t.dtype != torch.float32 or not t.is_cpu or not t.is_contiguous() or not shaped:
        raise ValueError(f"{name} must be a contiguous fp32 CPU [{rows}, {width}], got {t.dtype} {tuple(t.shape)}")
