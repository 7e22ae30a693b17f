"""A W&B run for training and eval alike (offline unless WANDB_MODE says): its hydra group and its start."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class WandbConfig:
    enabled: bool = True
    project: str = "draftsmith"
    name: str | None = None  # default: <head>-<target>-<train preset>
    group: str | None = None
    tags: list[str] = field(default_factory=list)


def start_wandb(out: Path, cfg: WandbConfig, run_config: dict, name: str, tags: list[str], run_id: str | None):
    import wandb

    return wandb.init(
        project=cfg.project,
        name=cfg.name or name,
        tags=[*tags, *cfg.tags],
        group=cfg.group,
        config=run_config,
        dir=str(out),
        id=run_id,
        resume="allow" if run_id else None,
        # wandb checks the mode itself; its stub types it as a Literal, which an environment variable is not
        mode=os.environ.get("WANDB_MODE") or "offline",  # type: ignore[arg-type]
        settings=wandb.Settings(quiet=True),
    )
