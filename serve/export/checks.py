"""Validate an export: reload it, check config.json, key names, shapes and dtypes against the format's table
(built from the drafter's own config, not from the exporter), then run the format's forward, written here in
plain torch from the exported tensors, against the drafter's forward on random inputs.

The functions here are the pieces every format's validator shares; each export_<kind>.py adds its own and puts
its formats together.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Generic

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor

from draftsmith.heads.drafter_folder import TOKEN_COUNTS
from draftsmith.runtime.llama import ModelConfig, rope_inv_freq
from draftsmith.serve.export.base import TOKEN_MAP, ExportError, Format, H, Source, format_for

Shapes = dict[str, tuple[int, ...]]
# max |diff| / max |drafter|: both forwards run the same rounded weights in float32, so only the order of the
# float32 operations differs (a clean export: ~3e-7). Ten sign-flipped weights or a norm scaled by 1.003 are far more.
TOLERANCE = 1e-5


# ---------------------------------------------------------------- the table: keys and shapes per format


def attn_shapes(p: str, in_dim: int, c, bias: bool) -> Shapes:
    q, kv, h = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.hidden_size
    s: Shapes = {
        f"{p}.q_proj.weight": (q, in_dim),
        f"{p}.k_proj.weight": (kv, in_dim),
        f"{p}.v_proj.weight": (kv, in_dim),
    }
    s[f"{p}.o_proj.weight"] = (h, q)
    if bias:
        s |= {f"{p}.q_proj.bias": (q,), f"{p}.k_proj.bias": (kv,), f"{p}.v_proj.bias": (kv,), f"{p}.o_proj.bias": (h,)}
    return s


def mlp_shapes(p: str, c) -> Shapes:
    h, i = c.hidden_size, c.intermediate_size
    return {f"{p}.gate_proj.weight": (i, h), f"{p}.up_proj.weight": (i, h), f"{p}.down_proj.weight": (h, i)}


# ---------------------------------------------------------------- config.json per format: keys the engines read,
# with the values the drafter implies (checked for equality)


def sizes_config(c) -> dict:
    sizes = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    return {k: getattr(c, k) for k in sizes} | {"vocab_size": c.vocab_size}


def config_problems(src: Source, f: Format, folder: Path, config: dict) -> list[str]:
    where = "GGUF metadata" if f.read_files else "config.json"
    problems = [
        f"{where} {k}={config.get(k, '<missing>')!r}, expected {v!r}"
        for k, v in f.config(src).items()
        if config.get(k) != v
    ]
    return problems + f.problems(src, folder, config)


def tokenizer_problems(src: Source, folder: Path, config: dict) -> list[str]:
    if any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
        return []
    return ["no tokenizer files (tokenizer.json / tokenizer.model)"]


def head_config_problems(src: Source, folder: Path, config: dict) -> list[str]:
    """EAGLE heads run beside the target: its positions and its rope."""
    problems = []
    need = src.target_hf.get("max_position_embeddings", 0)
    if config.get("max_position_embeddings", 0) < need:
        problems.append(
            f"config.json max_position_embeddings={config.get('max_position_embeddings')} < target's {need}"
        )
    try:
        ours, theirs = ModelConfig.from_hf(config), ModelConfig.from_hf(src.target_hf)
        if not torch.equal(rope_inv_freq(ours), rope_inv_freq(theirs)):
            problems.append("config.json rope settings differ from the target's")
    except (KeyError, ValueError) as e:
        problems.append(f"config.json does not parse as a Llama config: {e}")
    return problems


# ---------------------------------------------------------------- reloading


def read_export(folder: Path, f: Format) -> tuple[dict, dict[str, Tensor]]:
    if not (folder / "README.md").is_file():
        raise ExportError(f"export {folder} is incomplete: README.md is missing")
    if f.read_files is not None:
        return f.read_files(folder)
    path, weights = folder / "config.json", folder / f.weights
    for file in (path, weights):
        if not file.is_file():
            raise ExportError(f"export {folder} is incomplete: {file.name} is missing")
    try:
        return json.loads(path.read_text()), load_file(str(weights))
    except (json.JSONDecodeError, SafetensorError, OSError) as e:
        raise ExportError(f"export {folder} is corrupt: {e}") from e


def tensor_problems(tensors: dict[str, Tensor], want: Shapes, one_dtype: bool = True) -> list[str]:
    missing, unexpected = sorted(want.keys() - tensors.keys()), sorted(tensors.keys() - want.keys())
    problems = [f"missing key {k} {want[k]}" for k in missing] + [f"unexpected key {k}" for k in unexpected]
    problems += [
        f"{k} has shape {tuple(tensors[k].shape)}, expected {want[k]}"
        for k in sorted(want.keys() & tensors.keys())
        if tuple(tensors[k].shape) != want[k]
    ]
    floats = {t.dtype for t in tensors.values() if t.is_floating_point()}
    if len(floats) > 1 and one_dtype:
        problems.append(f"mixed floating dtypes {sorted(map(str, floats))}")
    if "d2t" in tensors and tensors["d2t"].dtype != torch.int64:
        problems.append(f"d2t is {tensors['d2t'].dtype}, expected torch.int64 offsets")
    if "t2d" in tensors and tensors["t2d"].dtype != torch.bool:
        problems.append(f"t2d is {tensors['t2d'].dtype}, expected torch.bool")
    return problems


# ---------------------------------------------------------------- the formats' forwards, from exported tensors


def rms(x: Tensor, w: Tensor, eps: float) -> Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def linear(x: Tensor, w: dict[str, Tensor], name: str) -> Tensor:
    y = x @ w[f"{name}.weight"].T
    return y + w[f"{name}.bias"] if f"{name}.bias" in w else y


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def attention(x: Tensor, w: dict[str, Tensor], p: str, cfg: ModelConfig, positions: Tensor) -> Tensor:
    """Causal GQA self-attention over x [n, in_dim] at `positions`, HF rotate-half rope."""
    n, heads, kv, d = x.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    freqs = positions.float()[:, None] * rope_inv_freq(cfg)[None]
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    q = rotate(linear(x, w, f"{p}.q_proj").view(n, heads, d).transpose(0, 1), cos, sin)
    k = rotate(linear(x, w, f"{p}.k_proj").view(n, kv, d).transpose(0, 1), cos, sin)
    v = linear(x, w, f"{p}.v_proj").view(n, kv, d).transpose(0, 1)
    k, v = k.repeat_interleave(heads // kv, 0), v.repeat_interleave(heads // kv, 0)
    scores = (q @ k.transpose(-1, -2)) * d**-0.5
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, heads * d)
    return linear(out, w, f"{p}.o_proj")


def mlp(x: Tensor, w: dict[str, Tensor], p: str) -> Tensor:
    return linear(F.silu(linear(x, w, f"{p}.gate_proj")) * linear(x, w, f"{p}.up_proj"), w, f"{p}.down_proj")


# ---------------------------------------------------------------- comparing with the drafter's own forward


def rounded_head(src: Source[H], dtype: torch.dtype) -> H:
    """A float32 copy of the drafter whose parameters carry the export's rounding (buffers such as the rope
    tables stay float32), so only the format, not the dtype, can make the two forwards differ."""
    head = copy.deepcopy(src.head).float()
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(p.to(dtype).float())
    return head


@dataclass
class Probe(Generic[H]):
    """What both forwards see: the drafter carrying the export's rounding, the exported tensors in float32, random
    inputs. Probe[Eagle3Head] in EAGLE-3's forwards, as Source."""

    head: H
    w: dict[str, Tensor]
    dtype: torch.dtype  # the exported matrices' dtype
    config: dict
    folder: Path
    g: torch.Generator
    tokens: Tensor
    positions: Tensor


def forward_pairs(src: Source, f: Format, folder: Path, w: dict[str, Tensor], config: dict) -> dict[str, tuple]:
    """name -> (export's output, drafter's output) on the same random inputs."""
    dtype = matrix_dtype(w)
    w = {k: v.float() if v.is_floating_point() else v for k, v in w.items()}
    g, n = torch.Generator().manual_seed(0), 6
    tokens = torch.randint(0, src.head.config.vocab_size, (n,), generator=g)
    with torch.no_grad():
        probe = Probe(rounded_head(src, dtype), w, dtype, config, folder, g, tokens, torch.arange(3, 3 + n))
        return f.forward(src, probe)


def matrix_dtype(w: dict[str, Tensor]) -> torch.dtype:
    """The dtype an export's weight matrices carry (a GGUF keeps its vectors in float32)."""
    floats = [t for t in w.values() if t.is_floating_point()]
    return next((t.dtype for t in floats if t.dim() > 1), floats[0].dtype)


def t2d_pair(w: dict[str, Tensor], head) -> dict[str, tuple]:
    if "t2d" not in w:
        return {}
    kept = torch.zeros_like(w["t2d"])
    kept[head.vocab_ids] = True
    return {"t2d": (w["t2d"], kept)}


def mismatch(a: Tensor, b: Tensor) -> float:
    if not a.is_floating_point():
        return 0.0 if torch.equal(a, b) else 1.0
    if a.shape != b.shape:
        return float("inf")
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()


def token_map_problems(folder: Path, src: Source, f: Format) -> list[str]:
    """SGLang's token map: there when the card passes it; distinct int64 target ids, as torch.load(weights_only=True)
    reads them; for an EAGLE drafter with training counts, the ids those counts give."""
    path = folder / TOKEN_MAP
    if not path.is_file():
        named = "--speculative-token-map" in (folder / "README.md").read_text()
        return [f"{TOKEN_MAP} is missing, but README.md passes it to --speculative-token-map"] if named else []
    try:
        ids = torch.load(path, weights_only=True)
    except Exception as e:  # whatever makes it unreadable is the problem to report
        return [f"{TOKEN_MAP} does not load with torch.load(weights_only=True): {e}"]
    vocab_size = src.head.config.vocab_size
    if not isinstance(ids, Tensor) or ids.dtype != torch.int64 or ids.dim() != 1:
        return [f"{TOKEN_MAP} must hold a 1-D int64 tensor of token ids"]
    if ids.numel() == 0 or ids.min() < 0 or ids.max() >= vocab_size or ids.unique().numel() != ids.numel():
        return [f"{TOKEN_MAP} must hold distinct token ids in [0, {vocab_size})"]
    want = f.token_map(src) if f.token_map else None
    if want is not None and not torch.equal(ids, want):
        return [f"{TOKEN_MAP} is not the {want.numel()} most frequent ids of the drafter's {TOKEN_COUNTS}: re-export"]
    return []


def check_export(folder: Path, src: Source, fmt: str) -> None:
    """Raise ExportError listing every problem with the export at `folder` in format `fmt`."""
    f = format_for(src.kind, fmt)
    config, tensors = read_export(folder, f)
    problems = config_problems(src, f, folder, config) + tensor_problems(tensors, f.shapes(src, config), f.one_dtype)
    problems += token_map_problems(folder, src, f)
    if not problems:  # the forward needs every tensor in place
        problems += f.tensor_checks(src, tensors, matrix_dtype(tensors))
        for name, (theirs, mine) in forward_pairs(src, f, folder, tensors, config).items():
            err = mismatch(theirs, mine)
            if err > TOLERANCE:
                problems.append(f"{fmt} forward differs from the drafter's: {name} off by {err:.2e} (relative)")
    if problems:
        raise ExportError(f"export {folder} ({src.kind} -> {fmt}) fails validation:\n  - " + "\n  - ".join(problems))
