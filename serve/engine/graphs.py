"""The target's decode and verify steps with static shapes, replayed from CUDA graphs on a GPU.

A 135M target's decode step on a GPU is a few hundred small kernels: launch overhead, not math,
sets its time. A CUDA graph replays them in one launch, but needs fixed shapes and addresses, so
the static form writes the n new tokens' KV with index_copy_ at slot tensors and attends over the
whole preallocated cache under a [n, max_len] mask (gpt-fast's design). One graph per step size n
(1 for plain decoding, 1 + tree size for verification) is captured on first use from the real
inputs; later steps copy their inputs into the graph's buffers and replay it. Prefill stays eager.

On CPU the same static forward runs eagerly (`mode="eager"`), which is how the tests check its
logic against the dynamic forward; `mode="graphs"` needs CUDA. On CPU `auto` picks `compile`: every forward of the
target, prefill included, runs runtime/static_forward.py compiled by inductor (serve/engine/compiled.py).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from draftsmith.runtime.kv_cache import KVCache
from draftsmith.runtime.llama import ForwardOut, Transformer
from draftsmith.runtime.static_forward import MAX_TREE
from draftsmith.serve.engine.compiled import CompiledStep, cache_slots, compile_available, compile_by_default

MODES = ("auto", "compile", "graphs", "eager", "off")
WARMUP = 2  # eager runs on a side stream before capture (cuBLAS and allocator warm-up)


def full_mask(mask: Tensor | None, start: int, n: int, slots: int, device) -> Tensor:
    """The engine's [n, start+n] mask (None: n == 1, every earlier slot visible) widened to [n, slots]."""
    if mask is None:
        return (torch.arange(slots, device=device) <= start).unsqueeze(0)
    out = torch.zeros(n, slots, dtype=torch.bool, device=device)
    out[:, : mask.shape[1]] = mask
    return out


@dataclass
class Captured:
    graph: torch.cuda.CUDAGraph
    tokens: Tensor
    positions: Tensor
    slots: Tensor
    mask: Tensor
    out: ForwardOut  # written by every replay: read it before the next step


@dataclass
class StaticStep:
    model: Transformer
    cache: KVCache
    target_layers: tuple[int, ...] = ()
    mode: str = "eager"  # "graphs" (CUDA) or "eager"
    graphs: dict[int, Captured] = field(default_factory=dict)
    prefill: ClassVar[bool] = False  # decode and verify steps only: the prefill runs the dynamic forward
    fresh_outputs: ClassVar[bool] = False  # a captured graph hands back the same output tensors at every replay

    def __call__(
        self, tokens: Tensor, positions: Tensor, start: int, mask: Tensor | None, logit_rows: slice | None = None
    ) -> ForwardOut:
        n = tokens.numel()
        slots = torch.arange(start, start + n, device=tokens.device)
        wide = full_mask(mask, start, n, self.cache.max_len, tokens.device)
        if self.mode == "eager":
            return self.run(tokens, positions, slots, wide)
        if n not in self.graphs:
            try:
                self.graphs[n] = self.capture(tokens, positions, slots, wide)
            except RuntimeError as e:
                warnings.warn(f"CUDA graph capture failed ({e}); the step runs eagerly from now on", stacklevel=2)
                self.mode = "eager"
                return self.run(tokens, positions, slots, wide)
        g = self.graphs[n]
        for buf, value in ((g.tokens, tokens), (g.positions, positions), (g.slots, slots), (g.mask, wide)):
            buf.copy_(value)
        g.graph.replay()
        return g.out

    def run(self, tokens: Tensor, positions: Tensor, slots: Tensor, mask: Tensor) -> ForwardOut:
        return self.model(tokens, positions, self.cache, slots, mask, None, self.target_layers)

    def capture(self, tokens: Tensor, positions: Tensor, slots: Tensor, mask: Tensor) -> Captured:
        # the warm-up runs write the same KV the real step would: capturing from the real inputs is harmless
        bufs = [t.clone() for t in (tokens, positions, slots, mask)]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP):
                self.run(*bufs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self.run(*bufs)
        tokens, positions, slots, mask = bufs
        return Captured(graph, tokens, positions, slots, mask, out)


def resolve_mode(mode: str, model: Transformer, tree: int = 0) -> str:
    """auto: CUDA graphs on a GPU; on CPU the compiled step where it can run (serve/engine/compiled.py: drafts of up
    to MAX_TREE nodes), else the plain dynamic forward (`off`: attending over the whole cache eagerly would only add
    work). tree: the most draft nodes a verify step holds."""
    if mode not in MODES:
        raise ValueError(f"unknown static-step mode {mode!r}; use one of {', '.join(MODES)}")
    cuda = model.device.type == "cuda"
    if mode == "auto":
        if cuda:
            return "graphs"
        return "compile" if compile_by_default(model) and compile_available(model) and tree <= MAX_TREE else "off"
    if mode == "graphs" and not cuda:
        raise ValueError("cuda_graphs=graphs needs the target on a CUDA device; use auto, compile, eager or off on CPU")
    if mode == "compile" and not compile_available(model):
        raise ValueError(
            "cuda_graphs=compile needs a CPU target with oneDNN-packed linears (float32, or bfloat16/float16 where the "
            "CPU has their kernels) and a C++ compiler; use auto or off"
        )
    if mode == "compile" and tree > MAX_TREE:
        raise ValueError(
            f"cuda_graphs=compile verifies drafts of at most {MAX_TREE} nodes, this one drafts {tree}: draft fewer "
            "tokens (spec.tree.*) or use cuda_graphs=off"
        )
    return mode


def cache_len(mode: str, slots: int) -> int:
    """The KV slots to allocate for `slots` usable ones under `mode` (a resolved one)."""
    return cache_slots(slots) if mode == "compile" else slots


def make_static_step(
    mode: str, model: Transformer, cache: KVCache, target_layers: tuple[int, ...]
) -> StaticStep | CompiledStep | None:
    """mode: a resolved one (resolve_mode)."""
    if mode == "off":
        return None
    if mode == "compile":
        return CompiledStep(model, cache, target_layers)
    return StaticStep(model, cache, target_layers, mode)
