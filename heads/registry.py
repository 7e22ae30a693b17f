"""The built-in drafter kinds, listed once, in the order spec= lists and messages name them. A kind from outside
the package registers itself with kinds.register when its module is imported (draftsmith-train imports=[...])."""

from __future__ import annotations

from . import dflash, draft_model, dspark, eagle, eagle3, headless_kinds, medusa, peagle
from .kinds import Kind, register

BUILTIN: tuple[Kind, ...] = (
    draft_model.KIND,
    eagle.KIND,
    eagle3.KIND,
    medusa.KIND,
    headless_kinds.NGRAM,
    headless_kinds.SUFFIX,
    headless_kinds.LAYERSKIP,
    dflash.KIND,
    dspark.KIND,
    peagle.KIND,
)

for kind in BUILTIN:
    register(kind)
