"""draftsmith-train: train a drafter for a target (hydra app; also under `accelerate launch -m draftsmith.train`)."""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from .launch import relaunch, requested_cpu_processes


@hydra.main(config_path="../conf", config_name="train", version_base=None)
def _main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from draftsmith.serve.__main__ import typed

    from .trainer import RunConfig, train

    run = typed(cfg, RunConfig)
    run.out = HydraConfig.get().runtime.output_dir  # = out, or out/<job number> in a multirun sweep
    train(run)


def main() -> None:
    n = requested_cpu_processes()
    if n > 1:  # `accelerate launch --cpu --num_processes n` started only this process
        sys.exit(relaunch(n, "draftsmith.train"))
    _main()


if __name__ == "__main__":
    main()
