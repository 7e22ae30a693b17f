"""Every kind has the same file shape in each layer it touches (docs/design.md, "Adding a kind"):

- heads/<kind>.py defines its module and config;
- train/loss_<kind>.py its loss;
- serve/proposers/propose_<kind>.py its proposer;
- serve/export/export_<kind>.py its formats, or export_<kind>_<format>.py one of them (EAGLE-3's and DFlash's
  gguf; EAGLE-3's speculators layout: serve/export/speculators.py);
- conf/head/<kind>.yaml, conf/spec/<spec>.yaml and conf/methods/<spec>.yaml.

A kind whose config extends another kind's config may use that kind's proposer, loss or export file (EAGLE-3's
proposer is EAGLE's)."""

from __future__ import annotations

from pathlib import Path

import draftsmith.conf
from draftsmith.heads import kinds
from draftsmith.heads.kinds import DraftShape, Kind
from draftsmith.heads.registry import BUILTIN

CONF = Path(draftsmith.conf.__path__[0])
SHARED_FORMATS = {"draftsmith.serve.export.speculators"}  # vLLM's speculators layout, one module for its kinds


def family(kind: Kind) -> set[str]:
    """The kind and the kinds whose config its config extends."""
    names = {kind.name}
    for other in kinds.KINDS.values():
        if kind.config and other.config and other.config is not kind.config and issubclass(kind.config, other.config):
            names.add(other.name)
    return names


def module(ref: str) -> str:
    return ref.split(":")[0]


def misplaced(kind: Kind) -> list[str]:
    """One line per piece of the kind that is not where the file shape puts it."""
    names, bad = family(kind), []

    def check(what: str, ref: str | None, pattern: str, extra: set[str] = frozenset()) -> None:
        if ref and module(ref) not in {pattern.format(n) for n in names} | extra:
            bad.append(f"{kind.name}: {what} {ref} is not in {pattern.format(kind.name)}")

    if kind.module is not None and kind.module.__module__ != f"draftsmith.heads.{kind.name}":
        bad.append(f"{kind.name}: module {kind.module.__module__} is not draftsmith.heads.{kind.name}")
    check("loss", kind.loss, "draftsmith.train.loss_{}")
    check("proposer", kind.proposer, "draftsmith.serve.proposers.propose_{}")
    for fmt, ref in kind.formats.items():  # a format of its own file: export_<kind>_<format>.py (llama.cpp's gguf)
        own = {f"draftsmith.serve.export.export_{n}_{fmt}" for n in names}
        check("format", ref, "draftsmith.serve.export.export_{}", SHARED_FORMATS | own)
    if kind.config is not None and not (CONF / "head" / f"{kind.name}.yaml").is_file():
        bad.append(f"{kind.name}: no conf/head/{kind.name}.yaml")
    for group in ("spec", "methods"):
        if kind.proposer and not (CONF / group / f"{kind.name}.yaml").is_file():
            bad.append(f"{kind.name}: no conf/{group}/{kind.name}.yaml")
    return bad


def test_every_built_in_kind_has_the_file_shape():
    """The built-in kinds (heads/registry.py); a kind registered from outside the package keeps its own layout."""
    assert [line for kind in BUILTIN for line in misplaced(kind)] == []


def test_a_kind_with_pieces_elsewhere_is_named():
    stray = Kind(
        name="stray",
        loss="draftsmith.train.losses:weighted_mean",
        proposer="draftsmith.serve.proposers.propose_eagle:eagle_proposer",
        formats={"vllm": "draftsmith.serve.export.export_medusa:MEDUSA_VLLM"},
        draft_shape=DraftShape(num_tokens=1, topk=1, total_tokens=0),
    )
    found = misplaced(stray)
    assert [line.split(" ")[1] for line in found] == ["loss", "proposer", "format", "no", "no"]
