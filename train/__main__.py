"""draftsmith-train: train a drafter for a target (hydra app; also under `accelerate launch -m draftsmith.train`,
or `accelerate launch train/` from a checkout)."""

from __future__ import annotations

import os
import runpy
import sys

if not __package__:  # run as a folder or file (`accelerate launch train/ ...`): run the installed package instead
    here = os.path.dirname(os.path.abspath(__file__))  # its modules (data, log, ...) would shadow top-level ones
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    runpy.run_module("draftsmith.train", run_name="__main__", alter_sys=True)
    sys.exit()

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from .launch import relaunch, requested_cpu_processes  # noqa: E402


@hydra.main(config_path="../conf", config_name="train", version_base=None)
def _main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from draftsmith.serve.shared.cli import typed_or_exit

    from .config import RunConfig
    from .trainer import train

    run = typed_or_exit(cfg, RunConfig, "draftsmith-train")
    hc = HydraConfig.get()
    if hc.mode == RunMode.MULTIRUN:  # each sweep job in out/<job number>
        run.out = hc.runtime.output_dir
    train(run)


def main() -> None:
    n = requested_cpu_processes()
    if n > 1:  # `accelerate launch --cpu --num_processes n` started only this process
        sys.exit(relaunch(n, "draftsmith.train"))
    _main()


if __name__ == "__main__":
    main()
