"""What every command's main shares: a hydra config typed into its dataclass, a bad setting ending the command
with a one-line message."""

from __future__ import annotations

import sys
from collections.abc import Callable

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException


def typed(cfg: DictConfig, schema: type):
    """Hydra config -> dataclass; unknown keys and wrong types are errors."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), cfg))


def typed_or_exit(cfg: DictConfig, schema: type, prog: str, *checks: Callable[[DictConfig], None]):
    """typed() after `checks` of the raw config, a bad or missing setting ending the command with its one-line
    message, not a traceback."""
    try:
        for check in checks:
            check(cfg)
        return typed(cfg, schema)
    except MissingMandatoryValue as e:
        sys.exit(f"{prog}: missing mandatory value: {e.full_key}; pass {e.full_key}=...")
    except (ValueError, OmegaConfBaseException) as e:
        sys.exit(f"{prog}: {str(e).strip().splitlines()[0]}")
