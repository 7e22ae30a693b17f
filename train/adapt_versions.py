"""The adaptation workspace's files as the trainer sees them (the contract with draftsmith-serve): the capture
manifest, live.json, versions/vNNNN drafter folders and versions/LATEST. A version is published atomically: written
as versions/.vNNNN.partial, renamed to versions/vNNNN, then LATEST replaced; a trainer killed anywhere leaves LATEST
naming a complete folder, and the next start deletes what a killed one left half-written."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from draftsmith.heads.files import write_text_atomic

log = logging.getLogger(__name__)

VERSION = re.compile(r"^v(\d{4,})$")


@dataclass
class Workspace:
    root: Path

    @property
    def capture(self) -> Path:
        return self.root / "capture"

    @property
    def versions(self) -> Path:
        return self.root / "versions"

    @property
    def latest(self) -> Path:
        return self.versions / "LATEST"

    @property
    def journal(self) -> Path:
        return self.root / "trainer.jsonl"

    def read_json(self, path: Path) -> dict | None:
        """A JSON file the server writes atomically; None when it is absent or unreadable (not written yet)."""
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return None
        return data if isinstance(data, dict) else None

    def manifest(self) -> dict | None:
        return self.read_json(self.capture / "manifest.json")

    def live_version(self) -> str:
        """live.json's "live" (the server's choice, after any rollback), else v0000; never a rejected version."""
        live = self.read_json(self.root / "live.json") or {}
        name = live.get("live")
        rejected = live.get("rejected") or []
        if isinstance(name, str) and VERSION.match(name) and name not in rejected and (self.versions / name).is_dir():
            return name
        return "v0000"

    def next_version(self) -> int:
        """One past the highest complete version (a version renamed into place before LATEST moved counts too)."""
        numbers = [int(m.group(1)) for p in self.versions.iterdir() if (m := VERSION.match(p.name))]
        return max(numbers, default=0) + 1

    def clean_partials(self) -> list[str]:
        """Delete what a killed trainer left half-written: .vNNNN.partial folders and their temp folders."""
        removed = [p.name for p in self.versions.iterdir() if p.name.startswith(".") and ".partial" in p.name]
        for name in removed:
            shutil.rmtree(self.versions / name, ignore_errors=True)
        return removed

    def append_journal(self, row: dict) -> None:
        with self.journal.open("a") as f:
            f.write(json.dumps(row) + "\n")


@dataclass
class VersionRecord:
    """versions/vNNNN/version.json."""

    version: int
    parent: int
    time: float
    trained_on: dict  # captured, replay, steps
    heldout: dict  # requests, tau_candidate, tau_parent


def version_name(n: int) -> str:
    return f"v{n:04d}"


def version_number(name: str) -> int:
    m = VERSION.match(name)
    if m is None:
        raise ValueError(f"{name!r} is not a version folder name (vNNNN)")
    return int(m.group(1))


def publish(ws: Workspace, record: VersionRecord, write_drafter: Callable[[Path], object]) -> str:
    """write_drafter(folder) fills the partial folder; then version.json, the rename, and LATEST."""
    name = version_name(record.version)
    partial = ws.versions / f".{name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    write_drafter(partial)
    (partial / "version.json").write_text(json.dumps({**asdict(record), "time": record.time or time.time()}) + "\n")
    os.replace(partial, ws.versions / name)
    write_text_atomic(ws.latest, name + "\n")
    log.info("published %s", name)
    return name
