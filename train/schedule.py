"""The data order and the learning-rate schedule: both fixed by the config, so a resumed run repeats them."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .config import TrainConfig


@dataclass
class Schedule:
    steps_per_epoch: int
    total_steps: int
    batch_size: int
    grad_accum: int
    seed: int

    @classmethod
    def make(cls, n: int, tc: TrainConfig, world: int) -> Schedule:
        per_epoch = n // tc.batch_size // world // tc.grad_accum
        if per_epoch == 0:
            raise ValueError(
                f"{n} examples make no full step of batch_size {tc.batch_size} x grad_accum {tc.grad_accum} x "
                f"{world} processes: use more data or smaller batches"
            )
        total = tc.epochs * per_epoch if tc.max_steps is None else tc.max_steps
        return cls(per_epoch, total, tc.batch_size, tc.grad_accum, tc.seed)

    def batches(self, n: int, epoch: int, rank: int, world: int) -> list[list[int]]:
        """This process's micro-batches of `epoch`: a seeded permutation cut into batches, dealt round-robin."""
        order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed * 100_003 + epoch)).tolist()
        batches = [order[i : i + self.batch_size] for i in range(0, n - self.batch_size + 1, self.batch_size)]
        return batches[rank::world][: self.steps_per_epoch * self.grad_accum]


def warmup_decay(tc: TrainConfig, total: int):
    """The lr factor per step: a linear warmup, then train.schedule's decay (cosine or linear) to min_lr_ratio."""

    def factor(step: int) -> float:
        if step < tc.warmup_steps:
            return (step + 1) / tc.warmup_steps
        progress = min(1.0, (step - tc.warmup_steps) / max(1, total - tc.warmup_steps))
        left = 0.5 * (1 + math.cos(math.pi * progress)) if tc.schedule == "cosine" else 1 - progress
        return tc.min_lr_ratio + (1 - tc.min_lr_ratio) * left

    return factor
