"""Two head versions compared on the same requests, group by group: each client's requests are one group (the replay
cache's judging sample another), each group one vote, so a client's many requests weigh what one client's few do.

Used to publish a candidate (it must gain more than min_gain on the mean over groups, lose no more than min_gain on
any group, and be judged on at least min_clients groups) and to roll a live version back (train/adapt/review.py)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ..batch import FeatureBatch
from .gate import Shape, judge

REPLAY = "replay"  # the replay cache's group


@dataclass
class GroupScore:
    requests: int
    tau_base: float
    tau_candidate: float

    @property
    def gain(self) -> float:
        return self.tau_candidate - self.tau_base


def score_groups(
    candidate: Any, base: Any, groups: dict[str, list[FeatureBatch]], sizes: dict[str, int], shape: Shape
) -> dict[str, GroupScore]:
    """Both heads' offline tau on each group's batches: paired, the same requests for both."""
    return {
        name: GroupScore(sizes[name], round(judge(base, batches, shape), 4), round(judge(candidate, batches, shape), 4))
        for name, batches in groups.items()
    }


def mean_gain(scores: dict[str, GroupScore]) -> float:
    return sum(s.gain for s in scores.values()) / len(scores) if scores else 0.0


def refusal(scores: dict[str, GroupScore], min_groups: int, min_gain: float) -> str | None:
    """Why the candidate is not published, or None when it is."""
    if reason := too_few(list(scores), min_groups):
        return reason
    gain = mean_gain(scores)
    if gain <= min_gain:
        return f"held-out tau gain {gain:+.4f} over {len(scores)} groups is not above min_gain {min_gain}"
    worst = min(scores, key=lambda name: scores[name].gain)
    if scores[worst].gain < -min_gain:
        return f"group {worst} loses {scores[worst].gain:+.4f} held-out tau, more than min_gain {min_gain}"
    return None


def too_few(groups: list[str], min_groups: int) -> str | None:
    """Why `groups` cannot judge a candidate: fewer than min_clients of them (one client alone cannot steer)."""
    if len(groups) >= min_groups:
        return None
    return (
        f"judged on {len(groups)} group(s) ({', '.join(groups) or 'none'}); adaptation.min_clients={min_groups} needs "
        "held-back requests from more clients, or adaptation.replay set (min_clients=1 on a one-user server)"
    )


def as_rows(scores: dict[str, GroupScore]) -> dict[str, dict]:
    return {name: asdict(s) | {"gain": round(s.gain, 4)} for name, s in scores.items()}
