"""What every drafter's loss consumes: token ids, the loss mask and the frozen target's states."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass
class FeatureBatch:
    input_ids: Tensor  # [b, n] int64, right-padded
    loss_mask: Tensor  # [b, n] float: 1 where input_ids[:, t] is an assistant token (a token worth predicting)
    hidden: Tensor  # [b, n, H] the target's final normed hidden states (what its lm_head sees)
    aux: Tensor | None = None  # [b, n, k*H] the target's inputs to layers head.target_layers, concatenated in order

    def to(self, device) -> FeatureBatch:
        aux = None if self.aux is None else self.aux.to(device)
        return FeatureBatch(self.input_ids.to(device), self.loss_mask.to(device), self.hidden.to(device), aux)
