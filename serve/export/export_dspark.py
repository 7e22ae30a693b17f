"""DSpark export: vLLM's native `dspark` layout (Qwen3DSparkModel), and its validator.

Checked against vLLM 0.32's loader, not memory (model_executor/models/qwen3_dspark.py, config/speculative.py,
v1/worker/gpu/spec_decode/dspark/speculator.py and dflash/speculator.py, eagle/eagle3_utils.py):
- the backbone is DFlash's, written as export_dflash.py writes it (vLLM's Qwen3DSparkModel extends its
  DFlashQwen3Model): Qwen3 config, dflash_config {mask_token_id, target_layer_ids one lower, block_size}, fc,
  hidden_norm, layers.{i}.*, norm, lm_head + d2t over a draft vocabulary (t2d skipped).
- `architectures: ["Qwen3DSparkModel"]` (vLLM also takes DSparkDraftModel with model_type qwen3 and renames it);
  the config is not wrapped in EAGLEConfig for dspark, so every key is read from the top level: `block_size`
  (the default num_speculative_tokens), `sample_from_anchor: true` (the speculator's block is [anchor, mask x
  (N-1)], every slot sampled: as trained; false runs DFlash's 1 + N fill-in block, and vLLM refuses it inside
  dflash_config), `markov_rank`, `enable_confidence_head` and `confidence_head_with_markov` (vLLM's default is
  false, ours true).
- markov_head.markov_w1 [target vocab, r], markov_head.markov_w2 [draft vocab, r] (no bias), confidence_head.proj
  weight [1, H (+ r)] and bias [1]. vLLM's Qwen3 DSpark has no gate_proj / joint_proj: gated and rnn heads are
  refused, as its loader would refuse their tensors.
The speculator, greedy: base logits of every slot's normed output, then left to right from the anchor,
logits_k + W2 W1[prev], argmax, prev = its target id (d2t); the confidence head reads [h_k; W1[prev_k]] and is
used only with enable_adaptive_verification.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from draftsmith.heads.dspark import DSparkHead
from draftsmith.runtime.llama import ModelConfig
from draftsmith.serve.engine.sampling import SamplingParams
from draftsmith.serve.export.base import Export, ExportError, Format, Source
from draftsmith.serve.export.checks import Probe, linear
from draftsmith.serve.export.export_dflash import (
    KEYS_READ,
    backbone_config,
    dflash_forward,
    dflash_problems,
    dflash_shapes,
    drafted_block,
    vllm_state,
)
from draftsmith.serve.proposers.propose_dspark import DSparkProposer

MARKOV = "markov_head.markov_w"
CONFIDENCE = "confidence_head.proj"


def dspark_vllm(src: Source[DSparkHead]) -> Export:
    c = src.head.config
    if c.markov_type != "vanilla":
        raise ExportError(
            f"format=vllm cannot hold {src.folder}: its markov_type={c.markov_type}, and vLLM 0.32's dspark model "
            "(Qwen3DSparkModel) runs the vanilla Markov head only; retrain with head.args.markov_type=vanilla"
        )
    return Export(expected_config(src), {"model.safetensors": vllm_state(src)})


def expected_config(src: Source[DSparkHead]) -> dict:
    c = src.head.config
    return backbone_config(src, "Qwen3DSparkModel") | {
        "sample_from_anchor": True,
        "markov_rank": c.markov_rank,
        "markov_head_type": c.markov_type,
        "enable_confidence_head": True,
        "confidence_head_with_markov": c.confidence_with_markov,
    }


def dspark_shapes(src: Source[DSparkHead], config: dict) -> dict[str, tuple[int, ...]]:
    c = src.head.config
    r, width = c.markov_rank, c.hidden_size + (c.markov_rank if c.confidence_with_markov else 0)
    heads = {f"{MARKOV}1.weight": (c.vocab_size, r), f"{MARKOV}2.weight": (c.draft_vocab_size, r)}
    return dflash_shapes(src, config) | heads | {f"{CONFIDENCE}.weight": (1, width), f"{CONFIDENCE}.bias": (1,)}


HEADS_READ = ("sample_from_anchor", "markov_rank", "markov_head_type", "enable_confidence_head")
KEYS = (*KEYS_READ, "block_size", *HEADS_READ, "confidence_head_with_markov")  # what vLLM's dspark path reads


def dspark_config(src: Source[DSparkHead]) -> dict:
    """The config.json keys vLLM's dspark path reads, with the values the drafter implies."""
    return {k: v for k, v in expected_config(src).items() if k in KEYS}


def dspark_problems(src: Source[DSparkHead], folder: Path, config: dict) -> list[str]:
    problems = dflash_problems(src, folder, config)
    if "sample_from_anchor" in config.get("dflash_config", {}):
        problems.append("config.json sets dflash_config.sample_from_anchor: vLLM's DFlash base refuses it there")
    if "dspark_draft_topk" in config:
        problems.append("config.json sets dspark_draft_topk: vLLM then adds the Markov bias to the top-k logits only")
    return problems


# ---------------------------------------------------------------- vLLM's DSpark draft, from exported tensors


def speculator_block(config: dict, first: Tensor) -> tuple[Tensor, slice]:
    """The block vLLM's speculator runs from the anchor `first` at num_speculative_tokens = block_size, and the
    rows it samples: anchor-first [first, mask x (N-1)], every row; else the fill-in [first, mask x N], the masks."""
    n, mask = config["block_size"], config["dflash_config"]["mask_token_id"]
    anchored = config.get("sample_from_anchor", True)  # vLLM's default
    block = torch.cat([first[None], torch.full((n - 1 if anchored else n,), mask)])
    return block, slice(0 if anchored else 1, None)


def markov_chain(
    w: dict[str, Tensor], config: dict, hidden: Tensor, logits: Tensor, ids: Tensor, first: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """DSparkSpeculator._sample_sequential, greedy, and compute_confidence: from the anchor, slot k's logits plus
    W2 W1[prev], its argmax's target id the next prev. Returns (target ids [N], corrected logits [N, Vd],
    confidences [N])."""
    prev, tokens, rows, embeds = first, [], [], []
    for k in range(hidden.shape[0]):
        embeds.append(w[f"{MARKOV}1.weight"][prev])
        rows.append(logits[k] + embeds[-1] @ w[f"{MARKOV}2.weight"].T)
        prev = ids[rows[-1].argmax()]
        tokens.append(prev)
    with_markov = config.get("confidence_head_with_markov", False)  # vLLM's default
    features = torch.cat([hidden, torch.stack(embeds)], -1) if with_markov else hidden
    confidence = torch.sigmoid(linear(features, w, CONFIDENCE)).squeeze(-1)
    return torch.stack(tokens), torch.stack(rows), confidence


def own_chain(head: DSparkHead, aux: Tensor, first: Tensor, start: int) -> tuple[Tensor, Tensor, Tensor]:
    """DSparkProposer's greedy chain of the whole block after the context aux [start, k*H]: (drafts, each slot's
    corrected logits [B, Vd], its confidence)."""
    prop = DSparkProposer(head, head.config.block_size)
    prop.reserve(start + 1)
    assert prop.cache is not None
    head.write_context(head.target_features(None, aux), torch.arange(start), prop.cache, 0)
    prop.cached = start
    prop.draft_block(first)
    tokens = torch.cat([torch.zeros(start, dtype=torch.long), first[None]])
    tree = prop.draft(tokens, SamplingParams(), head.config.block_size)  # the block drafted above, as propose would
    prevs = torch.cat([first[None], tree.tokens[:-1]])
    rows = torch.stack([prop.slot(k, prev, None)[0] for k, prev in enumerate(prevs)])
    assert tree.accept_probs is not None
    return tree.tokens, rows, tree.accept_probs


def dspark_pairs(src: Source[DSparkHead], p: Probe[DSparkHead]) -> dict[str, tuple]:
    """name -> (vLLM's draft from the export, the drafter's own) on the same random context and anchor."""
    head, first = p.head, p.tokens[0]
    cfg = ModelConfig.from_hf(p.config | {"model_type": "qwen3"})
    aux, start, out = drafted_block(head, p.g, first)
    block, sampled = speculator_block(p.config, first)
    hidden, logits, ids = dflash_forward(p.w, cfg, aux, head.embed_tokens(block), start)
    if logits is None:  # the full vocabulary: vLLM shares the target's lm_head, of which the drafter holds a copy
        logits = hidden @ head.lm_head.weight.T
    hidden, logits = hidden[sampled], logits[sampled]
    theirs, mine = markov_chain(p.w, p.config, hidden, logits, ids, first), own_chain(head, aux, first, start)
    pairs = {"hidden": (hidden, head.normed(out)), "target ids": (ids, head.vocab_ids)}
    # the chain reads a few rows of W1; vLLM may read any: every target id's Markov embedding
    every = torch.arange(head.config.vocab_size)
    pairs["markov embeddings"] = (p.w[f"{MARKOV}1.weight"], head.markov_head.embed(every))
    names = ("draft tokens", "logits", "confidence")
    return pairs | {name: (a, b) for name, a, b in zip(names, theirs, mine, strict=True)}


def dspark_depth(src: Source[DSparkHead]) -> int:
    """vLLM's DSpark block is num_speculative_tokens slots: the head's whole block, as trained."""
    return src.head.config.block_size


# vLLM's Qwen3DSparkModel (anchor-first block, vanilla Markov head, confidence head)
DSPARK_VLLM = Format(
    export=dspark_vllm,
    shapes=dspark_shapes,
    config=dspark_config,
    forward=dspark_pairs,
    problems=dspark_problems,
    vllm="dspark",
    vllm_depth=dspark_depth,
    vllm_variants=(
        (
            "Verifying only the drafts the confidence head says pay (vLLM's adaptive verification; it profiles the "
            "step costs under full CUDA graphs, so a GPU)",
            (("enable_adaptive_verification", True),),
        ),
    ),
)
