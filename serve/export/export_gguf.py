"""EAGLE-3 heads out to llama.cpp: one GGUF of architecture `eagle3`, tensor for tensor and key for key what
llama.cpp's own converter writes (convert_hf_to_gguf.py --target-model-dir on a format=vllm export;
scripts/engines_crosscheck.py compares the two files), with the target GGUF's tokenizer, which llama.cpp needs to
pair the two models.

What llama.cpp changes from the HF layout: names (midlayer.* -> blk.0.*, norm -> output_norm, lm_head -> output),
q/k rows permuted for its rope (pairs of adjacent dims, where HF rotates halves), d2t as absolute target ids.
The validator's forward below is written in llama.cpp's conventions from the GGUF's own tensors and metadata, so a
wrong permutation, name or key shows up as a forward that differs from the drafter's.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from torch import Tensor

from draftsmith.heads.eagle3 import Eagle3Head
from draftsmith.serve.export.base import Export, ExportError, Format, Source
from draftsmith.serve.export.checks import Probe, Shapes, mlp, rms
from draftsmith.serve.export.export_eagle3 import eagle3_table
from draftsmith.serve.export.gguf_file import FILE_TYPES, gguf_value, plain, read_gguf, write_gguf
from draftsmith.serve.export.gguf_target import check_target_gguf

ARCH = "eagle3"
FILE = "eagle3.gguf"
LAYER = {  # midlayer.<name> -> blk.0.<name>
    "input_layernorm.weight": "attn_norm.weight",
    "hidden_norm.weight": "attn_norm_2.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
TOP = {
    "fc.weight": "fc.weight",
    "input_norm.weight": "enc.output_norm.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
NAMES = TOP | {f"midlayer.{k}": f"blk.0.{v}" for k, v in LAYER.items()}


def f32(x: float) -> float:
    """A float as GGUF stores it (float32), so the validator compares what llama.cpp reads."""
    return float(np.float32(x))


def unsupported(src: Source[Eagle3Head]) -> list[str]:
    """What llama.cpp's eagle3 graph has no place for."""
    c = src.head.config
    reasons = []
    if len(c.target_layers) != 3:
        reasons.append(f"it reads {len(c.target_layers)} target layers; llama.cpp's eagle3 reads exactly 3")
    if c.attention_bias:
        reasons.append("its attention has biases; llama.cpp's eagle3 has none")
    if c.norm_output:
        reasons.append("it feeds back norm(output) (norm_output, EAGLE-3.1); llama.cpp feeds back the output")
    if c.rope_scaling:
        reasons.append(f"its rope is scaled ({c.rope_scaling}); this export writes plain rope only")
    return reasons


def permute(w: Tensor, heads: int) -> Tensor:
    """HF's q/k rows (rotate-half rope) -> llama.cpp's (adjacent pairs), per head: llama.cpp's converter's permute."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def eagle3_metadata(src: Source[Eagle3Head], dtype: torch.dtype) -> dict[str, gguf.GGUFValue]:
    """The keys llama.cpp's converter writes for an EAGLE-3 head, in its order (the tokenizer's come after)."""
    c, t = src.head.config, src.target_hf
    keys: dict = {
        f"{ARCH}.target_layers": list(c.target_layers),
        f"{ARCH}.target_hidden_size": c.hidden_size,
        f"{ARCH}.norm_before_residual": False,
        f"{ARCH}.norm_before_fc": bool(c.norm_before_fc),
        "general.type": "model",
        "general.name": f"{src.meta['target']['id']} eagle3 drafter",
        f"{ARCH}.block_count": 1,
        f"{ARCH}.context_length": max(c.max_position_embeddings, t.get("max_position_embeddings", 0)),
        f"{ARCH}.embedding_length": c.hidden_size,
        f"{ARCH}.feed_forward_length": c.intermediate_size,
        f"{ARCH}.attention.head_count": c.num_attention_heads,
        f"{ARCH}.attention.head_count_kv": c.num_key_value_heads,
        f"{ARCH}.rope.freq_base": f32(c.rope_theta),
        f"{ARCH}.attention.layer_norm_rms_epsilon": f32(c.rms_norm_eps),
        f"{ARCH}.attention.key_length": c.head_dim,
        f"{ARCH}.attention.value_length": c.head_dim,
        "general.file_type": FILE_TYPES[dtype],
        f"{ARCH}.vocab_size": c.vocab_size,
        f"{ARCH}.rope.dimension_count": c.head_dim,
        "general.quantization_version": 2,
    }
    return {k: gguf_value(v) for k, v in keys.items()}


def eagle3_tensors(src: Source[Eagle3Head]) -> dict[str, Tensor]:
    c, state = src.head.config, src.head.state_dict()
    out = {NAMES[k]: state[k] for k in NAMES if k in state}
    out["blk.0.attn_q.weight"] = permute(out["blk.0.attn_q.weight"], c.num_attention_heads)
    out["blk.0.attn_k.weight"] = permute(out["blk.0.attn_k.weight"], c.num_key_value_heads)
    if c.draft_vocab_size < c.vocab_size:
        out["d2t"] = src.head.vocab_ids.long()  # absolute target ids, as llama.cpp reads them
    return out


def tokenizer_keys(meta: dict[str, gguf.GGUFValue]) -> dict[str, gguf.GGUFValue]:
    return {k: v for k, v in meta.items() if k.startswith("tokenizer.")}


def eagle3_gguf(src: Source[Eagle3Head]) -> Export:
    """The GGUF's metadata (with the target GGUF's tokenizer) and tensors; refused when llama.cpp cannot run the
    head or the target GGUF is not the drafter's target."""
    reasons = unsupported(src)
    if reasons:
        raise ExportError(f"llama.cpp cannot run {src.folder} as an eagle3 draft: " + "; ".join(reasons))
    target = check_target_gguf(src.target_gguf, src.target_dir, src.target_hf)
    return Export(tokenizer_keys(target), {FILE: eagle3_tensors(src)})


def write_eagle3_gguf(exp: Export, src: Source[Eagle3Head], dtype: torch.dtype, folder: Path) -> None:
    metadata = eagle3_metadata(src, dtype) | exp.config
    write_gguf(folder / FILE, ARCH, metadata, exp.tensors[FILE], dtype)


def read_eagle3_gguf(folder: Path) -> tuple[dict, dict[str, Tensor]]:
    path = folder / FILE
    if not path.is_file():
        raise ExportError(f"export {folder} is incomplete: {FILE} is missing")
    try:
        meta, tensors = read_gguf(path)
    except ValueError as e:
        raise ExportError(f"export {folder} is corrupt: {e}") from e
    return plain(meta), tensors


# ---------------------------------------------------------------- the validator's pieces


def gguf_shapes(src: Source[Eagle3Head], config: dict) -> Shapes:
    table = eagle3_table(src.head.config, False)
    shapes = {NAMES[k]: s for k, s in table.items() if k in NAMES}
    return shapes | ({"d2t": table["d2t"]} if "d2t" in table else {})


def gguf_config(src: Source[Eagle3Head]) -> dict:
    return {"general.architecture": ARCH} | {
        k: v.value for k, v in eagle3_metadata(src, torch.float32).items() if k != "general.file_type"
    }


def gguf_problems(src: Source, folder: Path, config: dict) -> list[str]:
    """No architecture key the drafter does not imply (llama.cpp would read it); the tokenizer is the target
    GGUF's, key for key (llama.cpp pairs draft and target by vocabulary)."""
    expected = gguf_config(src)
    problems = [
        f"unexpected GGUF metadata {k}" for k in sorted(config) if k.startswith(f"{ARCH}.") and k not in expected
    ]
    try:
        target = check_target_gguf(src.target_gguf, src.target_dir, src.target_hf)
    except ExportError as e:
        return problems + [str(e)]
    want = plain(tokenizer_keys(target))
    ours = {k: v for k, v in config.items() if k.startswith("tokenizer.")}
    keys = sorted(want.keys() | ours.keys())
    return problems + [f"{k} differs from the target GGUF's" for k in keys if want.get(k) != ours.get(k)]


def ggml_rope(x: Tensor, positions: Tensor, base: float, dims: int) -> Tensor:
    """llama.cpp's rope (LLAMA_ROPE_TYPE_NORM): adjacent pairs (2i, 2i+1) turned by pos * base^(-2i/dims)."""
    theta = positions.float()[:, None, None] * base ** (-torch.arange(0, dims, 2).float() / dims)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x0 * theta.cos() - x1 * theta.sin(), x0 * theta.sin() + x1 * theta.cos()), -1).flatten(-2)


def ggml_attention(x: Tensor, w: dict[str, Tensor], config: dict, positions: Tensor) -> Tensor:
    heads, kv = config[f"{ARCH}.attention.head_count"], config[f"{ARCH}.attention.head_count_kv"]
    d, base = config[f"{ARCH}.attention.key_length"], config[f"{ARCH}.rope.freq_base"]
    n = x.shape[0]
    q = ggml_rope((x @ w["blk.0.attn_q.weight"].T).view(n, heads, d), positions, base, d).transpose(0, 1)
    k = ggml_rope((x @ w["blk.0.attn_k.weight"].T).view(n, kv, d), positions, base, d).transpose(0, 1)
    v = (x @ w["blk.0.attn_v.weight"].T).view(n, kv, d).transpose(0, 1)
    k, v = k.repeat_interleave(heads // kv, 0), v.repeat_interleave(heads // kv, 0)
    scores = (q @ k.transpose(-1, -2)) / d**0.5
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, heads * d) @ w["blk.0.attn_output.weight"].T


def ggml_mlp(x: Tensor, w: dict[str, Tensor]) -> Tensor:
    names = {"gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    return mlp(x, {f"m.{k}.weight": w[f"blk.0.{v}.weight"] for k, v in names.items()}, "m")


def eagle3_ggml_forward(w: dict[str, Tensor], config: dict, embeds: Tensor, aux: Tensor, positions: Tensor):
    """llama.cpp's eagle3 encoder then decoder (src/models/eagle3.cpp): g = fc(aux); [attn_norm(embed);
    attn_norm_2(g)] -> attention, residual g; the MLP; logits = output(output_norm(h)); draft id -> d2t[id]."""
    eps = config[f"{ARCH}.attention.layer_norm_rms_epsilon"]
    if config.get(f"{ARCH}.norm_before_fc"):
        aux = rms(aux, w["enc.output_norm.weight"], eps)
    g = aux @ w["fc.weight"].T
    x = torch.cat([rms(embeds, w["blk.0.attn_norm.weight"], eps), rms(g, w["blk.0.attn_norm_2.weight"], eps)], -1)
    h = g + ggml_attention(x, w, config, positions)
    h = h + ggml_mlp(rms(h, w["blk.0.ffn_norm.weight"], eps), w)
    logits = rms(h, w["output_norm.weight"], eps) @ w["output.weight"].T
    ids = w.get("d2t", torch.arange(logits.shape[-1]))
    return h, logits, ids


def eagle3_gguf_pairs(src: Source[Eagle3Head], p: Probe[Eagle3Head]) -> dict[str, tuple]:
    c, n = src.head.config, p.tokens.numel()
    head = p.head
    aux = torch.randn(n, len(c.target_layers) * c.hidden_size, generator=p.g)
    embeds = head.embed_tokens(p.tokens)
    h, logits, ids = eagle3_ggml_forward(p.w, p.config, embeds, aux, p.positions)
    mine = head(head.target_features(None, aux[None]), p.tokens[None], p.positions)[0]
    return {"feature": (h, mine), "logits": (logits, head.logits(mine)), "target ids": (ids, head.vocab_ids)}


EAGLE3_GGUF = Format(
    export=eagle3_gguf,
    shapes=gguf_shapes,
    config=gguf_config,
    forward=eagle3_gguf_pairs,
    problems=gguf_problems,
    weights=FILE,
    torch_dtype=False,
    write_files=write_eagle3_gguf,
    read_files=read_eagle3_gguf,
    one_dtype=False,
    llamacpp="draft-eagle3",
)
