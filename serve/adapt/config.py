"""AdaptConfig: what draftsmith-serve captures of its traffic and how the trainer beside it adapts the drafter
(the `adaptation` block of conf/serve.yaml; `adapt=true` turns it on). Read by the server and by the trainer
(train/adapt/loop.py), which gets it in ADAPT_DIR/adapt.json."""

from __future__ import annotations

from dataclasses import dataclass

COUNTS: tuple[str, ...] = ("publish_every", "steps", "batch_size", "ttt_steps", "threads", "rollback_window")
COUNTS += ("max_length", "min_clients", "client_cap")  # settings that must be >= 1


@dataclass
class AdaptConfig:
    dir: str = "runs/serve-adapt"  # the workspace: capture/, versions/, live.json, trainer.jsonl
    capture_gb: float = 2.0  # the capture store's cap; past it the oldest requests go first
    trainer: bool = True  # start the trainer beside the server (false: capture and hot swap only)
    publish_every: int = 32  # captured requests between the trainer's rounds
    holdout: float = 0.25  # each client's fraction of its requests (picked by a hash of the prompt) held back to judge
    steps: int = 60  # optimizer steps per round
    batch_size: int = 4
    lr: float = 2e-4
    ttt_steps: int = 3  # the loss's training-time-test steps (the draft depths a round trains)
    replay: str | None = None  # a feature cache of the drafter's original training data; None: no replay (warned)
    replay_ratio: float = 1.0  # replay examples per captured training example in a round
    threads: int = 1  # the trainer's torch threads; it runs at the lowest CPU priority
    # a candidate is published when its paired held-out tau gain, averaged over the judging groups, exceeds this and
    # no group loses more than this. Above 0: a swap empties the prefix cache (its salt names the drafter) and risks
    # a live window, and a few dozen held-back requests cannot resolve a smaller gain (docs/serving.md)
    min_gain: float = 0.02
    min_clients: int = 2  # judging groups a candidate needs: clients with held-back requests, plus replay when set
    client_cap: int = 64  # captured requests kept per client; past it that client's oldest go first
    rollback_window: int = 16  # captured requests a new version serves before the trainer judges it on them
    rollback_margin: float = 0.0  # rolled back when its paired tau on them < the previous version's - this
    max_length: int = 512  # the trainer's tokens per example (a longer one keeps a window from its answer's start)
    seed: int = 0  # the trainer's sampling of examples and replay, offset by the round

    def __post_init__(self) -> None:
        if self.capture_gb <= 0:
            raise ValueError(f"adaptation.capture_gb must be > 0, got {self.capture_gb}")
        for key in COUNTS:
            if getattr(self, key) < 1:
                raise ValueError(f"adaptation.{key} must be >= 1, got {getattr(self, key)}")
        if not 0 < self.holdout < 1:
            raise ValueError(f"adaptation.holdout must be in (0, 1), got {self.holdout}")
        if not self.lr > 0:
            raise ValueError(f"adaptation.lr must be > 0, got {self.lr}")
        if self.replay_ratio < 0 or self.rollback_margin < 0 or self.min_gain < 0:
            raise ValueError("adaptation.replay_ratio, rollback_margin and min_gain must be >= 0")
