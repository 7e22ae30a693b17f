"""Build a drafter head of any registered kind for a loaded target, from the hydra group `head`."""

from __future__ import annotations

import importlib
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from torch import nn

from draftsmith.heads.drafter import REGISTRY
from draftsmith.heads.llama import ModelConfig
from draftsmith.serve.build import Loaded

SIZE_FIELDS = (
    "num_layers",
    "num_heads",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "draft_vocab_size",
    "target_layers",
    "init",
)


@dataclass
class HeadConfig:
    """Mirrors the hydra group `head`. The named fields are the sizes the built-in kinds take (null = the
    kind's default), so sweeps read `head.num_layers=1,2,4`; `args` passes anything else to the kind's
    config class; `loss` passes options to its loss (train/losses.py), e.g. ttt_steps for eagle3."""

    kind: str = "eagle3"
    num_layers: int | None = None  # draft_model: layers; medusa: residual blocks per head
    num_heads: int | None = None  # medusa: heads (tokens ahead)
    hidden_size: int | None = None  # draft_model sizes (null = the target's)
    intermediate_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    draft_vocab_size: int | None = None  # eagle3
    target_layers: list[int] | None = None  # eagle3: target layers fused by fc (null = 2, L/2, L-3)
    init: str | None = None  # draft_model: target | scratch
    args: dict[str, Any] = field(default_factory=dict)
    loss: dict[str, Any] = field(default_factory=dict)

    def kwargs(self) -> dict[str, Any]:
        return {**self.args, **{k: getattr(self, k) for k in SIZE_FIELDS if getattr(self, k) is not None}}


def head_class(kind: str) -> tuple[type, type[nn.Module]]:
    if kind not in REGISTRY:
        try:  # the built-in kinds register on import: heads/<kind>.py
            importlib.import_module(f"draftsmith.heads.{kind}")
        except ModuleNotFoundError:
            pass
    if kind not in REGISTRY:
        raise ValueError(f"unknown head kind {kind!r}; known: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[kind]


def build_head(kind: str, target: Loaded, cfg: HeadConfig) -> tuple[nn.Module, Any]:
    """The kind's module, built with its config and the target (to borrow or copy weights from), and that
    config (what save_drafter writes: not always `head.config`, a draft model's is its ModelConfig)."""
    _, module_cls = head_class(kind)
    config = head_config(kind, cfg, target.model.config)
    return module_cls(config, target.model), config


def head_config(kind: str, cfg: HeadConfig, target: ModelConfig):
    """The kind's config: `from_target(target config, **sizes)` where the class has it, else its constructor
    with the sizes, and its required fields that the target's config has (hidden_size, ...) filled from it."""
    config_cls, _ = head_class(kind)
    kwargs = cfg.kwargs()
    try:
        if hasattr(config_cls, "from_target"):
            return config_cls.from_target(target, **kwargs)
        required = [f.name for f in fields(config_cls) if f.default is MISSING and f.default_factory is MISSING]
        return config_cls(**{**{k: getattr(target, k) for k in required if hasattr(target, k)}, **kwargs})
    except TypeError as e:  # a size this kind does not take
        names = [f.name for f in fields(config_cls)]
        raise ValueError(f"head={kind}: {e}; its config takes {', '.join(names)}") from e


def head_layers(head: nn.Module) -> tuple[int, ...]:
    """Target layers whose inputs the head reads (FeatureBatch.aux): `target_layers`, or `aux_layers`
    as the engine's proposers name it."""
    layers = getattr(head, "target_layers", None)
    layers = tuple(getattr(head, "aux_layers", ()) if layers is None else layers)
    if list(layers) != sorted(set(layers)):
        raise ValueError(f"the head's target layers must be distinct and ascending, got {layers}")
    return layers
