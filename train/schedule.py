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

    def batches(self, n: int, epoch: int, rank: int, world: int, lengths: list[int] | None = None) -> list[list[int]]:
        """This process's micro-batches of `epoch`: a seeded permutation cut into batches, dealt round-robin. With
        `lengths` (train.group_by_length), the examples the epoch uses are taken from the permutation as without
        it, each run of MEGABATCH batches of them is sorted by length before it is cut, and the batches are then
        shuffled: the same examples per epoch, less padding per batch."""
        g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        used = self.steps_per_epoch * self.grad_accum * world * self.batch_size  # every process's, whole batches
        order = torch.randperm(n, generator=g).tolist()[:used]
        if lengths is None:
            return cut(order, self.batch_size)[rank::world]
        return grouped_batches(order, lengths, self.batch_size, g)[rank::world]


# batches per group sorted by length: the order stays a shuffle at the scale of the group, and a batch of 4 from a
# group of 64 is padded a few percent past its tokens, not half (ShareGPT's conversations at max_length 512)
MEGABATCH = 16


def cut(order: list[int], size: int) -> list[list[int]]:
    return [order[i : i + size] for i in range(0, len(order), size)]


def grouped_batches(order: list[int], lengths: list[int], size: int, g: torch.Generator) -> list[list[int]]:
    """The order's batches with each run of MEGABATCH batches sorted by length before it is cut, then shuffled."""
    runs = cut(order, size * MEGABATCH)
    batches = cut([i for run in runs for i in sorted(run, key=lambda i: -lengths[i])], size)
    return [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]


def warmup_decay(tc: TrainConfig, total: int):
    """The lr factor per step: a linear warmup, then train.schedule's decay (cosine or linear) to min_lr_ratio."""

    def factor(step: int) -> float:
        if step < tc.warmup_steps:
            return (step + 1) / tc.warmup_steps
        progress = min(1.0, (step - tc.warmup_steps) / max(1, total - tc.warmup_steps))
        left = 0.5 * (1 + math.cos(math.pi * progress)) if tc.schedule == "cosine" else 1 - progress
        return tc.min_lr_ratio + (1 - tc.min_lr_ratio) * left

    return factor
