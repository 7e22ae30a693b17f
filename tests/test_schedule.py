"""The data order (train/schedule.py): seeded per epoch, and with train.group_by_length the same examples in batches
of like length."""

from __future__ import annotations

import random

import pytest

from draftsmith.train.config import TrainConfig
from draftsmith.train.schedule import MEGABATCH, Schedule


def lengths_spread(n: int, seed: int = 0) -> list[int]:
    """Conversation lengths as ShareGPT's at max_length 512: many short, a long tail cut at 512."""
    rng = random.Random(seed)
    return [min(512, int(rng.lognormvariate(5.2, 0.7))) for _ in range(n)]


def padded(batches: list[list[int]], lengths: list[int]) -> int:
    """Tokens the batches hold once each is padded to its longest example."""
    return sum(len(b) * max(lengths[i] for i in b) for b in batches)


def plan(n: int, batch_size: int = 4, world: int = 1, grad_accum: int = 1) -> Schedule:
    return Schedule.make(n, TrainConfig(epochs=2, batch_size=batch_size, grad_accum=grad_accum), world)


@pytest.mark.parametrize("n", [1040, 1043])
def test_grouped_batches_hold_the_random_batches_examples_with_a_fraction_of_the_padding(n):
    lengths, s = lengths_spread(n), plan(n)
    shuffled, grouped = s.batches(n, 0, 0, 1), s.batches(n, 0, 0, 1, lengths)
    assert len(grouped) == len(shuffled) == s.steps_per_epoch == n // 4
    assert all(len(b) == 4 for b in grouped)
    assert sorted(i for b in grouped for i in b) == sorted(i for b in shuffled for i in b)
    real = sum(lengths[i] for b in grouped for i in b)
    assert padded(shuffled, lengths) > 1.3 * real
    assert padded(grouped, lengths) < 1.1 * real


def test_grouped_batches_are_a_shuffle_fixed_by_seed_and_epoch():
    """Not sorted across the epoch (long and short batches interleave), the same on a rerun (a resume repeats it),
    another order the next epoch."""
    n, lengths = 1040, lengths_spread(1040)
    s = plan(n)
    first = s.batches(n, 0, 0, 1, lengths)
    assert first == s.batches(n, 0, 0, 1, lengths)
    assert first != s.batches(n, 1, 0, 1, lengths)
    longest = [max(lengths[i] for i in b) for b in first]
    assert longest != sorted(longest) and longest != sorted(longest, reverse=True)
    groups = {i // (4 * MEGABATCH) for i in range(n)}
    assert len(groups) > 1  # the data spans several groups, so the shuffle between them is tested


@pytest.mark.parametrize(("n", "world", "grad_accum"), [(1040, 2, 1), (100, 1, 3), (1043, 3, 2)])
def test_grouped_batches_deal_the_random_orders_examples_to_processes_without_overlap(n, world, grad_accum):
    """Where batches are left over (the epoch's steps x grad_accum x processes take fewer), the grouped epoch leaves
    out the examples the random one leaves out."""
    lengths, s = lengths_spread(n), plan(n, world=world, grad_accum=grad_accum)
    ranks = [s.batches(n, 0, r, world, lengths) for r in range(world)]
    assert all(len(batches) == s.steps_per_epoch * grad_accum for batches in ranks)
    seen = [i for batches in ranks for b in batches for i in b]
    assert len(seen) == len(set(seen))
    shuffled = [i for r in range(world) for b in s.batches(n, 0, r, world) for i in b]
    assert sorted(seen) == sorted(shuffled)
