"""The target's forward compiled by torch.compile (inductor): prefill, decode and verify all run one compiled graph.

runtime/static_forward.py writes the forward with static shapes: rows x key blocks, each decoder layer one nested
compile region (compiled once, called 30 times). Rows and key blocks are dynamic dimensions, so one graph serves
every step: a prefill runs it in chunks of MAX_ROWS rows, a lone decode row is padded to two. A token's logits then
carry the same bits in a decode, a verify and a prefill, in bf16 and in fp32, so speculative output equals plain
output token for token and a prefix-cache hit equals a cold prefill. That holds within one graph (two graphs of the
same forward round a bf16 row differently), so every engine of a model must run the same one: the cache length is a
dynamic dimension from the first call, and the graph returns every layer's residual stream (a drafter picks its
target layers outside it) rather than taking them as a constant.

The eager forward (runtime/llama.py) stays the reference and the fallback: a graph that fails to compile warns once
and the engine runs eagerly from then on. Compiled code is cached on disk under `<cache root>/inductor` (inductor's
FX graph cache), so a later process pays for tracing only; the first step's compile time is reported.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from draftsmith.cpu_kernels import native
from draftsmith.cpu_kernels.packed import MAX_ROWS, can_pack, packed_linears, refresh
from draftsmith.runtime.attention import BLOCK
from draftsmith.runtime.kv_cache import KVCache
from draftsmith.runtime.llama import ForwardOut, Transformer
from draftsmith.runtime.static_forward import MIN_PREFIX, StaticInputs, min_rows, static_forward, static_inputs
from draftsmith.serve.engine.tree import causal_mask
from draftsmith.serve.models.target import cache_root

DISABLE_ENV = "DRAFTSMITH_COMPILE"  # "0": cuda_graphs=auto runs the eager forward on CPU (the test suite's default)


def compile_available(model: Transformer) -> bool:
    """A CPU target whose linears are packed (cpu_kernels/packed.py; the compiled graph calls their kernels) and a C++
    compiler."""
    if model.device.type != "cpu" or not can_pack(model.lm_head.weight):
        return False
    use_disk_cache(str(cache_root()))  # before inductor's first look at the environment, which sets its own default
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except (RuntimeError, OSError):
        return False
    return True


def compile_by_default(model: Transformer) -> bool:
    """What cuda_graphs=auto picks for this CPU target: the compiled step where it pays, a bf16 or fp16 target on
    AVX-512 (with or without AMX). An fp32 target on draftsmith's kernels (cpu_kernels/native.py) runs eagerly: their
    one-call stack runs 2.2-2.7x the compiled step on AVX2 and on AVX512-BF16 (docs/benchmarks.md); the compiled
    step stays exact there too (tests/test_compiled_step.py runs its fp32 cases)."""
    if os.environ.get(DISABLE_ENV, "1") == "0" or torch.backends.cpu.get_cpu_capability() != "AVX512":
        return False
    return not native.runs(model.lm_head.weight)


def cache_slots(slots: int) -> int:
    """The KV slots a compiled step needs for `slots` usable ones: a scratch slot for padded rows, and at least
    the key blocks its prefix always reads."""
    return max(slots + 1, MIN_PREFIX * BLOCK)


def use_disk_cache(root: str) -> None:
    """Keep inductor's compiled code under draftsmith's cache root, unless the user points it elsewhere (inductor
    writes its own default into the environment the first time it looks, so that one is replaced too)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(root, "inductor")


@dataclass
class CompiledStep:
    """Called as the engine's forward: (tokens, positions, start, mask, logit_rows) -> ForwardOut."""

    model: Transformer
    cache: KVCache
    target_layers: tuple[int, ...] = ()
    compile_s: float = 0.0  # seconds the first call spent compiling (0 until then, or when cached graphs loaded)
    failed: bool = False
    graph: Callable[..., tuple[Tensor, list[Tensor]]] = field(init=False, repr=False)
    prefill: ClassVar[bool] = True  # every forward of the target: a prefill's rows must carry a decode's bits
    fresh_outputs: ClassVar[bool] = True  # each call's outputs are its own tensors

    def __post_init__(self) -> None:
        use_disk_cache(str(cache_root()))
        self.graph = torch.compile(static_forward)
        self.rows = min_rows(self.model.config)
        self.linears = packed_linears(self.model)  # a linear swapped in later comes packed from its own weights
        self.scratch = self.cache.max_len - 1
        for t in (*self.cache.k, *self.cache.v):  # every engine's cache length runs the same graph
            torch._dynamo.mark_dynamic(t, 2)

    def __call__(
        self, tokens: Tensor, positions: Tensor, start: int, mask: Tensor | None, logit_rows: slice | None = None
    ) -> ForwardOut:
        if not self.failed:
            refresh(self.linears)  # the graph reads the packed copies as they are: repack edited weights first
            out = self.compiled(tokens, positions, start, mask)
            if out is not None:
                h, layers = out
                rows = h if logit_rows is None else h[logit_rows]
                return ForwardOut(self.model.lm_head(rows).float(), h, layers)
        # the eager forward: after a compile failure, this call's chunks already written are simply written again.
        # mask None means causal rows from `start` here (as static_inputs reads it); the eager forward's only from 0
        n = tokens.shape[0]
        causal = mask if mask is not None or n == 1 else causal_mask(start, n, tokens.device)
        return self.model(tokens, positions, self.cache, start, causal, logit_rows, self.target_layers)

    def compiled(
        self, tokens: Tensor, positions: Tensor, start: int, mask: Tensor | None
    ) -> tuple[Tensor, list[Tensor]] | None:
        """Hidden states and target-layer streams, in chunks of MAX_ROWS rows (a prefill, a large tree); None once the
        compiler failed."""
        hidden: list[Tensor] = []
        aux: list[list[Tensor]] = []
        for begin in range(0, tokens.shape[0], MAX_ROWS):
            end = min(begin + MAX_ROWS, tokens.shape[0])
            chunk_mask = None if mask is None else mask[begin:end, : start + end]
            out = self.chunk(tokens[begin:end], positions[begin:end], start + begin, chunk_mask, end - begin)
            if out is None:
                return None
            hidden.append(out[0])
            aux.append(out[1])
        h = torch.cat(hidden) if len(hidden) > 1 else hidden[0]
        return h, [torch.cat(parts) for parts in zip(*aux, strict=True)]

    def chunk(
        self, tokens: Tensor, positions: Tensor, start: int, mask: Tensor | None, n: int
    ) -> tuple[Tensor, list[Tensor]] | None:
        inputs = static_inputs(tokens, positions, start, mask, max(n, self.rows), self.scratch)
        mark_dynamic(inputs)
        first = self.compile_s == 0.0
        if first:
            print(
                "draftsmith: compiling the target's forward (torch.compile; minutes the first time on a machine, "
                f"seconds once cached in {os.environ.get('TORCHINDUCTOR_CACHE_DIR')})",
                file=sys.stderr,
                flush=True,
            )
        begin = time.perf_counter()
        try:
            hidden, streams = self.graph(self.model, inputs, self.cache)
        except Exception as e:  # noqa: BLE001 - any compiler failure: fall back to the eager forward, loudly
            warnings.warn(
                f"the compiled step failed ({type(e).__name__}: {e}); running eagerly from now on", stacklevel=4
            )
            self.failed = True
            return None
        if first:
            self.compile_s = time.perf_counter() - begin
        return hidden[:n], [streams[i][:n] for i in self.target_layers]


def mark_dynamic(inputs: StaticInputs) -> None:
    """Rows and key blocks vary from step to step: one graph for all of them."""
    for t in (inputs.tokens, inputs.positions, inputs.slots, inputs.tail_slots, inputs.tail_unseen, inputs.prefix):
        torch._dynamo.mark_dynamic(t, 0)
