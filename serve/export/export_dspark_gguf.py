"""DSpark heads out to llama.cpp: DFlash's `dflash` GGUF (export_dflash_gguf.py: backbone, keys, tokenizer, mask
token) plus the Markov and confidence heads, as llama.cpp's converter writes them from a DSpark checkpoint
(conversion/qwen.py DSparkModel) and its `--spec-type draft-dspark` runs them.

Checked against the vendored llama.cpp (llama-cpp-python 0.3.36), not memory:
- tensors (src/llama-arch.cpp, gguf-py tensor_mapping): markov_w1.weight (torch [vocab, r]: get_rows by target
  id), markov_w2.weight ([draft vocab, r]), conf_proj.weight ([1, H + r]) and conf_proj.bias ([1]);
  src/models/dflash.cpp loads the Markov pair whenever markov_w1 is there (that also makes common/speculative.cpp
  detect draft-dspark), the confidence pair as optional, and no gate / joint projection: only the vanilla head.
- keys: the converter's DFlash keys, then `dflash.sample_from_anchor` (true: the block [id_last, mask x (n-1)]
  drafts n tokens, slot 0 the first, as ours) and `dflash.has_confidence_head`; missing, both read as true.
- graph (build_dspark_markov_head): after result_norm and `output` (scattered to target ids by d2t, -inf
  elsewhere), slot i adds W2 W1[prev] (scattered by d2t, 0 elsewhere) with prev the block's first token, then the
  argmax of the slot before, and conf(i) = sigmoid(conf_proj [result_norm_i ; W1[prev]] + b), which
  --spec-draft-p-min truncates the draft at. The chain is greedy in the graph whatever the sampling (a TODO there).
- n-max: speculative.cpp runs n-max slots and clamps n-max to block_size; the card asks for the whole block.
A head whose confidence head reads h_k alone (confidence_with_markov=false) goes out with zero W1 columns: the same
function in the one layout llama.cpp loads.
"""

from __future__ import annotations

from typing import Any

import gguf
import torch
from torch import Tensor

from draftsmith.heads.dspark import DSparkHead
from draftsmith.serve.export.base import Export, Format, Source
from draftsmith.serve.export.checks import Probe
from draftsmith.serve.export.export_dflash import block_pairs
from draftsmith.serve.export.export_dflash_gguf import (
    ARCH,
    dflash_metadata,
    dflash_tensors,
    gguf_forward,
    gguf_shapes,
    mask_key,
    unsupported,
)
from draftsmith.serve.export.export_dspark import own_chain
from draftsmith.serve.export.gguf_export import gguf_files, head_gguf

FILE = "dspark.gguf"
SEQUENTIAL = ("markov_head.", "confidence_head.")  # the head's own tensors beyond DFlash's


def dspark_unsupported(src: Source[DSparkHead]) -> list[str]:
    """DFlash's reasons, and a sequential head llama.cpp's graph does not compute."""
    kind = src.head.config.markov_type
    if kind == "vanilla":
        return unsupported(src)
    return unsupported(src) + [
        f"its Markov head is {kind!r}; llama.cpp's DSpark graph computes the vanilla head W2 W1[x] only (no "
        "gate_proj / joint_proj): train with head.args.markov_type=vanilla"
    ]


def dspark_metadata(src: Source[DSparkHead], dtype: torch.dtype) -> dict[str, gguf.GGUFValue]:
    flags: dict[str, Any] = {f"{ARCH}.sample_from_anchor": True, f"{ARCH}.has_confidence_head": True}
    return dflash_metadata(src, dtype, flags)


def confidence_weight(head: DSparkHead) -> Tensor:
    """conf_proj [1, H + r]: a head reading h_k alone gets zero columns for W1[x]."""
    w = head.confidence_head.proj.weight
    if head.config.confidence_with_markov:
        return w
    return torch.cat([w, w.new_zeros(1, head.config.markov_rank)], dim=1)


def dspark_tensors(src: Source[DSparkHead]) -> dict[str, Tensor]:
    """DFlash's tensors (the sequential heads' pass through its renaming and are replaced) and llama.cpp's four."""
    head = src.head
    backbone = {k: v for k, v in dflash_tensors(src).items() if not k.startswith(SEQUENTIAL)}
    return backbone | {
        "markov_w1.weight": head.markov_head.markov_w1.weight,
        "markov_w2.weight": head.markov_head.markov_w2.weight,
        "conf_proj.weight": confidence_weight(head),
        "conf_proj.bias": head.confidence_head.proj.bias,
    }


def dspark_gguf(src: Source[DSparkHead]) -> Export:
    return head_gguf(src, FILE, dspark_unsupported(src), lambda: dspark_tensors(src), mask_key(src))


# ---------------------------------------------------------------- the validator's pieces


def dspark_shapes(src: Source[DSparkHead], config: dict) -> dict[str, tuple[int, ...]]:
    c = src.head.config
    h, r = c.hidden_size, c.markov_rank
    markov = {"markov_w1.weight": (c.vocab_size, r), "markov_w2.weight": (c.draft_vocab_size, r)}
    return gguf_shapes(src, config) | markov | {"conf_proj.weight": (1, h + r), "conf_proj.bias": (1,)}


def ggml_markov_chain(w: dict[str, Tensor], hidden: Tensor, base: Tensor, d2t: Tensor, first: Tensor):
    """build_dspark_markov_head: base [B, vocab] (-inf off d2t), hidden = result_norm [B, H]; each slot adds the
    bias of the token before it and drafts its argmax. Returns (drafts, each slot's logits at d2t, confidences)."""
    prev, drafts, rows, conf = first, [], [], []
    for i in range(base.shape[0]):
        e = w["markov_w1.weight"][prev]
        bias = torch.zeros(base.shape[1]).index_copy(0, d2t, w["markov_w2.weight"] @ e)
        col = base[i] + bias
        feat = torch.cat([hidden[i], e])
        conf.append(torch.sigmoid(w["conf_proj.weight"] @ feat + w["conf_proj.bias"])[0])
        rows.append(col[d2t])
        prev = col.argmax()
        drafts.append(prev)
    return torch.stack(drafts), torch.stack(rows), torch.stack(conf)


def scattered(logits: Tensor, d2t: Tensor, vocab: int) -> Tensor:
    """result_output: draft-vocabulary logits [B, Vd] at their target ids, -inf elsewhere."""
    return torch.full((logits.shape[0], vocab), float("-inf")).index_copy(1, d2t, logits)


def dspark_gguf_pairs(src: Source[DSparkHead], p: Probe[DSparkHead]) -> dict[str, tuple]:
    """DFlash's pairs (backbone, target ids, base logits), then llama.cpp's Markov chain and confidences against
    the proposer's on the same context and block. Over the full vocabulary llama.cpp reads the target's output,
    which the head's frozen lm_head copies."""
    head, backbone = p.head, gguf_forward(p)
    seen: dict[str, Any] = {}  # what llama.cpp's forward saw and drafted

    def forward(aux: Tensor, block: Tensor, start: int):
        hidden, logits, d2t = backbone(aux, block, start)
        base = scattered(hidden @ head.lm_head.weight.T if logits is None else logits, d2t, head.config.vocab_size)
        seen.update(aux=aux, start=start, chain=ggml_markov_chain(p.w, hidden, base, d2t, block[0]))
        return hidden, logits, d2t

    pairs = block_pairs(head, p.g, p.tokens[0], forward)
    mine = own_chain(head, seen["aux"], p.tokens[0], seen["start"])
    names = ("markov drafts", "markov logits", "confidence")
    return pairs | {name: (theirs, ours) for name, theirs, ours in zip(names, seen["chain"], mine, strict=True)}


DSPARK_GGUF = Format(
    export=dspark_gguf,
    llamacpp_depth=lambda src: src.head.config.block_size,  # anchor-first: n-max slots draft n-max tokens
    shapes=dspark_shapes,
    forward=dspark_gguf_pairs,
    llamacpp="draft-dspark",
    llamacpp_note=(
        "`--spec-draft-p-min P` ends each draft at the first token whose confidence head is below P (0, the "
        "default, drafts the whole block, as the commands above). llama.cpp drafts the Markov chain greedily "
        "whatever the sampling; draftsmith samples it at temperature > 0."
    ),
    **gguf_files(ARCH, FILE, dspark_metadata, mask_key),
)
