"""DIR/records.jsonl: every finished (prompt, repeat) of an eval, appended and flushed as it finishes, so a crash,
a kill or Ctrl-C loses no finished prompt and `resume=true` continues the run. DIR/run.json holds the settings
the records were made with; a resume with other settings is refused."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from draftsmith.files import write_text_atomic
from draftsmith.serve.engine.metrics import Metrics

from .aggregate import Record
from .results import SkippedTurn as Skip  # results.json's skipped turns are the journal's

RECORDS, RUN = "records.jsonl", "run.json"
# what a finished run writes next to its records (runner.py, report.py, plots.py): a fresh run removes them first,
# so a run killed before it finishes is never read as the earlier run's results
OUTPUTS = (
    "results.json",
    "outputs.jsonl",
    "per_prompt.jsonl",
    "report.md",
    "acceptance.png",
    "speedup_by_category.png",
    "study.png",
)


@dataclass
class Unit:
    """One prompt in one repeat, answered by every arm."""

    id: str
    repeat: int
    records: list[Record]
    skipped: list[Skip]


def unit_line(u: Unit) -> str:
    return (
        json.dumps(
            {
                "id": u.id,
                "repeat": u.repeat,
                "records": [asdict(r) for r in u.records],
                "skipped": [asdict(s) for s in u.skipped],
            }
        )
        + "\n"
    )


def parse_unit(row: dict) -> Unit:
    records = [Record(**{**r, "metrics": Metrics(**r["metrics"])}) for r in row["records"]]
    return Unit(row["id"], row["repeat"], records, [Skip(**s) for s in row["skipped"]])


class Journal:
    def __init__(self, out: Path, settings: dict, resume: bool):
        self.path, self.run = Path(out) / RECORDS, Path(out) / RUN
        self.units = self.resume(settings) if resume else self.start(settings)

    def start(self, settings: dict) -> list[Unit]:
        if unfinished(self.path.parent):
            raise ValueError(
                f"{self.path.parent} holds an unfinished eval ({RECORDS} without a complete results.json): "
                "continue it with resume=true, or give another out=DIR"
            )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.unlink(missing_ok=True)
        for name in OUTPUTS:
            (self.path.parent / name).unlink(missing_ok=True)
        write_text_atomic(self.run, json.dumps(settings, indent=2, sort_keys=True) + "\n")
        return []

    def resume(self, settings: dict) -> list[Unit]:
        if not self.run.is_file():
            raise FileNotFoundError(f"resume=true but {self.run} is missing: nothing to resume in {self.path.parent}")
        saved = json.loads(self.run.read_text())
        unrecorded = sorted(settings.keys() - saved.keys())  # settings an older draftsmith did not record
        changed = sorted(k for k in saved.keys() | settings.keys() if saved.get(k) != settings.get(k))
        changed = [k for k in changed if k not in unrecorded]
        if changed or unrecorded:
            why = [f"was run with other settings ({', '.join(changed)})"] * bool(changed)
            why += [f"was run by an older draftsmith, which did not record {', '.join(unrecorded)}"] * bool(unrecorded)
            raise ValueError(
                f"resume=true: {self.path.parent} {'; it '.join(why)}; resume with the same settings, or give "
                "another out=DIR"
            )
        return [parse_unit(json.loads(line)) for line in intact_lines(self.path)]

    def done(self) -> set[tuple[str, int]]:
        return {(u.id, u.repeat) for u in self.units}

    def append(self, unit: Unit) -> None:
        with open(self.path, "a") as f:
            f.write(unit_line(unit))
            f.flush()
            os.fsync(f.fileno())
        self.units.append(unit)


def intact_lines(path: Path, mend: bool = True) -> list[str]:
    """The file's JSON lines; a torn last line (a kill mid-write) is left out, and cut from the file where `mend`
    (a reader of a run that may still be writing passes False); a bad line before it is an error naming it."""
    if not path.is_file():
        return []
    lines = path.read_text().splitlines(keepends=True)
    for n, line in enumerate(lines, 1):
        if not whole(line):
            if n < len(lines):
                raise ValueError(f"{path}:{n} is not a record line: delete {path.parent} or give another out=DIR")
            if mend:
                path.write_text("".join(lines[:-1]))
            return lines[:-1]
    return lines


def whole(line: str) -> bool:
    try:
        json.loads(line)
    except json.JSONDecodeError:
        return False
    return line.endswith("\n")


def unfinished(out: Path) -> bool:
    """out holds records of a run whose results.json is missing or partial."""
    if not (out / RECORDS).is_file():
        return False
    try:
        return bool(json.loads((out / "results.json").read_text()).get("partial", True))
    except (OSError, json.JSONDecodeError):
        return True
