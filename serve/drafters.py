"""Load the drafter a spec names: a draftsmith drafter folder, an EAGLE-3 head made elsewhere, or a draft LM, each
refused unless it was made for (or speaks the vocabulary of) the loaded target."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from draftsmith.cpu_kernels import native
from draftsmith.cpu_kernels.packed import can_pack, pack_linears
from draftsmith.heads.drafter_folder import (
    DRAFTER_HOLDS,
    TargetInfo,
    cast_own,
    frequent_ids,
    gguf_export,
    load_token_counts,
    not_a_drafter,
    read_drafter,
    read_meta,
)
from draftsmith.heads.kinds import by_spec, get
from draftsmith.runtime.llama import Transformer
from draftsmith.serve.export.external_heads import (
    EXTERNAL_KIND,
    TARGET_ARCHS,
    external_format,
    external_head,
    read_external,
)
from draftsmith.serve.models.loader import fp32_arithmetic, load_model, read_hf_config
from draftsmith.serve.models.target import LoadedTarget, load_tokenizer, torch_dtype
from draftsmith.serve.spec import SpecConfig


def target_info(target: LoadedTarget) -> TargetInfo:
    c = target.model.config
    return TargetInfo(target.target_id, c.hidden_size, c.vocab_size, c.num_hidden_layers)


def drafter_dtype(spec: SpecConfig, target: LoadedTarget) -> torch.dtype | None:
    """The dtype spec's drafter runs in (None: it has no drafter folder): spec.draft_dtype by name; auto:
    auto_draft_dtype, except a plain HF draft LM, which keeps the target's weights' dtype, as its fp32 weights may
    be narrower exact codes than bf16 (SmolLM2's GGUF: cpu_kernels/panel_codes.py). Results record it
    (eval/runner.py)."""
    if not spec.drafter:
        return None
    model = target.model
    if spec.draft_dtype != "auto":
        return torch_dtype(spec.draft_dtype, str(model.device))
    if spec.name == "draft_model" and plain_lm(Path(spec.drafter)):
        return model.weights_dtype
    return auto_draft_dtype(model)


def plain_lm(folder: Path) -> bool:
    """An HF model folder: config.json, and neither a draftsmith drafter folder nor another engine's export of one."""
    return (folder / "config.json").is_file() and not drafter_config(read_hf_config(folder), folder)


def drafter_config(hf: dict, folder: Path) -> bool:
    """A drafter folder's config (heads/drafter_folder.py, serve/export/external_heads.py), not a plain HF LM's."""
    return "kind" in hf or bool(external_format(folder))


def auto_draft_dtype(model: Transformer) -> torch.dtype:
    """bf16 for an fp32 target, else the target's weights' dtype. Drafts are only proposals (the target still decides
    every token), and bf16 halves the bytes a draft step streams: where draftsmith's kernels run, a bf16 drafter is
    run as a bf16 target is (its own weights rounded to bf16, computed in fp32, folder_drafter), an EAGLE-3 chain of 3
    drafting in 0.77x the fp32 head's time with the same drafts (docs/benchmarks.md); elsewhere on oneDNN's bf16
    kernels where the CPU has them. An fp32 target whose bf16 would run on neither keeps an fp32 drafter."""
    if model.weights_dtype != torch.float32:
        return model.weights_dtype
    weight = model.lm_head.weight
    onednn_bf16 = can_pack(weight.new_empty(0, dtype=torch.bfloat16)) and not native.runs(weight)
    return torch.bfloat16 if fp32_arithmetic(torch.bfloat16, model.device) or onednn_bf16 else torch.float32


def draft_lm(folder: Path, target: LoadedTarget, dtype: torch.dtype | None = None, draft_vocab: int = 0) -> Transformer:
    """A draft LM, refused unless it speaks the target's vocabulary; draft_vocab: see folder_drafter; dtype: its
    weights' (drafter_dtype resolves spec.draft_dtype; default: the target's)."""
    if not folder.is_dir():
        raise FileNotFoundError(f"spec.drafter={folder} is not a folder")
    if not (folder / "config.json").is_file():  # read_hf_config would call it a target folder
        raise FileNotFoundError(
            gguf_export(folder)
            or f"spec.drafter={folder} has no config.json: it is not a draftsmith drafter folder ({DRAFTER_HOLDS}) "
            "nor an HF draft model (config.json and *.safetensors)"
        )
    hf = read_hf_config(folder)
    if drafter_config(hf, folder):
        return folder_drafter(folder, target, "draft_model", dtype=dtype, draft_vocab=draft_vocab)
    archs = hf.get("architectures") or []
    if "vocab_size" not in hf or (archs and not set(archs) & set(TARGET_ARCHS.values())):  # e.g. another's export
        raise ValueError(not_a_drafter(folder, hf))
    if draft_vocab:
        raise ValueError(
            f"spec.draft_vocab needs the training answers' token counts of a draftsmith draft_model folder; "
            f"{folder} is a plain HF model: set spec.draft_vocab=0"
        )
    vocab = hf["vocab_size"]
    if vocab != target.model.config.vocab_size:
        raise ValueError(
            f"drafter {folder} has vocab_size {vocab} but target {target.target_id} has "
            f"{target.model.config.vocab_size}: a draft model must share the target's tokenizer"
        )
    check_same_tokenizer(load_tokenizer(folder), target.tokenizer, str(folder), target.target_id)
    return load_model(folder, dtype or target.model.weights_dtype, str(target.model.device))


def load_drafter(spec: SpecConfig, target: LoadedTarget, *shared) -> nn.Module:
    """The drafter folder spec.drafter names, of spec.name's kind (folder_drafter; `shared`: the target pieces the
    kind borrows), in spec.draft_dtype. spec=draft_model's proposer reads its folder with draft_lm, which also
    takes a plain HF draft LM."""
    dtype = drafter_dtype(spec, target)
    assert spec.drafter is not None, "SpecConfig refuses a drafter kind without one"
    return folder_drafter(Path(spec.drafter), target, spec.name, *shared, dtype=dtype, draft_vocab=spec.draft_vocab)


def folder_drafter(
    folder: Path,
    target: LoadedTarget,
    spec_name: str,
    *shared,
    dtype: torch.dtype | None = None,
    draft_vocab: int = 0,
):
    """A draftsmith drafter folder of spec_name's kind (or an EAGLE-3 head made elsewhere,
    serve/export/external_heads.py), refused unless it was made for this target; `shared`: target pieces the kind
    borrows (heads/drafter_folder.read_drafter); dtype: its weights' (default: the target's); draft_vocab > 0: its
    logits over the training answers' draft_vocab most frequent tokens only."""
    kind, fmt = by_spec(spec_name).name, external_format(folder)
    if fmt:
        read_external(folder, fmt)  # a speculators type other than eagle3 is refused as such, whatever the spec
    found = EXTERNAL_KIND if fmt else read_meta(folder)["kind"]
    if found != kind:
        what = f"an EAGLE-3 head ({fmt} layout); use it with spec={get(found).name}" if fmt else f"a {found} drafter"
        raise ValueError(f"spec.drafter={folder} is {what}; spec={spec_name} needs a {kind} drafter")
    m = target.model
    dtype = dtype or m.weights_dtype
    head: Any  # the kind's module: restrict_vocab where spec.draft_vocab applies (serve/spec.py, vocab_specs)
    if fmt:  # no draftsmith target id: checked against the target by what the folder records
        head = external_head(folder, fmt, m, target.target_id, dtype)
    else:
        head = read_drafter(folder, target_info(target), *shared, device=m.device, dtype=dtype)
    if fp32_arithmetic(dtype, m.device):  # its own weights now bf16 values: computed in fp32, as the target's
        cast_own(head, torch.float32)
    if draft_vocab:
        head.restrict_vocab(frequent_ids(load_token_counts(folder, m.config.vocab_size), draft_vocab))
    pack_linears(head.eval().requires_grad_(False))
    if isinstance(head, Transformer):  # a draft model: its forward, chosen as a target's is
        head.choose_path()
    return head


def check_same_tokenizer(draft: PreTrainedTokenizerBase, tgt: PreTrainedTokenizerBase, dname: str, tname: str) -> None:
    if draft.get_vocab() != tgt.get_vocab():
        raise ValueError(
            f"drafter {dname} has a different tokenizer ({len(draft)} tokens, {draft.name_or_path}) than target "
            f"{tname} ({len(tgt)} tokens, {tgt.name_or_path}); train or pick a drafter on the target's tokenizer"
        )
