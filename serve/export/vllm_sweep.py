"""A measured draft-length sweep through vLLM, as peers/vllm_concurrency.py records it in its results.json
(the `draft_lengths` entry), and read back by the export card and draftsmith-eval, which recommend from it."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from draftsmith.serve.export.draft_lengths import Choice, Point, one_line, recommend, speculative_options

KEY = "draft_lengths"
SWEEP_COMMAND = "bash scripts/vllm_concurrency.sh --export EXPORT --k 1 2 3"


class SweepError(ValueError):
    """A sweep results.json that cannot be read or carries no draft-length sweep."""


@dataclass
class Sweep:
    """Where and how the points were measured, and the points (the recommendation is derived, never stored)."""

    method: str  # vLLM's speculative method that was served
    model: str  # the export folder served
    machine: str  # CPU model, its speed flags, cores
    vllm: str  # vLLM's version
    date: str  # UTC, when the sweep finished
    default_k: int | None  # the K the export's card asks for at every load (None: unknown)
    points: list[Point] = field(default_factory=list)
    source: str = ""  # the results.json it was read from

    def choices(self) -> list[Choice]:
        return recommend(self.points)

    def origin(self) -> str:
        return f"vLLM {self.vllm} on {self.machine}, {self.date}"

    def line(self) -> str:
        """The recommendation in one line, with where it was measured and the --speculative-config keys for it."""
        choices = self.choices()
        options = speculative_options(choices)
        keys = f"; --speculative-config keys {json.dumps(options)}" if options else ""
        return f"vLLM draft length by concurrency ({self.origin()}, {self.source}): {one_line(choices)}{keys}"


def record(sweep: Sweep) -> dict:
    """The `draft_lengths` entry of results.json."""
    return {k: v for k, v in asdict(sweep).items() if k != "source"}


def read_sweep(path: str | Path) -> Sweep:
    """A sweep from its results.json; SweepError naming the problem and the fix."""
    path = Path(path).expanduser()
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise SweepError(f"{path} does not exist: give the results.json that `{SWEEP_COMMAND}` writes") from e
    except (OSError, json.JSONDecodeError) as e:
        raise SweepError(f"{path} is not readable JSON ({e}): give a sweep's results.json") from e
    entry = data.get(KEY) if isinstance(data, dict) else None
    if not isinstance(entry, dict):
        raise SweepError(
            f"{path} has no `{KEY}` entry: it is not a draft-length sweep (a sweep of one K from before draft "
            f"lengths were compared is not enough); run `{SWEEP_COMMAND}` and give its results.json"
        )
    try:
        points = [Point(**p) for p in entry["points"]]
        sweep = Sweep(**{k: v for k, v in entry.items() if k != "points"}, points=points, source=str(path))
    except (KeyError, TypeError) as e:
        raise SweepError(f"{path}: its `{KEY}` entry is malformed ({type(e).__name__}: {e}); re-run the sweep") from e
    if not points:
        raise SweepError(f"{path}: the sweep measured no point; re-run it with at least one --k and --concurrency")
    return sweep
