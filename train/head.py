"""Build a drafter head of any registered kind for a loaded target, from the hydra group `head`."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from torch import nn

from draftsmith.heads.kinds import KINDS, DraftShape, Kind
from draftsmith.runtime.llama import ModelConfig
from draftsmith.serve.models.target import LoadedTarget

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
    config class; `loss` passes options to its loss (train/loss_<kind>.py), e.g. ttt_steps for eagle3."""

    kind: str = "eagle3"
    num_layers: int | None = None  # draft_model: layers; medusa: residual blocks per head
    num_heads: int | None = None  # medusa: heads (tokens ahead)
    hidden_size: int | None = None  # draft_model sizes (null = the target's)
    intermediate_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    draft_vocab_size: int | None = None  # eagle3, peagle, dflash (null = heads/eagle3.py DRAFT_VOCAB, capped)
    target_layers: list[int] | None = None  # eagle3: target layers fused by fc (null = 2, L/2, L-3)
    init: str | None = None  # draft_model: target | scratch; eagle3 (and peagle): scratch | target | layer
    args: dict[str, Any] = field(default_factory=dict)
    loss: dict[str, Any] = field(default_factory=dict)
    # the draft the head is made for (null fields: the kind's default): the in-training eval drafts it, the drafter
    # folder records it, and generate, eval and export draft it unless told otherwise
    draft: DraftShape = field(default_factory=DraftShape)

    def kwargs(self) -> dict[str, Any]:
        return {**self.args, **{k: getattr(self, k) for k in SIZE_FIELDS if getattr(self, k) is not None}}

    def loss_options(self) -> dict[str, Any]:
        """What the loss is called with: `loss` less its null keys (null = the loss function's default)."""
        return {k: v for k, v in self.loss.items() if v is not None}


def trained_kind(kind: str) -> Kind:
    """The registered kind a head is trained for (heads/kinds.py)."""
    found = KINDS.get(kind)
    if found is None or not found.trained:
        known = ", ".join(k.name for k in KINDS.values() if k.trained)
        raise ValueError(f"unknown head kind {kind!r}; known: {known} (or register one: imports=[MODULE])")
    return found


def build_head(kind: str, target: LoadedTarget, cfg: HeadConfig) -> tuple[nn.Module, Any]:
    """The kind's module, built with its config and the target (to borrow or copy weights from), and that
    config (what save_drafter writes: not always `head.config`, a draft model's is its ModelConfig)."""
    config = head_config(kind, cfg, target.model.config)
    module = trained_kind(kind).module
    assert module is not None, "trained_kind's kinds have one"
    return module(config, target.model), config


def head_config(kind: str, cfg: HeadConfig, target_config: ModelConfig):
    """The kind's config: `from_target(target config, **sizes)` where the class has it, else its constructor
    with the sizes, and its required fields that the target's config has (hidden_size, ...) filled from it."""
    config_cls = trained_kind(kind).config
    assert config_cls is not None, "trained_kind's kinds have one"
    kwargs = cfg.kwargs()
    try:
        if hasattr(config_cls, "from_target"):
            return config_cls.from_target(target_config, **kwargs)
        required = [f.name for f in fields(config_cls) if f.default is MISSING and f.default_factory is MISSING]
        return config_cls(**{**{k: getattr(target_config, k) for k in required if hasattr(target_config, k)}, **kwargs})
    except TypeError as e:  # a size this kind does not take
        names = [f.name for f in fields(config_cls)]
        raise ValueError(f"head={kind}: {e}; its config takes {', '.join(names)}") from e
