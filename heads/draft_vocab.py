"""A head that drafts over a draft vocabulary (vLLM's d2t / t2d), as EAGLE-3, P-EAGLE and DFlash do."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from draftsmith.runtime.llama import RMSNorm

from .drafter_folder import frequent_ids
from .head_base import HeadBase


def build_vocab_map(counts: Tensor, draft_vocab_size: int) -> tuple[Tensor, Tensor]:
    """The draft vocabulary: the draft_vocab_size most frequent target ids (ties: the lower id), sorted by id.
    d2t[i]: int64 offset, target id = i + d2t[i]; t2d: bool [vocab], True for the kept target ids."""
    if not 0 < draft_vocab_size <= counts.numel():
        raise ValueError(f"draft_vocab_size must be in [1, {counts.numel()}], got {draft_vocab_size}")
    kept = frequent_ids(counts, draft_vocab_size)
    t2d = torch.zeros(counts.numel(), dtype=torch.bool, device=counts.device)
    t2d[kept] = True
    return kept - torch.arange(draft_vocab_size, device=counts.device), t2d


class DraftVocabHead(HeadBase):
    """What EAGLE-3 and DFlash share: fc over target_layers' inputs, and logits over a draft vocabulary (vLLM's
    d2t / t2d) from `norm` and `lm_head`, whose rows can start as the target lm_head's."""

    shared_prefixes = ("embed_tokens.", "target_lm_head.")
    config: Any  # an Eagle3Config or a config extending it
    norm: RMSNorm
    lm_head: nn.Linear
    target_lm_head: nn.Linear
    d2t: Tensor  # vocab_buffers' buffers: long [draft vocab] target id offsets, bool [vocab] kept target ids
    t2d: Tensor

    @property
    def copies_target_rows(self) -> bool:
        """set_vocab copies the target lm_head's rows of the new vocabulary."""
        return True

    def vocab_buffers(self) -> None:
        cfg, dev = self.config, self.fc.weight.device
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long, device=dev))
        self.register_buffer("t2d", torch.arange(cfg.vocab_size, device=dev) < cfg.draft_vocab_size)

    @property
    def target_layers(self) -> tuple[int, ...]:
        return self.config.target_layers

    @property
    def vocab_ids(self) -> Tensor:
        """Target id of each draft id."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def set_vocab(self, counts: Tensor) -> None:
        """Pick the draft vocabulary from target-token counts [vocab] (e.g. over the training answers)."""
        d2t, t2d = build_vocab_map(counts.to(self.d2t.device), self.config.draft_vocab_size)
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)
        if self.copies_target_rows:
            self.copy_target_rows()

    def copy_target_rows(self) -> None:
        """The target's own output rows: the draft starts in (DFlash: stays in) the target's output space."""
        with torch.no_grad():
            self.lm_head.weight.copy_(self.target_lm_head.weight[self.vocab_ids])

    def logits(self, hidden: Tensor) -> Tensor:
        """Over the draft vocabulary (map ids with vocab_ids); hidden: the layers' output, before `norm`."""
        return self.lm_head(self.norm(hidden))
