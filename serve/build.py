"""From typed configs to a ready engine: target, proposer, prefix cache, chat encoding."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from draftsmith.heads.drafter import TargetInfo, frequent_ids, load_drafter, load_token_counts, not_a_drafter, read_meta
from draftsmith.heads.kinds import KINDS, DraftShape, by_spec, folder_shape, get, resolve, specs
from draftsmith.heads.llama import Transformer
from draftsmith.heads.packed import can_pack, pack_linears
from draftsmith.serve.engine.engine import Engine
from draftsmith.serve.engine.prefix_cache import PrefixCache
from draftsmith.serve.engine.tree import TreeConfig
from draftsmith.serve.export.foreign import (
    FOREIGN_KIND,
    TARGET_ARCHS,
    foreign_format,
    load_foreign,
    read_foreign,
    recorded_depth,
)
from draftsmith.serve.models.loader import load_model, read_hf_config
from draftsmith.serve.models.target import TargetConfig, load_target, load_tokenizer, resolve_target, torch_dtype
from draftsmith.serve.proposers.base import Proposer
from draftsmith.serve.proposers.hybrid import HybridProposer
from draftsmith.serve.proposers.propose_ngram import NgramConfig, NgramProposer
from draftsmith.serve.proposers.propose_suffix import SuffixConfig, SuffixProposer


@dataclass
class SpecConfig:
    """Mirrors the hydra group `spec`; each method reads the fields it needs. The draft's shape (num_tokens, tree,
    choices) left None comes from the drafter folder (the shape it was made for), else the kind's default
    (resolve_shape)."""

    name: str = "ar"
    num_tokens: int | None = None  # chain length k (tree depth for tree proposers; suffix: the most tokens a draft
    # holds); None: the drafter's
    min_n: int = 2  # ngram
    max_n: int = 4  # ngram
    drafter: str | None = None  # draft: an HF folder sharing the target's tokenizer, or a draft_model drafter folder
    layers: int = 8  # layerskip: how many of the target's layers draft
    choices: list[list[int]] | None = None  # medusa: tree paths, e.g. [[0], [0, 0], [1]]; None: the drafter's
    # eagle, eagle3: topk (1 = a chain), total_tokens; None: the drafter's
    tree: TreeConfig = field(default_factory=lambda: TreeConfig(None, None))
    ngram_tokens: int = 0  # eagle, eagle3, medusa: also draft an n-gram lookup chain this long (0 = off)
    suffix_tokens: int = 0  # eagle, eagle3, medusa: also draft by suffix decoding, up to this many tokens (0 = off)
    ngram_policy: str = "prefer"  # for either lookup: prefer: its draft alone when found, else the tree | merge: both
    suffix: SuffixConfig = field(default_factory=SuffixConfig)  # suffix (and suffix_tokens): vLLM's suffix settings
    draft_dtype: str = "auto"  # the drafter's weights: auto (bf16 for an fp32 target on CPU) | float32 | bfloat16
    draft_vocab: int = 0  # eagle, medusa, draft: draft over the N most frequent training-answer tokens (0 = all)

    def __post_init__(self) -> None:  # checked when the config is built, before any model loads
        if self.name not in specs():
            raise ValueError(f"unknown spec {self.name!r}; choose one of {', '.join(specs())}")
        if needs_drafter(self.name) and not self.drafter:
            raise ValueError(f"spec={self.name} needs spec.drafter=DIR: {needs_drafter(self.name)}")
        if self.num_tokens is not None and self.num_tokens < 1:
            raise ValueError(f"spec.num_tokens must be >= 1, got {self.num_tokens}")
        if self.draft_dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"spec.draft_dtype must be auto, float32, bfloat16 or float16, got {self.draft_dtype!r}")
        if self.ngram_tokens < 0:
            raise ValueError(f"spec.ngram_tokens must be >= 0 (0 = off), got {self.ngram_tokens}")
        if self.suffix_tokens < 0:
            raise ValueError(f"spec.suffix_tokens must be >= 0 (0 = off), got {self.suffix_tokens}")
        if self.ngram_tokens and self.suffix_tokens:
            raise ValueError("spec.ngram_tokens and spec.suffix_tokens both set: pair the drafter with one lookup")
        if self.draft_vocab < 0:
            raise ValueError(f"spec.draft_vocab must be >= 0 (0 = the full vocabulary), got {self.draft_vocab}")
        if self.draft_vocab and self.name not in vocab_specs():
            raise ValueError(draft_vocab_refusal(self.name))


def needs_drafter(name: str) -> str:
    """What spec.drafter must be for spec=name; "" when that spec takes none."""
    return next((k.drafter_help() for k in KINDS.values() if k.spec == name and k.proposer), "")


def vocab_specs() -> list[str]:
    """Specs whose drafter can narrow its logits at serve time (its module has restrict_vocab)."""
    return [k.spec for k in KINDS.values() if k.proposer and hasattr(k.module, "restrict_vocab")]


def draft_vocab_refusal(name: str) -> str:
    names, config = vocab_specs(), by_spec(name).config if name != "ar" else None
    own = config is not None and "draft_vocab_size" in config.__dataclass_fields__
    why = f" an {name} head has its own (draft_vocab_size, set in training)" if own else ""
    return f"spec.draft_vocab applies to spec={', '.join(names[:-1])} and {names[-1]}, not {name}.{why}"


def resolve_shape(spec: SpecConfig) -> SpecConfig:
    """The spec with its draft shape filled in: what it sets, else what its drafter folder was made for, else the
    kind's default. Plain decoding (ar) has none."""
    if spec.name == "ar":
        return spec
    mine = DraftShape(spec.num_tokens, spec.tree.topk, spec.tree.total_tokens, spec.choices)
    meta = drafter_meta(spec)
    shape = by_spec(spec.name).shape(mine, saved_shape(spec, meta))
    cap = get(meta["kind"]).depth_cap(meta.get("config") or {}) if meta else None
    if cap is not None and shape.num_tokens > cap:  # the slots past it would be drafted and verified for nothing
        warnings.warn(
            f"spec.num_tokens={shape.num_tokens} is past the {cap} positions this {spec.name} drafter drafts; "
            f"it drafts {cap}",
            stacklevel=2,
        )
        shape.num_tokens = cap
    tree = TreeConfig(shape.topk, shape.total_tokens)
    return replace(spec, num_tokens=shape.num_tokens, tree=tree, choices=shape.choices)


def drafter_meta(spec: SpecConfig) -> dict | None:
    """spec.drafter's draftsmith config.json (kind, config, draft); None for no folder, a foreign layout or a plain
    HF model."""
    folder = Path(spec.drafter) if spec.drafter else None
    if folder is None or not (folder / "config.json").is_file() or foreign_format(folder):
        return None
    return read_meta(folder) if read_hf_config(folder).get("kind") is not None else None


def saved_shape(spec: SpecConfig, meta: dict | None) -> DraftShape:
    """The shape spec.drafter was made for: a draftsmith folder's recorded draft (`meta`), a speculators folder's
    chain of speculative_tokens (what vLLM drafts from it); else the kind's default (no folder, a plain HF model, a
    layout that records no shape, or one the proposer's loader will refuse with its own message)."""
    if meta is not None:
        return folder_shape(meta)
    kind, folder = by_spec(spec.name), Path(spec.drafter) if spec.drafter else None
    if folder is not None and (folder / "config.json").is_file() and foreign_format(folder):
        depth = recorded_depth(folder)  # topk 1 only: a topk set without total_tokens keeps the kind's node cap
        return DraftShape(num_tokens=depth, topk=1) if depth else kind.draft_shape
    return kind.draft_shape


@dataclass
class Loaded:
    model: Transformer
    tokenizer: PreTrainedTokenizerBase
    target_id: str
    folder: Path | None = None  # the HF folder it was loaded from (what another engine, e.g. vLLM, would read)


def load(cfg: TargetConfig) -> Loaded:
    return Loaded(*load_target(cfg), resolve_target(cfg))


def target_info(target: Loaded) -> TargetInfo:
    c = target.model.config
    return TargetInfo(target.target_id, c.hidden_size, c.vocab_size, c.num_hidden_layers)


def make_proposer(spec: SpecConfig, target: Loaded) -> Proposer | None:
    """The kind's proposer factory (heads/kinds.py) on the spec with its shape resolved; a lookup (n-gram or suffix
    decoding) added to it when spec.ngram_tokens or spec.suffix_tokens asks (a lookup kind itself ignores them)."""
    if spec.name == "ar":
        return None
    spec = resolve_shape(spec)
    proposer = resolve(by_spec(spec.name).proposer)(spec, target)
    lookup = lookup_proposer(spec)
    return HybridProposer(proposer, lookup, spec.ngram_policy) if lookup else proposer


def paired_lookup(spec: SpecConfig) -> str | None:
    """The lookup (ngram or suffix) spec.ngram_tokens / spec.suffix_tokens pair with the spec's drafter; None for
    plain decoding and for a kind that drafts by lookup itself (registered with 0 parameters)."""
    if spec.name == "ar" or by_spec(spec.name).parameters == 0:
        return None
    return "ngram" if spec.ngram_tokens else "suffix" if spec.suffix_tokens else None


def lookup_proposer(spec: SpecConfig) -> Proposer | None:
    """The lookup drafter paired with a model drafter (serve/proposers/hybrid.py), if any. Under `prefer` a suffix draft
    must score (expect to get accepted) spec.num_tokens tokens to be taken over the drafter's, as ArcticInference
    takes it over its speculator's."""
    lookup = paired_lookup(spec)
    if lookup == "ngram":
        return NgramProposer(NgramConfig(spec.ngram_tokens, spec.min_n, spec.max_n))
    if lookup == "suffix":
        return SuffixProposer(spec.suffix, spec.suffix_tokens, spec.num_tokens if spec.ngram_policy == "prefer" else 0)
    return None


def draft_dtype(spec: SpecConfig, target: Transformer) -> torch.dtype:
    """auto: bf16 for an fp32 target on a CPU with bf16 kernels (a draft step costs ~half; drafts are only
    proposals, the fp32 target still decides every token), else the target's dtype."""
    if spec.draft_dtype != "auto":
        return torch_dtype(spec.draft_dtype, str(target.device))
    if target.dtype == torch.float32 and can_pack(target.lm_head.weight.new_empty(0, dtype=torch.bfloat16)):
        return torch.bfloat16
    return target.dtype


def load_draft_lm(folder: Path, target: Loaded, dtype: torch.dtype | None = None, draft_vocab: int = 0) -> Transformer:
    """A draft LM, refused unless it speaks the target's vocabulary; draft_vocab: see load_trained."""
    if not folder.is_dir():
        raise FileNotFoundError(f"spec.drafter={folder} is not a folder")
    hf = read_hf_config(folder)
    if "kind" in hf or foreign_format(folder):  # a drafter folder (heads/drafter.py, serve/export/foreign.py)
        return load_trained(folder, target, "draft", dtype=dtype, draft_vocab=draft_vocab)
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
    return load_model(folder, dtype or target.model.dtype, str(target.model.device))


def spec_head(spec: SpecConfig, target: Loaded, *shared):
    """The trained drafter spec.drafter names, for spec.name's kind (load_trained), in spec.draft_dtype."""
    dtype = draft_dtype(spec, target.model)
    return load_trained(Path(spec.drafter), target, spec.name, *shared, dtype=dtype, draft_vocab=spec.draft_vocab)


def load_trained(
    folder: Path,
    target: Loaded,
    spec_name: str,
    *shared,
    dtype: torch.dtype | None = None,
    draft_vocab: int = 0,
):
    """A draftsmith drafter folder of spec_name's kind (or an EAGLE-3 head made elsewhere, serve/export/foreign.py),
    refused unless it was made for this target; `shared`: target pieces the kind borrows (heads/drafter.load_drafter);
    dtype: its weights' (default: the target's); draft_vocab > 0: its logits over the training answers' draft_vocab most
    frequent tokens only."""
    kind, fmt = by_spec(spec_name).name, foreign_format(folder)
    if fmt:
        read_foreign(folder, fmt)  # a speculators type other than eagle3 is refused as such, whatever the spec
    found = FOREIGN_KIND if fmt else read_meta(folder)["kind"]
    if found != kind:
        what = f"an EAGLE-3 head ({fmt} layout); use it with spec={get(found).spec}" if fmt else f"a {found} drafter"
        raise ValueError(f"spec.drafter={folder} is {what}; spec={spec_name} needs a {kind} drafter")
    m = target.model
    if fmt:  # no draftsmith target id: checked against the target by what the folder records
        head = load_foreign(folder, fmt, m, target.target_id, dtype or m.dtype)
    else:
        head = load_drafter(folder, target_info(target), *shared, device=m.device, dtype=dtype or m.dtype)
    if draft_vocab:
        head.restrict_vocab(frequent_ids(load_token_counts(folder, m.config.vocab_size), draft_vocab))
    pack_linears(head.eval().requires_grad_(False))
    return head


def check_same_tokenizer(draft: PreTrainedTokenizerBase, tgt: PreTrainedTokenizerBase, dname: str, tname: str) -> None:
    if draft.get_vocab() != tgt.get_vocab():
        raise ValueError(
            f"drafter {dname} has a different tokenizer ({len(draft)} tokens, {draft.name_or_path}) than target "
            f"{tname} ({len(tgt)} tokens, {tgt.name_or_path}); train or pick a drafter on the target's tokenizer"
        )


def build_engine(
    target: Loaded, spec: SpecConfig, prefix_cache: bool, max_seq_len: int, cuda_graphs: str = "auto"
) -> Engine:
    spec = resolve_shape(spec)  # the salt names the shape drafted
    proposer = make_proposer(spec, target)
    return Engine(
        target.model,
        proposer,
        PrefixCache() if prefix_cache else None,
        eos_ids=eos_ids(target),
        max_seq_len=max_seq_len,
        salt=f"{target.target_id}|{target.model.dtype}|{spec}",
        cuda_graphs=cuda_graphs,
    )


def eos_ids(target: Loaded) -> tuple[int, ...]:
    ids = set(target.model.config.eos_token_ids)
    if target.tokenizer.eos_token_id is not None:
        ids.add(target.tokenizer.eos_token_id)
    return tuple(sorted(ids))


def encode_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict]) -> list[int]:
    """The target's chat template with the assistant turn opened."""
    if not tokenizer.chat_template:
        raise ValueError(f"{tokenizer.name_or_path} has no chat template; use raw prompts (chat=false / `prompt`)")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_raw(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer(text)["input_ids"]
