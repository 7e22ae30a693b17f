"""draftsmith-serve target=... spec=... port=N: the engine behind an OpenAI-compatible chat-completions endpoint."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from draftsmith.serve.http.config import ServeConfig
from draftsmith.serve.http.server import serve
from draftsmith.serve.shared.cli import typed_or_exit


@hydra.main(config_path="../../conf", config_name="serve", version_base=None)
def _main(cfg: DictConfig) -> None:
    serve(typed_or_exit(cfg, ServeConfig, "draftsmith-serve"))


def main() -> None:
    _main()


if __name__ == "__main__":
    main()
