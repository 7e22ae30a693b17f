"""EAGLE-3 heads out to llama.cpp: one GGUF of architecture `eagle3`, tensor for tensor and key for key what
llama.cpp's own converter writes (convert_hf_to_gguf.py --target-model-dir on a format=vllm export;
peers/engines_crosscheck.py compares the two files), with the target GGUF's tokenizer, which llama.cpp needs to
pair the two models.

What llama.cpp changes from the HF layout: names (midlayer.* -> blk.0.*, norm -> output_norm, lm_head -> output),
q/k rows permuted for its rope (pairs of adjacent dims, where HF rotates halves), d2t as absolute target ids.
The validator's forward below is written in llama.cpp's conventions from the GGUF's own tensors and metadata, so a
wrong permutation, name or key shows up as a forward that differs from the drafter's.
"""

from __future__ import annotations

import gguf
import torch
from torch import Tensor

from draftsmith.heads.eagle3 import Eagle3Head
from draftsmith.serve.export.base import Export, Format, Source
from draftsmith.serve.export.checks import Probe, Shapes, rms
from draftsmith.serve.export.export_eagle3 import eagle3_table
from draftsmith.serve.export.ggml_ops import ggml_attend, ggml_mlp, ggml_rope
from draftsmith.serve.export.gguf_export import LAYER, gguf_files, head_gguf, llama_metadata

ARCH = "eagle3"
FILE = "eagle3.gguf"
TOP = {
    "fc.weight": "fc.weight",
    "input_norm.weight": "enc.output_norm.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
# midlayer.<name> -> blk.0.<name>; EAGLE-3's layer reads norm(g) beside the embedding's attn_norm
NAMES = TOP | {f"midlayer.{k}": f"blk.0.{v}" for k, v in (LAYER | {"hidden_norm.weight": "attn_norm_2.weight"}).items()}


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
    if c.norm_before_residual:
        reasons.append("its residual is hidden_norm(feature) (norm_before_residual); not checked against llama.cpp")
    if c.rope_scaling:
        reasons.append(f"its rope is scaled ({c.rope_scaling}); this export writes plain rope only")
    return reasons


def permute(w: Tensor, heads: int) -> Tensor:
    """HF's q/k rows (rotate-half rope) -> llama.cpp's (adjacent pairs), per head: llama.cpp's converter's permute."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def eagle3_metadata(src: Source[Eagle3Head], dtype: torch.dtype) -> dict[str, gguf.GGUFValue]:
    c = src.head.config
    lead = {
        f"{ARCH}.target_layers": list(c.target_layers),
        f"{ARCH}.target_hidden_size": c.hidden_size,
        f"{ARCH}.norm_before_residual": False,
        f"{ARCH}.norm_before_fc": bool(c.norm_before_fc),
    }
    tail = {f"{ARCH}.vocab_size": c.vocab_size, f"{ARCH}.rope.dimension_count": c.head_dim}
    return llama_metadata(ARCH, src, 1, dtype, lead, tail)


def eagle3_tensors(src: Source[Eagle3Head]) -> dict[str, Tensor]:
    c, state = src.head.config, src.head.state_dict()
    out = {NAMES[k]: state[k] for k in NAMES if k in state}
    out["blk.0.attn_q.weight"] = permute(out["blk.0.attn_q.weight"], c.num_attention_heads)
    out["blk.0.attn_k.weight"] = permute(out["blk.0.attn_k.weight"], c.num_key_value_heads)
    if c.draft_vocab_size < c.vocab_size:
        out["d2t"] = src.head.vocab_ids.long()  # absolute target ids, as llama.cpp reads them
    return out


def eagle3_gguf(src: Source[Eagle3Head]) -> Export:
    """The GGUF's tensors and the target GGUF's tokenizer; refused when llama.cpp cannot run the head or the target
    GGUF is not the drafter's target."""
    return head_gguf(src, FILE, unsupported(src), lambda: eagle3_tensors(src), {})


# ---------------------------------------------------------------- the validator's pieces


def gguf_shapes(src: Source[Eagle3Head], config: dict) -> Shapes:
    table = eagle3_table(src.head.config, False)
    shapes = {NAMES[k]: s for k, s in table.items() if k in NAMES}
    return shapes | ({"d2t": table["d2t"]} if "d2t" in table else {})


def ggml_attention(x: Tensor, w: dict[str, Tensor], config: dict, positions: Tensor) -> Tensor:
    heads, kv = config[f"{ARCH}.attention.head_count"], config[f"{ARCH}.attention.head_count_kv"]
    d, base = config[f"{ARCH}.attention.key_length"], config[f"{ARCH}.rope.freq_base"]
    n = x.shape[0]
    q = ggml_rope((x @ w["blk.0.attn_q.weight"].T).view(n, heads, d), positions, base, d)
    k = ggml_rope((x @ w["blk.0.attn_k.weight"].T).view(n, kv, d), positions, base, d)
    v = (x @ w["blk.0.attn_v.weight"].T).view(n, kv, d)
    return ggml_attend(q, k, v, causal=True) @ w["blk.0.attn_output.weight"].T


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
    c, n, head = src.head.config, p.tokens.numel(), p.head
    aux = torch.randn(n, len(c.target_layers) * c.hidden_size, generator=p.g)
    embeds = head.embed_tokens(p.tokens)
    h, logits, ids = eagle3_ggml_forward(p.w, p.config, embeds, aux, p.positions)
    mine = head(head.target_features(None, aux[None]), p.tokens[None], p.positions)[0]
    return {"feature": (h, mine), "logits": (logits, head.logits(mine)), "target ids": (ids, head.vocab_ids)}


EAGLE3_GGUF = Format(
    export=eagle3_gguf,
    shapes=gguf_shapes,
    forward=eagle3_gguf_pairs,
    llamacpp="draft-eagle3",
    **gguf_files(ARCH, FILE, eagle3_metadata),
)
