"""The `draftsmith-train` config: the `train` group (TrainConfig) and the whole command (RunConfig)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from draftsmith.serve.models.target import TargetConfig
from draftsmith.serve.shared.wandb_run import WandbConfig

from .data import DataConfig
from .features import FeatureConfig
from .head import HeadConfig


@dataclass
class TrainConfig:
    """Mirrors the hydra group `train` (presets quick, full)."""

    name: str = "quick"
    epochs: int = 1
    max_steps: int | None = None  # optimizer steps; null = epochs x steps per epoch
    batch_size: int = 4  # examples per process per micro-batch
    grad_accum: int = 1
    lr: float = 3e-4
    optimizer: str = (
        "adamw"  # adamw | muon: Muon for the head's hidden matrices, AdamW for the rest (train/optimizer.py)
    )
    schedule: str = "cosine"  # cosine | linear: after the warmup, down to lr * min_lr_ratio
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1  # the schedule decays to lr * min_lr_ratio
    max_grad_norm: float = 0.5
    mixed_precision: str | None = None  # auto | no | bf16 | fp16; null = what `accelerate launch` / its config says
    # auto: bf16 where the device runs it natively (CUDA, AVX512-BF16/AMX CPUs), else no
    log_every: int = 10
    checkpoint_every: int = 200
    keep_checkpoints: int = 2
    eval_every: int = 0  # acceptance on held-out prompts every N steps (0 = off) and at the end
    eval_prompts: int = 4  # the eval drafts the shape the head is made for (head.draft)
    eval_max_new_tokens: int = 32
    num_workers: int = 0
    seed: int = 0
    loss_on: str = "answers"  # answers: the assistant tokens (the loss mask) | all: every token of the example
    # batches of examples of like length (less padding), as transformers' Trainer; each batch's loss still counts
    # alike, so a short example's tokens weigh more than in shuffled batches
    group_by_length: bool = False
    features: FeatureConfig = field(default_factory=FeatureConfig)

    def __post_init__(self) -> None:  # when the config is built: before the target loads or features are made
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"train.max_steps must be >= 1 (null: epochs x steps per epoch), got {self.max_steps}")
        for key in ("epochs", "batch_size", "grad_accum", "log_every", "checkpoint_every", "keep_checkpoints"):
            if getattr(self, key) < 1:
                raise ValueError(f"train.{key} must be >= 1, got {getattr(self, key)}")
        if self.eval_every < 0 or self.warmup_steps < 0 or self.num_workers < 0:
            e, w, n = self.eval_every, self.warmup_steps, self.num_workers
            raise ValueError(f"train.eval_every, warmup_steps and num_workers must be >= 0, got {e}, {w} and {n}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"train.lr must be a positive number, got {self.lr}")
        if self.optimizer not in ("adamw", "muon") or self.schedule not in ("cosine", "linear"):
            o, sch = self.optimizer, self.schedule
            raise ValueError(
                f"train.optimizer must be adamw or muon and train.schedule cosine or linear, got {o}, {sch}"
            )
        if self.loss_on not in ("answers", "all"):
            raise ValueError(f"train.loss_on must be answers or all, got {self.loss_on!r}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"train.betas must be two numbers in [0, 1), e.g. [0.9, 0.95], got {list(self.betas)}")


@dataclass
class RunConfig:
    """The whole `draftsmith-train` config (conf/train.yaml)."""

    out: str
    target: TargetConfig = field(default_factory=TargetConfig)
    head: HeadConfig = field(default_factory=HeadConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    resume: bool = False  # continue from the newest good checkpoint in out/checkpoints
    imports: list[str] = field(default_factory=list)  # modules to import first (custom head kinds and losses)

    def __post_init__(self) -> None:
        if self.data.regenerate.answers > 1 and not self.data.regenerated:
            raise ValueError(
                f"data.regenerate.answers={self.data.regenerate.answers} draws answers by regeneration: set "
                "data.regenerated=true, or drop it (the source's answers are one per conversation)"
            )
