"""draftsmith-serve target=... spec=... port=N: the engine behind an OpenAI-compatible chat-completions endpoint."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig, ListConfig

from draftsmith.serve.http.config import ServeConfig
from draftsmith.serve.http.server import serve
from draftsmith.serve.shared.cli import typed_or_exit


def keys_as_list(cfg: DictConfig) -> None:
    """api_key=KEY, one key, is taken as api_key=[KEY]."""
    if cfg.get("api_key") is not None and not isinstance(cfg.api_key, ListConfig):
        cfg.api_key = [str(cfg.api_key)]


@hydra.main(config_path="../../conf", config_name="serve", version_base=None)
def _main(cfg: DictConfig) -> None:
    serve(typed_or_exit(cfg, ServeConfig, "draftsmith-serve", keys_as_list))


def main() -> None:
    _main()


if __name__ == "__main__":
    main()
