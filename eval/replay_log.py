"""draftsmith-replay's log: JSON lines, appended and flushed one at a time (a killed run keeps what it had).

Each run starts with a header line, {"run": {settings, "started"}}; then one line per request, in the order they
ended: run (its header's number in the file), index (the order it was sent in), id, turn, repeat, scheduled_s and
sent_s (from the run's start), status ("ok", "http 503", "connection error") and error, latency_s, ttft_s (streamed
requests: the first text chunk), prompt_tokens, completion_tokens, finish_reason, draftsmith (the response's
statistics), text. read_log reads every run of a file back, requests in the order they were sent.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any


class LogWriter:
    def __init__(self, path: str | Path, settings: dict) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.run = len(read_log(self.path).runs) if self.path.is_file() else 0
        self.file: IO[str] = open(self.path, "a", encoding="utf-8")
        self.write({"run": {**settings, "number": self.run}})

    def write(self, line: dict) -> None:
        self.file.write(json.dumps(line, ensure_ascii=False) + "\n")
        self.file.flush()

    def request(self, line: dict) -> None:
        self.write({"run": self.run, **line})

    def close(self) -> None:
        self.file.close()


@dataclass
class ReplayLog:
    path: str
    runs: list[dict]  # each run's header: its settings
    requests: list[dict]  # every request line, by (run, index)

    def duration_s(self) -> float:
        """The runs' wall time added up: each from its start to its last request's end."""
        ends: dict[int, float] = {}
        for r in self.requests:
            end = r["sent_s"] + (r["latency_s"] or 0.0)
            ends[r["run"]] = max(ends.get(r["run"], 0.0), end)
        return sum(ends.values())


def read_log(path: str | Path) -> ReplayLog:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"replay log {path} does not exist: draftsmith-replay out={path} writes one")
    runs: list[dict] = []
    requests: list[dict] = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        row = parse_line(line, f"{path}:{lineno}")
        if isinstance(row.get("run"), dict):
            runs.append(row["run"])
        else:
            requests.append(row)
    if not runs and requests:
        raise ValueError(f"{path} has no run header: it is not a draftsmith-replay log")
    requests.sort(key=lambda r: (r["run"], r["index"]))
    return ReplayLog(str(path), runs, requests)


def parse_line(line: str, where: str) -> dict[str, Any]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:  # a run killed mid-write leaves its last line cut: say where
        raise ValueError(f"{where}: not valid JSON ({e.msg}); delete the cut line and read the log again") from e
    needed = ("run", "index", "sent_s", "status")
    if not isinstance(row, dict) or not (isinstance(row.get("run"), dict) or all(k in row for k in needed)):
        raise ValueError(f"{where}: not a draftsmith-replay line (a run header, or a request with {needed})")
    return row
