"""DFlash heads out to llama.cpp: one GGUF of architecture `dflash` (llama.cpp's src/models/dflash.cpp, drafted
with --spec-type draft-dflash), keys and tensors as llama.cpp's converter writes them from a format=vllm export
(conversion/qwen.py DFlashModel), with the target GGUF's tokenizer and `tokenizer.ggml.mask_token_id`.

Checked against the vendored llama.cpp (llama-cpp-python 0.3.36), not memory:
- rope: LLM_ARCH_DFLASH ropes NEOX (halves, HF's rotate-half), so q/k rows and the q/k norms keep HF's order.
- target layers: common/speculative.cpp turns on llama_set_embeddings_layer_inp for each `dflash.target_layers` id
  and concatenates those layer inputs in that order: draftsmith's layer inputs, written as they are (the converter
  writes vLLM's target_layer_ids + 1, the same numbers).
- context: an embd batch of the target's features at the target's positions runs fc then enc.output_norm (our
  hidden_norm) and writes each layer's attn_k (attn_k_norm, then rope at the token's position) and attn_v into the
  draft's KV cache, with no attn_norm, as our write_context.
- block: [id_last, mask x n_max] at positions pos0.., tokens embedded with the target's token_embd (the draft has
  none), each layer Qwen3-style (attn_norm, attn_q/k/v, q/k norms, rope, attn_output, ffn_norm, SiLU FFN), attention
  non-causal over the cache (llama_set_causal_attn(false) unless dflash.attention.causal says true: not written).
  The mask id is llama_vocab_mask, i.e. tokenizer.ggml.mask_token_id. dflash.block_size caps n_max at block_size - 1;
  a smaller n_max runs a shorter block than the head was trained on (draftsmith and vLLM run the full block).
- output: output_norm, then `output` (the draft vocabulary's rows) scattered to target ids by `d2t` (absolute I64
  ids, -inf elsewhere); with the full vocabulary there is neither, and llama.cpp runs the target's own output, as
  vLLM does (our lm_head is then a frozen copy of it).
llama.cpp's converter maps no `d2t` for DFlashDraftModel (only its DSpark class takes d2t / t2d), so on a reduced
vocabulary it fails ("Can not map tensor 'model.d2t'"); the d2t written here is the DSpark class's, which the C++
loader reads for both.
"""

from __future__ import annotations

from typing import Any

import gguf
import torch
from torch import Tensor

from draftsmith.heads.dflash import DFlashHead
from draftsmith.heads.drafter_folder import own_state
from draftsmith.serve.export.base import Export, Format, Source
from draftsmith.serve.export.checks import Probe, Shapes, rms
from draftsmith.serve.export.export_dflash import Forward, block_pairs, dflash_shapes
from draftsmith.serve.export.ggml_ops import ggml_attend, ggml_mlp, ggml_rope
from draftsmith.serve.export.gguf_export import LAYER, gguf_files, head_gguf, llama_metadata

ARCH = "dflash"
FILE = "dflash.gguf"
MASK = "tokenizer.ggml.mask_token_id"
TOP = {
    "fc.weight": "fc.weight",
    "hidden_norm.weight": "enc.output_norm.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
# layers.{i}.<name> -> blk.{i}.<name>: a Llama layer with Qwen3's per-head q/k norms
QK_NORMS = {"self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight"}
DFLASH_LAYER = LAYER | QK_NORMS


def gguf_name(name: str) -> str:
    """A DFlash tensor's HF name -> its llama.cpp name."""
    if name.startswith("layers."):
        _, i, rest = name.split(".", 2)
        return f"blk.{i}.{DFLASH_LAYER[rest]}"
    return TOP.get(name, name)


def unsupported(src: Source[DFlashHead]) -> list[str]:
    """What llama.cpp's dflash graph has no place for."""
    c = src.head.config
    reasons = []
    if c.attention_bias:
        reasons.append("its attention has biases; llama.cpp's dflash has none")
    if c.rope_scaling:
        reasons.append(f"its rope is scaled ({c.rope_scaling}); this export writes plain rope only")
    return reasons


def dflash_metadata(
    src: Source[DFlashHead], dtype: torch.dtype, more: dict[str, Any] | None = None
) -> dict[str, gguf.GGUFValue]:
    """The converter's keys; `more` after its own (DSpark's flags come after set_gguf_parameters' DFlash keys)."""
    c = src.head.config
    tail = {f"{ARCH}.block_size": c.block_size, f"{ARCH}.target_layers": list(c.target_layers)}
    return llama_metadata(ARCH, src, c.num_layers, dtype, {}, tail | (more or {}))


def dflash_tensors(src: Source[DFlashHead]) -> dict[str, Tensor]:
    """The head's own tensors renamed; over a draft vocabulary, `output` and d2t as absolute target ids (no t2d)."""
    head = src.head
    reduced = head.config.draft_vocab_size < head.config.vocab_size
    drop = ("d2t", "t2d") if reduced else ("d2t", "t2d", "lm_head.weight")
    out = {gguf_name(k): v for k, v in own_state(head).items() if k not in drop}
    return out | ({"d2t": head.vocab_ids.long()} if reduced else {})


def dflash_gguf(src: Source[DFlashHead]) -> Export:
    """The GGUF's tensors, the target GGUF's tokenizer and the mask token; refused when llama.cpp cannot run the
    head or the target GGUF is not the drafter's target."""
    return head_gguf(src, FILE, unsupported(src), lambda: dflash_tensors(src), mask_key(src))


def mask_key(src: Source[DFlashHead]) -> dict[str, int]:
    """The tokenizer key llama.cpp reads the mask slots' token from (llama_vocab_mask)."""
    return {MASK: src.head.config.mask_token_id}


# ---------------------------------------------------------------- the validator's pieces


def gguf_shapes(src: Source[DFlashHead], config: dict) -> Shapes:
    """The table of the vllm format (built from the drafter's config), in llama.cpp's names; no t2d."""
    return {gguf_name(k): s for k, s in dflash_shapes(src, {}).items() if k != "t2d"}


def heads(h: Tensor, w: dict[str, Tensor], name: str, width: int, d: int) -> Tensor:
    """attn_<x> of h [n, H], per head: [n, width, d]."""
    return (h @ w[f"{name}.weight"].T).view(h.shape[0], width, d)


def dflash_ggml_forward(w: dict[str, Tensor], config: dict, aux: Tensor, embeds: Tensor, start: int):
    """llama.cpp's dflash decoder (src/models/dflash.cpp): the embd batch of target features at positions
    0..start-1 writes each layer's K/V (g = enc.output_norm(fc(aux)); attn_k_norm(attn_k(g)), roped; attn_v(g));
    the token batch at start.. attends non-causally to those and to itself. Returns result_norm, the logits over
    `output`'s rows (None without one: the target's output is used) and each row's target id (d2t)."""
    eps, base = config[f"{ARCH}.attention.layer_norm_rms_epsilon"], config[f"{ARCH}.rope.freq_base"]
    nh, nkv = config[f"{ARCH}.attention.head_count"], config[f"{ARCH}.attention.head_count_kv"]
    d, n = config[f"{ARCH}.attention.key_length"], embeds.shape[0]
    g = rms(aux @ w["fc.weight"].T, w["enc.output_norm.weight"], eps)
    ctx_pos, pos = torch.arange(start), torch.arange(start, start + n)

    def roped(h: Tensor, name: str, width: int, positions: Tensor) -> Tensor:  # Qcur / Kcur: norm, then rope
        return ggml_rope(rms(heads(h, w, name, width, d), w[f"{name}_norm.weight"], eps), positions, base, d, True)

    x = embeds
    for il in range(config[f"{ARCH}.block_count"]):
        b = f"blk.{il}"
        h = rms(x, w[f"{b}.attn_norm.weight"], eps)
        k = torch.cat([roped(g, f"{b}.attn_k", nkv, ctx_pos), roped(h, f"{b}.attn_k", nkv, pos)])
        v = torch.cat([heads(g, w, f"{b}.attn_v", nkv, d), heads(h, w, f"{b}.attn_v", nkv, d)])
        q = roped(h, f"{b}.attn_q", nh, pos)
        x = x + ggml_attend(q, k, v, causal=False) @ w[f"{b}.attn_output.weight"].T
        x = x + ggml_mlp(rms(x, w[f"{b}.ffn_norm.weight"], eps), w, b)
    hidden = rms(x, w["output_norm.weight"], eps)
    if "output.weight" not in w:
        return hidden, None, torch.arange(len(config["tokenizer.ggml.tokens"]))
    return hidden, hidden @ w["output.weight"].T, w["d2t"]


def gguf_forward(p: Probe[DFlashHead]) -> Forward:
    """llama.cpp's dflash graph from the GGUF's tensors as block_pairs calls it; its block holds the GGUF's mask
    token."""

    def forward(aux: Tensor, block: Tensor, start: int):
        block = torch.cat([block[:1], torch.full_like(block[1:], p.config[MASK])])
        return dflash_ggml_forward(p.w, p.config, aux, p.head.embed_tokens(block), start)

    return forward


def dflash_gguf_pairs(src: Source[DFlashHead], p: Probe[DFlashHead]) -> dict[str, tuple]:
    """name -> (llama.cpp's graph from the GGUF, the drafter's own drafting) on the same random context and
    block."""
    return block_pairs(p.head, p.g, p.tokens[0], gguf_forward(p))


# llama.cpp's dflash (non-causal block, --spec-type draft-dflash)
def block_drafts(src: Source[DFlashHead]) -> int:
    """llama.cpp's dflash block is --spec-draft-n-max + 1 slots: the head's own block needs block_size - 1."""
    return src.head.config.block_size - 1


DFLASH_GGUF = Format(
    export=dflash_gguf,
    llamacpp_depth=block_drafts,
    shapes=gguf_shapes,
    forward=dflash_gguf_pairs,
    llamacpp="draft-dflash",
    **gguf_files(ARCH, FILE, dflash_metadata, mask_key),
)
