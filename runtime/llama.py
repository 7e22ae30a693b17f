"""Llama-family transformer in plain PyTorch: Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM.

Batch 1, static KV cache indexed by position, explicit positions and attention mask so
the same forward serves prefill, decode and tree verification. Parameter names match
HF transformers, so a safetensors state dict loads as is.

A target runs one of two forwards, chosen once when it is loaded (Transformer.path):
- `cpu_kernels`: its fp32 weights on a CPU where draftsmith's kernels run (cpu_kernels/). A cached batch-1 step
  (prefill, decode, verify) is one call through the whole stack of layers where every layer fits it (`stacked`,
  decided at load), else the modules below on the kernels, which give a row the same bits in any step; other calls
  (no cache: training features; batched regeneration) run the modules on the kernels' linears and norms.
- `reference`: the modules below on torch's ops alone: SDPA, in half precision on a CPU the batch-invariant attention
  (runtime/attention.py); on a GPU the engine compiles it or captures it in CUDA graphs (serve/engine/graphs.py).
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from draftsmith.cpu_kernels import decoder_layer, decoder_stack, layer_ops, native, rope_attention
from draftsmith.cpu_kernels.layer_ops import RMSNorm
from draftsmith.cpu_kernels.packed import fused_linear

from .attention import BlockPlan, attend, make_plans
from .kv_cache import KVCache

SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3")
CPU_KERNELS, REFERENCE = "cpu_kernels", "reference"  # the target's two forwards (Transformer.path)
log = logging.getLogger(__name__)


@dataclass
class ModelConfig:
    model_type: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int = 0
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.head_dim:
            self.head_dim = self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf(cls, hf: dict) -> ModelConfig:
        """Build from an HF config.json dict; raises ValueError for architectures we do not run."""
        mtype = hf.get("model_type", "")
        if mtype not in SUPPORTED_TYPES:
            raise ValueError(
                f"unsupported architecture model_type={mtype!r}; draftsmith's runner supports "
                f"{', '.join(SUPPORTED_TYPES)}. Convert the model to one of these or pick another target."
            )
        rope = hf.get("rope_parameters") or {}
        scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        eos = hf.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            model_type=mtype,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=hf["num_attention_heads"],
            num_key_value_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=hf.get("head_dim") or 0,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=hf.get("rope_theta") or rope.get("rope_theta", 10000.0),
            rope_scaling=scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            attention_bias=mtype == "qwen2" or bool(hf.get("attention_bias")),  # Qwen2: q/k/v bias always
            qk_norm=mtype == "qwen3",
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def rope_inv_freq(cfg: ModelConfig) -> Tensor:
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    s = cfg.rope_scaling or {}
    kind = s.get("rope_type", s.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / s["factor"]
    if kind == "llama3":
        factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
        old_len = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = ((old_len / wavelen) - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        return torch.where(mid, blended, scaled)
    raise ValueError(f"unsupported rope scaling {kind!r}; supported: default, linear, llama3")


def rope_tables(cfg: ModelConfig, max_len: int) -> tuple[Tensor, Tensor]:
    """cos, sin [max_len, head_dim] for positions 0..max_len-1."""
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), rope_inv_freq(cfg))
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [b, heads, n, d]; cos/sin broadcastable to it (HF's rotate-half layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


# PyTorch's CPU flash-attention kernel is slow in bf16/fp16 for a handful of query rows (several times two
# fp32 matmuls; docs/benchmarks.md), so decode and verify steps up to SMALL_N tokens take grouped_attention;
# prefill keeps SDPA. fp32 and CUDA stay on SDPA throughout.
SMALL_N = 64


def grouped_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """GQA without repeating K/V, computed in fp32: q [b, heads, n, d], k/v [b, kv_heads, m, d],
    mask bool [1 or b, 1, n, m] (True = attend) or None: every key visible."""
    b, h, n, d = q.shape
    kv = k.shape[1]
    scores = (q.float().reshape(b, kv, h // kv * n, d) @ k.float().transpose(-1, -2)) * d**-0.5
    if mask is not None:
        visible = mask.reshape(mask.shape[0], 1, 1, n, -1)  # per row in batched decode (train/regenerate.py)
        scores = scores.view(b, kv, h // kv, n, -1).masked_fill(~visible, float("-inf"))
    probs = scores.softmax(-1).view(b, kv, h // kv * n, -1)
    return (probs @ v.float()).view(b, h, n, d).to(q.dtype)


def write_slots(cache: Tensor, slots: Tensor, new: Tensor) -> None:
    """new [b, kv_heads, n, d] into cache [b, kv_heads, max_len, d] at slots [n], the same for every row (static
    shapes, CUDA graphs), or at slots [b, n], each row its own (batched regeneration, train/batch_decode.py)."""
    new = new.to(cache.dtype)
    if slots.dim() == 1:
        cache.index_copy_(2, slots, new)
    else:
        cache.scatter_(2, slots[:, None, :, None].expand_as(new), new)


def use_grouped_attention(q: Tensor, mask: Tensor | None) -> bool:
    small = q.shape[2] == 1 or (mask is not None and mask.dtype == torch.bool and mask.shape[0] == 1)
    return small and q.shape[2] <= SMALL_N and q.dtype != torch.float32 and q.device.type == "cpu"


def invariant_path(dtype: torch.dtype, device: torch.device) -> bool:
    """Half precision on CPU takes runtime/attention.py at batch 1: row-invariant bits (lossless bf16 speculation), over
    an fp32 KV cache. fp32 keeps SDPA (its rounding differences are far below bf16's and have not flipped a greedy
    token in tests)."""
    return device.type == "cpu" and dtype in (torch.bfloat16, torch.float16)


def batch_invariant(x: Tensor) -> bool:
    return x.shape[0] == 1 and invariant_path(x.dtype, x.device)


class Attention(nn.Module):
    """GQA self-attention. in_dim: width of the input (EAGLE-3's layer attends over 2H)."""

    FUSED: ClassVar[dict[str, tuple[str, ...]]] = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj")
    }  # one GEMM once packed for inference (cpu_kernels/packed.py)

    def __init__(self, cfg: ModelConfig, in_dim: int | None = None) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h, bias = in_dim or cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(h, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qkv_proj: nn.Module | None = None

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [b, n, in_dim] -> q [b, heads, n, head_dim], k and v [b, kv_heads, n, head_dim], rope applied."""
        b, n, _ = x.shape
        h, kv, d = self.n_heads, self.n_kv, self.head_dim
        fused = fused_linear(self, "qkv_proj")
        if fused is not None and not hasattr(self, "q_norm"):  # rope q and k in one pass
            qkv = fused(x).view(b, n, h + 2 * kv, d).transpose(1, 2)
            qk = apply_rope(qkv[:, : h + kv], cos, sin)
            return qk[:, :h], qk[:, h:], qkv[:, h + kv :]
        if fused is not None:
            q, k, v = fused(x).split(fused.sizes, -1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k, v = q.view(b, n, h, d), k.view(b, n, kv, d), v.view(b, n, kv, d)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)
        k = apply_rope(k.transpose(1, 2), cos, sin)
        return q, k, v.transpose(1, 2)

    @decoder_layer.computes
    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        k_cache: Tensor | None = None,
        v_cache: Tensor | None = None,
        start: int | Tensor = 0,
        mask: Tensor | list[BlockPlan] | None = None,
    ) -> Tensor:
        """x: [b, n, in_dim]; cos/sin broadcast to [b, heads, n, head_dim]. Without a cache (training)
        the n tokens attend among themselves; with one, their KV goes to slots [start, start+n), or to the
        slots a tensor `start` names ([n], or [b, n]: each row its own), attending then over every cache slot that
        `mask` [.., n, max_len] allows.
        mask as plans (Transformer.layers_forward, CPU bf16/fp16): batch-invariant attention, same bits per row."""
        b, n, _ = x.shape
        if (out := self.kernel_step(x, cos, sin, (k_cache, v_cache), start, mask)) is not None:
            return self.o_proj(out)
        q, k, v = self.qkv(x, cos, sin)
        if k_cache is not None and v_cache is not None:
            k, v = write_cache((k_cache, v_cache), k, v, start)
        out = attention(q, k, v, mask, (k_cache, v_cache))
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))

    def kernel_step(self, x: Tensor, cos: Tensor, sin: Tensor, caches, start, mask) -> Tensor | None:
        """A drafter's fp32 CPU step on draftsmith's kernel: (q/k norms,) rope, cache write and attention in one call,
        row-invariant; None where it does not run (a target's steps run its whole stack: Transformer.path)."""
        fused = fused_linear(self, "qkv_proj")
        if fused is None or caches[0] is None or caches[1] is None or not isinstance(start, int):
            return None
        if not rope_attention.handles(x, mask) or not rope_attention.norms_fit(self):
            return None
        norms = rope_attention.qk_norms(self)
        return rope_attention.rope_attention(fused(x), cos, sin, caches, start, mask, self.n_heads, norms)


def write_cache(caches: tuple[Tensor, Tensor], k: Tensor, v: Tensor, start: int | Tensor) -> tuple[Tensor, Tensor]:
    """k, v [b, kv_heads, n, d] into the caches at slots [start, start+n), or at the slots a tensor `start` names;
    returns the keys and values to attend over (the slots up to the last written, or the whole cache for slot tensors:
    the mask says what is visible)."""
    k_cache, v_cache = caches
    if isinstance(start, Tensor):
        write_slots(k_cache, start, k)
        write_slots(v_cache, start, v)
        return k_cache, v_cache
    end = start + k.shape[2]
    k_cache[:, :, start:end] = k
    v_cache[:, :, start:end] = v
    return k_cache[:, :, :end], v_cache[:, :, :end]


def attention(q: Tensor, k: Tensor, v: Tensor, mask, caches: tuple[Tensor | None, Tensor | None]) -> Tensor:
    """q [b, heads, n, d] over k, v [b, kv_heads, m, d]: by the batch-invariant plans where mask is a list of them (they
    read the whole caches), grouped in fp32 for a few half-precision rows on a CPU, else SDPA (mask None: causal)."""
    if isinstance(mask, list):
        assert caches[0] is not None and caches[1] is not None, "plans read the cache"
        return attend(q, caches[0], caches[1], mask)
    if use_grouped_attention(q, mask):
        return grouped_attention(q, k, v, mask)
    causal = mask is None and q.shape[2] > 1  # only valid from start == 0; the caller passes a mask otherwise
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)


class MLP(nn.Module):
    FUSED: ClassVar[dict[str, tuple[str, ...]]] = {"gate_up_proj": ("gate_proj", "up_proj")}

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up_proj: nn.Module | None = None

    @decoder_layer.computes
    def forward(self, x: Tensor) -> Tensor:
        if (fused := fused_linear(self, "gate_up_proj")) is not None:
            if native.handles(x):  # fp32 CPU inference: silu(gate) * up in one call
                return self.down_proj(layer_ops.silu_mul(fused(x)))
            gate, up = fused(x).chunk(2, -1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, input_norm: bool = True) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        # EAGLE-1's layer has no input norm: its input is fc([embedding; feature]), not a residual stream
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if input_norm else nn.Identity()
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, kc: Tensor | None, vc: Tensor | None, start: int, mask
    ) -> Tensor:
        if plan := decoder_layer.step_plan(self, x, (kc, vc), start, mask):  # a drafter's fp32 CPU step: one call
            return decoder_layer.run(plan, x, (cos, sin), (kc, vc), start, mask)  # type: ignore[arg-type]
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kc, vc, start, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


@dataclass
class ForwardOut:
    logits: Tensor  # [rows, vocab], float32
    hidden: Tensor  # [n, hidden]: final normed hidden states (what the lm_head sees)
    aux: list[Tensor]  # [n, hidden] each: the residual stream entering each requested layer


class Transformer(nn.Module):
    cos: Tensor  # rope tables (rope_cache's buffers): [max_len, head_dim]
    sin: Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope_cache(cfg.max_position_embeddings)
        self.narrowed_to: torch.dtype | None = None  # set where bf16 weights run in fp32 (serve/models/loader.py)
        self.path = REFERENCE  # its forward: chosen when it is loaded (choose_path)
        self.stacked = False  # on cpu_kernels: its steps in one call through the whole stack (choose_path)

    def rope_cache(self, max_len: int) -> None:
        cos, sin = rope_tables(self.config, max_len)
        self.register_buffer("cos", cos.to(self.device), persistent=False)  # also when rebuilt on a loaded model
        self.register_buffer("sin", sin.to(self.device), persistent=False)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype it computes in."""
        return self.lm_head.weight.dtype

    @property
    def weights_dtype(self) -> torch.dtype:
        """The dtype its weights' values are: its own, or bf16 for a bf16 model run in fp32 on draftsmith's CPU
        kernels. What a run records and what separates its caches."""
        return self.narrowed_to if self.narrowed_to is not None and self.dtype == torch.float32 else self.dtype

    def new_cache(self, max_len: int) -> KVCache:
        """A batch-1 cache; in fp32 where the batch-invariant attention reads it (CPU bf16/fp16: no copy per step)."""
        c = self.config
        dtype = torch.float32 if invariant_path(self.dtype, self.device) else self.dtype
        return KVCache.allocate(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, max_len, dtype, self.device)

    def choose_path(self) -> str:
        """Choose the forward, once (where the model is loaded): cpu_kernels where draftsmith's kernels run its weights,
        each step in one call through the whole stack where every layer fits it (`stacked`), else reference. Returns
        what keeps it from the whole stack ("" where it runs it)."""
        why = self.why_not_stacked()
        self.path = CPU_KERNELS if native.runs(self.lm_head.weight) else REFERENCE
        self.stacked = not why
        return why

    def why_not_stacked(self) -> str:
        w = self.lm_head.weight
        if not native.runs(w):
            return f"draftsmith's CPU kernels do not run {w.dtype} weights on {w.device} here (cpu_kernels/native.py)"
        if decoder_stack.current(self.model.layers, DecoderLayer.forward) is None:
            return (
                "a layer does not fit the one-call stack (a hook or forward of its own, an unusual norm or bias, "
                "linears not packed): steps run module by module on the kernels"
            )
        return ""

    def stack(self) -> decoder_stack.Stack | None:
        """The layers' one-call stack, where this model runs it. A model changed since it was loaded so that it no
        longer does (a hook, a layer of another kind) runs its steps module by module on the kernels from then on, the
        same bits a row gets in any step; one moved off the CPU or to another dtype goes to the reference path. Either
        once, with a warning; choose_path() chooses again."""
        if self.path != CPU_KERNELS:
            return None
        if self.stacked and (stack := decoder_stack.current(self.model.layers, DecoderLayer.forward)) is not None:
            return stack
        moved = not native.runs(self.lm_head.weight)  # checked here only: a stacked model's watch sees a move
        if not (self.stacked or moved):
            return None
        self.stacked = False
        if moved:
            self.path = REFERENCE
        log.warning(
            "draftsmith: the model changed since it was loaded: %s; from now on it runs %s (model.choose_path() "
            "chooses again)",
            self.why_not_stacked() or "it fits again",
            "the reference forward" if self.path == REFERENCE else "its steps module by module",
        )
        return None

    def kernels(self) -> contextlib.AbstractContextManager:
        """Where this model's modules may take draftsmith's kernels: on the cpu_kernels path; never on the reference."""
        return contextlib.nullcontext() if self.path == CPU_KERNELS else native.switched_off()

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor,
        cache: KVCache,
        start: int | Tensor,
        mask: Tensor | None = None,
        logit_rows: slice | Tensor | None = None,
        target_layers: tuple[int, ...] = (),
    ) -> ForwardOut:
        """Run tokens [n] at `positions` [n], writing their KV to cache slots [start, start+n).

        mask: bool [n, start+n] (True = attend), required when n > 1 and start > 0.
        start as a tensor of n slots: the static-shape form (serve/engine/graphs.py), mask then [n, cache.max_len].
        logit_rows: which rows get logits (the lm_head is the costliest single matmul).
        target_layers: layer indices whose input residual stream to return (L = last layer's output).
        """
        attn_mask = None if mask is None else mask.view(1, 1, *mask.shape)
        stack = self.stack()
        with self.kernels():
            x, aux = self.layers_forward(tokens.unsqueeze(0), positions, cache, start, attn_mask, target_layers, stack)
            hidden = self.model.norm(x)[0]
            rows = hidden if logit_rows is None else hidden[logit_rows]
            return ForwardOut(self.lm_head(rows).float(), hidden, [a[0] for a in aux])

    def hidden_states(self, tokens: Tensor, target_layers: tuple[int, ...] = ()) -> tuple[Tensor, list[Tensor]]:
        """Training-time forward, no cache: tokens [b, n] (right-padded) -> final normed hidden [b, n, H]
        and the requested layers' inputs, causal attention from position 0."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        self.stack()  # a model changed since it was loaded leaves the cpu_kernels path here
        with self.kernels():
            x, aux = self.layers_forward(tokens, positions, None, 0, None, target_layers)
            return self.model.norm(x), aux

    def layers_forward(
        self,
        tokens: Tensor,
        positions: Tensor,
        cache: KVCache | None,
        start: int | Tensor,
        mask,
        target_layers: tuple[int, ...],
        stack: decoder_stack.Stack | None = None,
    ) -> tuple[Tensor, list[Tensor]]:
        """The layers on the model's path: a step in one call where it has its stack, else module by module."""
        x = self.model.embed_tokens(tokens)
        cos, sin = self.cos[positions].to(x.dtype), self.sin[positions].to(x.dtype)
        if stack is not None and decoder_stack.steps(x, cache, start, mask):
            assert cache is not None and isinstance(start, int), "steps() checked"
            return decoder_stack.run(stack, x, (cos, sin), cache, start, mask, target_layers)
        if cache is not None and batch_invariant(x) and isinstance(start, int):  # slot tensors keep SDPA
            c = self.config
            n = tokens.shape[1]
            mask = make_plans(mask, start, n, c.num_attention_heads // c.num_key_value_heads, x.device)
        aux = []
        for i, layer in enumerate(self.model.layers):
            if i in target_layers:
                aux.append(x)
            kc, vc = (cache.k[i], cache.v[i]) if cache is not None else (None, None)
            x = layer(x, cos, sin, kc, vc, start, mask)
        if len(self.model.layers) in target_layers:
            aux.append(x)
        return x, aux
