"""JSON-lines files written one row at a time (self-distilled answers, training metrics): a kill mid-write leaves
a torn last line, which readers drop and writers cut off."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path


def complete_rows(data: bytes, path: Path, valid: Callable[[dict], bool], bad: str) -> tuple[list[dict], int]:
    """The rows of the file's complete lines, and the byte length they span; a torn (or unfinished) last line is
    left out. Any other line that is not a valid row is an error: `{path}:{line} {bad}`."""
    rows, end = [], 0
    lines = data.splitlines(keepends=True)
    for n, line in enumerate(lines, 1):
        row = parse_line(line)
        if row is None or not valid(row):
            if n < len(lines):
                raise ValueError(f"{path}:{n} {bad}")
            continue
        rows.append(row)
        end += len(line)
    return rows, end


def parse_line(line: bytes) -> dict | None:
    """The JSON object on a line that ends with its newline, else None."""
    try:
        row = json.loads(line)
    except ValueError:  # includes a UnicodeDecodeError
        return None
    return row if line.endswith(b"\n") and isinstance(row, dict) else None
