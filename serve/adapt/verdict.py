"""Verdict: the trainer's judgment of a live head version against the version it replaced, on the same requests.

Once a version has served `rollback_window` captured requests, the trainer scores it and the version before it on
exactly those requests (paired), each client's requests one group and each group one vote, and writes
verdicts/<version>.json; the server rolls the version back when the verdict says so. Live tau is not compared
across versions: each served other requests, from other clients, at other times.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields

from draftsmith.files import write_text_atomic
from draftsmith.serve.adapt.versions import Workspace, read_json


@dataclass
class Verdict:
    version: str  # the version judged (live when judged)
    against: str  # the version it replaced
    requests: int  # distinct requests it served, judged by both
    gain: float  # the mean over groups of (its tau - the other's tau) on each group's requests
    roll_back: bool
    groups: dict[str, dict] = field(default_factory=dict)  # client -> requests, tau, tau_against

    def write(self, ws: Workspace) -> None:
        ws.verdicts.mkdir(parents=True, exist_ok=True)
        write_text_atomic(ws.verdicts / f"{self.version}.json", json.dumps(asdict(self), indent=1) + "\n")

    @staticmethod
    def read(ws: Workspace, version: str) -> Verdict | None:
        """The verdict on `version`, None before there is one (or while it is unreadable: the trainer rewrites it)."""
        data = read_json(ws.verdicts / f"{version}.json")
        if data is None:
            return None
        known = {f.name for f in fields(Verdict)}
        try:
            return Verdict(**{k: v for k, v in data.items() if k in known})
        except TypeError:
            return None
