"""JSON-lines files written one row at a time (regenerated answers, training metrics): a kill mid-write leaves
a torn last line, which readers drop and writers cut off."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path


def complete_rows(
    data: bytes, path: Path, valid: Callable[[dict], bool], bad: str, torn: bytes = b"{"
) -> tuple[list[dict], int]:
    """The rows of the file's lines, and the byte length they span. Only a last line that could be a row cut off
    mid-write (no newline, no JSON, starting with `torn`, how every row this writer makes starts) is left out; a
    last row whose newline is missing still counts. Any other line that is not a valid row is an error:
    `{path}:{line} {bad}`, and nothing is cut."""
    rows, end = [], 0
    lines = data.splitlines(keepends=True)
    for n, line in enumerate(lines, 1):
        row = parse_line(line)
        if row is None or not valid(row):
            if n == len(lines) and is_torn(line, torn):
                continue
            raise ValueError(f"{path}:{n} {bad}")
        rows.append(row)
        end += len(line)
    return rows, end


def is_torn(line: bytes, prefix: bytes) -> bool:
    if line.endswith(b"\n") or not line.startswith(prefix):
        return False
    try:
        json.loads(line)
    except ValueError:  # includes a UnicodeDecodeError
        return True
    return False  # whole JSON, just no newline: not torn (and not a row: the caller's error)


def parse_line(line: bytes) -> dict | None:
    """The JSON object on a line, else None."""
    try:
        row = json.loads(line)
    except ValueError:  # includes a UnicodeDecodeError
        return None
    return row if isinstance(row, dict) else None
