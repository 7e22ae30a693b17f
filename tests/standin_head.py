"""A tiny stand-in drafter kind for trainer tests: a linear predictor of the next token id (mod `classes`,
to stay cheap next to a 49k vocabulary) over the target's final hidden state and one layer's input (so both
FeatureBatch.hidden and .aux are exercised). Importing this
module registers kind `test_linear` with its loss (heads/kinds.py); subprocess tests pass `imports=[standin_head]`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.heads.kinds import DraftShape, Kind, register

KIND = "test_linear"


@dataclass
class LinearConfig:
    hidden_size: int
    vocab_size: int
    target_layers: list[int] = field(default_factory=lambda: [1])
    classes: int = 512


class LinearHead(nn.Module):
    def __init__(self, cfg: LinearConfig, target: nn.Module | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.target_layers = tuple(cfg.target_layers)
        self.proj = nn.Linear(cfg.hidden_size * (1 + len(self.target_layers)), cfg.classes)


def linear_loss(head: LinearHead, batch, scale: float = 1.0):
    """CE of token t+1 (mod classes) from the states at t, on assistant tokens."""
    x = (batch.hidden if batch.aux is None else torch.cat([batch.hidden, batch.aux], dim=-1))[:, :-1]
    w = batch.loss_mask[:, 1:].flatten()
    labels = batch.input_ids[:, 1:].flatten() % head.config.classes
    ce = F.cross_entropy(head.proj(x).flatten(0, 1), labels, reduction="none")
    loss = scale * (ce * w).sum() / w.sum().clamp_min(1)
    return loss, {"loss": loss.item(), "masked": float(w.sum())}


# no proposer: serve cannot draft with it (the trainer's acceptance eval says so and skips)
register(
    Kind(
        name=KIND,
        config=LinearConfig,
        module=LinearHead,
        features=("hidden", "aux"),
        loss="standin_head:linear_loss",
        draft_shape=DraftShape(num_tokens=1, topk=1, total_tokens=0),
    )
)
