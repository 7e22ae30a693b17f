"""The registry of drafter kinds: one record per kind holds everything the rest of the code asks of it.

A kind's own file defines its record (heads/<kind>.py: KIND; training-free methods in heads/headless_kinds.py);
heads/registry.py registers the built-in ones, in order. Pieces that live in higher layers (the loss in train/, the
proposer and the export formats in serve/) are named as "module:attr" strings and resolved where they are used, so
heads/ imports neither: build, train, eval and export each look a kind up here instead of switching on its name.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field, fields
from typing import Any

from torch import nn


@dataclass
class DraftShape:
    """The draft a drafter is made for. None: not set here, the next source decides (a spec setting, then the
    drafter folder's config.json "draft", then the kind's default)."""

    num_tokens: int | None = None  # depth: tokens a chain drafts, levels of a tree
    topk: int | None = None  # EAGLE trees: children per node (1 = a chain)
    total_tokens: int | None = None  # EAGLE trees: nodes kept (0 = every drafted node)
    choices: list[list[int]] | None = None  # Medusa: the static tree's paths

    def draft_tokens(self) -> int:
        """Nodes of the EAGLE-2 tree (a chain at topk 1) this shape drafts: topk + (depth - 1) * topk^2, capped at
        total_tokens when that is set."""
        assert self.num_tokens is not None and self.topk is not None, "a resolved shape (Kind.shape)"
        drafted = self.topk + (self.num_tokens - 1) * self.topk**2
        return min(self.total_tokens or drafted, drafted)


@dataclass(frozen=True, kw_only=True)
class Kind:
    """What the code asks of a drafter kind. A trained kind has a config, a module and a loss; a training-free one
    (n-gram lookup, layerskip) only a proposer. The built-in kinds are listed in
    heads/registry.py; one from outside the package calls register(Kind(...)) when its module is imported."""

    name: str  # the drafter folder's "kind", head=NAME in training, spec=NAME in generate and eval
    config: type[Any] | None = None  # the config dataclass, saved in the folder's config.json (None: training-free)
    module: type[nn.Module] | None = None  # built as module(config, target model); loaded the same way
    features: tuple[str, ...] = ("hidden",)  # what training reads from the target: hidden (last layer, normed),
    # aux (the inputs of the config's target_layers)
    loss: str | None = None  # "module:attr": loss(head, batch, **options) -> (loss, logs)
    proposer: str | None = None  # "module:attr": factory(spec: SpecConfig, target: LoadedTarget) -> Proposer,
    # the spec's shape resolved (None: serve cannot draft with it)
    formats: dict[str, str] = field(default_factory=dict)  # export format -> "module:attr" of a serve.export.Format
    draft_shape: DraftShape  # the default draft: num_tokens, topk and total_tokens set
    draft_keys: tuple[str, ...] = ("num_tokens",)  # the DraftShape fields its drafts use (the others: the default)
    max_depth: str = ""  # the config field that bounds the draft's depth (Medusa: num_heads)
    max_depth_less: int = 0  # what that field counts besides drafts (DFlash: block_size holds the accepted token)
    drafter: str = ""  # what spec.drafter takes ("" = a folder of this kind from draftsmith-train, if it is trained)
    parameters: int | None = None  # training-free kinds: parameters an eval reports (0: a lookup; None: not counted)

    def __post_init__(self) -> None:
        shape = self.draft_shape
        if None in (shape.num_tokens, shape.topk, shape.total_tokens):
            raise ValueError(f"kind {self.name}: its draft_shape must set num_tokens, topk and total_tokens")
        if (self.config is None) != (self.module is None):
            raise ValueError(f"kind {self.name}: give both config and module, or neither (a training-free kind)")

    def shape(self, *given: DraftShape) -> DraftShape:
        """Each of its draft_keys from the first of `given` that sets it, else from its default."""
        out = DraftShape(**vars(self.draft_shape))
        for key in self.draft_keys:
            value = next((getattr(g, key) for g in given if getattr(g, key) is not None), None)
            if value is not None:
                setattr(out, key, value)
        return out

    @property
    def trained(self) -> bool:
        return self.module is not None

    def drafter_help(self) -> str:
        """What spec.drafter must be; "" when the kind drafts without one."""
        if self.drafter or not self.trained:
            return self.drafter
        article = "an" if self.name[0] in "aeiou" else "a"
        return f"{article} {self.name} drafter folder (draftsmith-train head={self.name})"

    def target_layers(self, config: Any) -> tuple[int, ...]:
        """Target layers whose inputs the kind reads (a FeatureBatch's aux): its config's target_layers."""
        layers = tuple(config.target_layers) if "aux" in self.features else ()
        if list(layers) != sorted(set(layers)):
            raise ValueError(f"the head's target layers must be distinct and ascending, got {layers}")
        return layers

    def depth_cap(self, config: dict) -> int | None:
        bound = config.get(self.max_depth) if self.max_depth else None
        return bound - self.max_depth_less if isinstance(bound, int) else None


KINDS: dict[str, Kind] = {}


def register(kind: Kind) -> Kind:
    """Add a kind; registering the same record again (a re-imported module) is a no-op."""
    old = KINDS.get(kind.name)
    if old is not None and old != kind:
        raise ValueError(f"drafter kind {kind.name!r} is registered twice, differently")
    KINDS[kind.name] = kind
    return kind


def get(name: str) -> Kind:
    if name not in KINDS:
        raise ValueError(f"unknown drafter kind {name!r}; known: {', '.join(KINDS)}")
    return KINDS[name]


def trained() -> list[Kind]:
    return [k for k in KINDS.values() if k.trained]


def specs() -> tuple[str, ...]:
    """What spec= takes: plain decoding (ar) and every kind the engine can draft with."""
    return ("ar", *(k.name for k in KINDS.values() if k.proposer))


def by_spec(spec: str) -> Kind:
    for k in KINDS.values():
        if k.name == spec and k.proposer:
            return k
    raise ValueError(f"unknown spec {spec!r}; choose one of {', '.join(specs())}")


def resolve(ref: str) -> Any:
    """ "package.module:attr" -> the object, imported now."""
    module, _, attr = ref.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{ref!r} does not resolve ({e}): fix its kind's registration") from e


def refs(kind: Kind) -> list[str]:
    """Every "module:attr" the kind names."""
    return [r for r in (kind.proposer, kind.loss, *kind.formats.values()) if r]


def folder_shape(meta: dict) -> DraftShape:
    """The draft a drafter folder was made for (config.json "draft"), unset fields from its kind's default, the
    depth capped where the kind's config bounds it."""
    kind = get(meta["kind"])
    if "draft" not in meta:
        raise ValueError('config.json records no draft shape ("draft"): re-save the drafter with draftsmith-train')
    saved = meta["draft"]
    names = {f.name for f in fields(DraftShape)}
    if not isinstance(saved, dict) or not set(saved) <= names:
        raise ValueError(f"config.json's draft {saved!r} takes only {', '.join(sorted(names))}: re-save the drafter")
    shape = kind.shape(DraftShape(**saved))
    cap = kind.depth_cap(meta.get("config", {}))
    if cap is not None and shape.num_tokens is not None and shape.num_tokens > cap:
        shape.num_tokens = cap
    return shape
