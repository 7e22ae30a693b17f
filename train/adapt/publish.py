"""Publishing a head version (the workspace's layout: serve/adapt/versions.py): written as versions/.vNNNN.partial,
renamed to versions/vNNNN, then LATEST replaced; a trainer killed anywhere leaves LATEST naming a complete folder,
and the next start deletes what a killed one left half-written (Workspace.clean_partials)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from draftsmith.serve.adapt.versions import Workspace, version_name

log = logging.getLogger(__name__)


@dataclass
class VersionRecord:
    """versions/vNNNN/version.json."""

    version: int
    parent: int
    time: float
    trained_on: dict  # captured, replay, steps
    heldout: dict  # requests, tau_candidate, tau_parent


def publish(ws: Workspace, record: VersionRecord, write_drafter: Callable[[Path], object]) -> str:
    """write_drafter(folder) fills the partial folder; then version.json, the rename, and LATEST."""
    name = version_name(record.version)
    partial = ws.versions / f".{name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    write_drafter(partial)
    (partial / "version.json").write_text(json.dumps({**asdict(record), "time": record.time or time.time()}) + "\n")
    os.replace(partial, ws.versions / name)
    ws.publish(name)
    log.info("published %s", name)
    return name
