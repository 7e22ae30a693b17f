"""From typed configs to a ready engine: target, proposer, prefix cache, chat encoding."""

from __future__ import annotations

import warnings
from dataclasses import replace
from pathlib import Path

from draftsmith.heads.drafter_folder import read_meta
from draftsmith.heads.kinds import DraftShape, by_spec, folder_shape, get, resolve
from draftsmith.serve.engine.calibration import Acceptance
from draftsmith.serve.engine.cost_profile import load_or_measure
from draftsmith.serve.engine.draft_cut import CostCut
from draftsmith.serve.engine.engine import Engine
from draftsmith.serve.engine.policy import DraftPolicy
from draftsmith.serve.engine.prefix_cache import PrefixCache
from draftsmith.serve.engine.tree import TreeConfig
from draftsmith.serve.export.external_heads import (
    external_format,
    recorded_depth,
)
from draftsmith.serve.models.loader import read_hf_config
from draftsmith.serve.models.target import LoadedTarget, eos_ids
from draftsmith.serve.proposers.base import Proposer
from draftsmith.serve.proposers.hybrid import HybridProposer
from draftsmith.serve.proposers.propose_ngram import NgramConfig, NgramProposer
from draftsmith.serve.proposers.propose_suffix import SuffixProposer
from draftsmith.serve.spec import SpecConfig


def resolve_shape(spec: SpecConfig) -> SpecConfig:
    """The spec with its draft shape filled in: what it sets, else what its drafter folder was made for, else the
    kind's default. Plain decoding (ar) has none."""
    if spec.name == "ar":
        return spec
    mine = DraftShape(spec.num_tokens, spec.tree.topk, spec.tree.total_tokens, spec.choices)
    meta = drafter_meta(spec)
    shape = by_spec(spec.name).shape(mine, saved_shape(spec, meta))
    cap = get(meta["kind"]).depth_cap(meta.get("config") or {}) if meta else None
    assert shape.num_tokens is not None, "every drafting kind's default sets a depth"
    if cap is not None and shape.num_tokens > cap:  # the slots past it would be drafted and verified for nothing
        warnings.warn(
            f"spec.num_tokens={shape.num_tokens} is past the {cap} positions this {spec.name} drafter drafts; "
            f"it drafts {cap}",
            stacklevel=2,
        )
        shape.num_tokens = cap
    deepest = max(map(len, spec.choices), default=0) if spec.choices else 0
    if deepest > shape.num_tokens:  # the same rule: what the spec asks past the drafted depth is cut, said once
        warnings.warn(
            f"spec.choices goes {deepest} levels deep, past the {shape.num_tokens} this {spec.name} drafter drafts "
            "(spec.num_tokens, at most its heads); the deeper paths are left out",
            stacklevel=2,
        )
        assert shape.choices is not None, "spec.choices set them"
        shape.choices = [c for c in shape.choices if len(c) <= shape.num_tokens]
    tree = TreeConfig(shape.topk, shape.total_tokens)
    return replace(spec, num_tokens=shape.num_tokens, tree=tree, choices=shape.choices)


def drafter_meta(spec: SpecConfig) -> dict | None:
    """spec.drafter's draftsmith config.json (kind, config, draft); None for no folder, an external layout or a plain
    HF model."""
    folder = Path(spec.drafter) if spec.drafter else None
    if folder is None or not (folder / "config.json").is_file() or external_format(folder):
        return None
    return read_meta(folder) if read_hf_config(folder).get("kind") is not None else None


def saved_shape(spec: SpecConfig, meta: dict | None) -> DraftShape:
    """The shape spec.drafter was made for: a draftsmith folder's recorded draft (`meta`), a speculators folder's
    chain of speculative_tokens (what vLLM drafts from it); else the kind's default (no folder, a plain HF model, a
    layout that records no shape, or one the proposer's loader will refuse with its own message)."""
    if meta is not None:
        return folder_shape(meta)
    kind, folder = by_spec(spec.name), Path(spec.drafter) if spec.drafter else None
    if folder is not None and (folder / "config.json").is_file() and external_format(folder):
        depth = recorded_depth(folder)  # topk 1 only: a topk set without total_tokens keeps the kind's node cap
        return DraftShape(num_tokens=depth, topk=1) if depth else kind.draft_shape
    return kind.draft_shape


def make_proposer(spec: SpecConfig, target: LoadedTarget) -> Proposer | None:
    """The kind's proposer factory (heads/kinds.py) on the spec with its shape resolved; a lookup (n-gram or suffix
    decoding) added to it when spec.ngram_tokens or spec.suffix_tokens asks (a lookup kind itself ignores them)."""
    if spec.name == "ar":
        return None
    spec = resolve_shape(spec)
    factory = by_spec(spec.name).proposer
    assert factory is not None, "by_spec finds kinds with a proposer"
    proposer = resolve(factory)(spec, target)
    lookup = lookup_proposer(spec)
    return HybridProposer(proposer, lookup, spec.ngram_policy) if lookup else proposer


def paired_lookup(spec: SpecConfig) -> str | None:
    """The lookup (ngram or suffix) spec.ngram_tokens / spec.suffix_tokens pair with the spec's drafter; None for
    plain decoding and for a kind that drafts by lookup itself (registered with 0 parameters)."""
    if spec.name == "ar" or by_spec(spec.name).parameters == 0:
        return None
    return "ngram" if spec.ngram_tokens else "suffix" if spec.suffix_tokens else None


def lookup_proposer(spec: SpecConfig) -> NgramProposer | SuffixProposer | None:
    """The lookup drafter paired with a model drafter (serve/proposers/hybrid.py), if any. Under `prefer` a suffix draft
    must score (expect to get accepted) spec.num_tokens tokens to be taken over the drafter's, as ArcticInference
    takes it over its speculator's."""
    lookup = paired_lookup(spec)
    if lookup == "ngram":
        return NgramProposer(NgramConfig(spec.ngram_tokens, spec.min_n, spec.max_n))
    if lookup == "suffix":
        assert spec.num_tokens is not None, "resolve_shape resolved it"
        # under the draft policy every suffix draft is judged by the policy, not gated by its score first
        gated = spec.ngram_policy == "prefer" and spec.verify != "policy"
        return SuffixProposer(spec.suffix, spec.suffix_tokens, spec.num_tokens if gated else 0)
    return None


def engine_salt(target: LoadedTarget, spec: SpecConfig) -> str:
    """What separates prefix-cache entries: the target, its dtype, and the resolved spec (drafter and shape)."""
    return f"{target.target_id}|{target.model.weights_dtype}|{spec}"


def build_engine(
    target: LoadedTarget,
    spec: SpecConfig,
    prefix_cache: bool,
    max_seq_len: int,
    cuda_graphs: str = "auto",
    prefix_cache_bytes: int = 1 << 30,
    cache_dir: str | None = None,
) -> Engine:
    """cache_dir: the target's (target.cache_dir), where spec.verify=cost and policy keep this machine's verify cost
    curve."""
    spec = resolve_shape(spec)  # the salt names the shape drafted
    proposer = make_proposer(spec, target)
    engine = Engine(
        target.model,
        proposer,
        PrefixCache(max_bytes=prefix_cache_bytes) if prefix_cache else None,
        eos_ids=eos_ids(target),
        max_seq_len=max_seq_len,
        salt=engine_salt(target, spec),
        cuda_graphs=cuda_graphs,
    )
    if spec.verify != "fixed" and proposer is not None:
        cost = load_or_measure(engine, target.target_id, cache_dir)
        if spec.verify == "cost":
            engine.draft_cut = CostCut(cost)
        else:
            engine.policy = DraftPolicy(cost, spec.policy)
    if spec.policy.report_estimates and engine.policy is None:  # spec=ar with it is refused: a proposer is here
        engine.estimates = Acceptance(spec.policy.prior_weight, spec.policy.half_life)
    return engine
