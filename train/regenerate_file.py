"""The file of regenerated conversations: JSON lines {"id", "messages", "generator", "truncated"}, appended and
fsynced one finished conversation at a time under a file lock. A rerun skips the ids already there (a killed run
resumes, nothing is duplicated) and cuts a torn last line.

`generator` says who wrote the answers (engine, version, dtype, sampling, the target's id); `truncated` lists the
assistant turns (0 = the first answer) that stopped at the token limit rather than at an end of turn. Both are
optional, so a plain {"id", "messages"} file reads too. Shards (`NAME.shard<i>-of-<n>.jsonl`, written by other
machines) beside the file are merged into it in input order.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from .jsonl import complete_rows

BAD_ROW = (
    "is not a row of regenerated answers ({id, messages}): this file is not an answers file; point "
    "data.regenerate.out at a new path (nothing was written to this one)"
)
TORN = b'{"id": '  # how every row append_row writes starts: only such a line can be one cut off mid-write


def parse_rows(data: bytes, path: Path) -> tuple[dict[str, dict], int]:
    """id -> row of the complete rows, and the byte length they span (a torn last line excluded)."""
    rows, end = complete_rows(data, path, is_answer_row, BAD_ROW, TORN)
    return {row["id"]: row for row in rows}, end


def is_answer_row(row: dict) -> bool:
    return isinstance(row.get("id"), str) and isinstance(row.get("messages"), list)


def read_rows(path: Path) -> dict[str, dict]:
    return parse_rows(path.read_bytes(), path)[0] if path.is_file() else {}


@contextmanager
def locked_output(path: Path) -> Iterator[tuple[BinaryIO, dict[str, dict]]]:
    """The file open for appending under an exclusive lock (a second writer waits, then finds the rows done),
    and its rows; a torn last line, left by a kill mid-write, is cut off first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        data = f.read()
        rows, end = parse_rows(data, path)
        f.truncate(end)
        if end and not data[:end].endswith(b"\n"):  # a last row someone else wrote without its newline
            f.write(b"\n")
        yield f, rows


def append_row(f: BinaryIO, row: dict) -> None:
    row = {"id": row["id"], **row}  # id first: a line cut off mid-write starts with TORN
    f.write((json.dumps(row, ensure_ascii=False) + "\n").encode())
    f.flush()
    os.fsync(f.fileno())


def merge_into(path: Path, parts: list[Path], order: list[str]) -> int:
    """Append the rows of `parts` that `path` lacks, in the order of `order` (ids elsewhere are left out);
    returns how many were appended."""
    found: dict[str, dict] = {}
    for part in parts:
        found.update(read_rows(part))
    added = 0
    with locked_output(path) as (f, rows):
        for conv_id in order:
            if conv_id in found and conv_id not in rows:
                append_row(f, found[conv_id])
                added += 1
    return added


def part_path(path: Path, rank: int, world: int) -> Path:
    """Where process `rank` of `world` (one run under accelerate) writes before rank 0 merges and deletes it."""
    return path.with_name(f"{path.stem}.part{rank}-of-{world}{path.suffix}")


def shard_path(path: Path, index: int, count: int) -> Path:
    """Where shard `index` of `count` (one machine's id range) is written; merged, never deleted."""
    return path.with_name(f"{path.stem}.shard{index}-of-{count}{path.suffix}")


def shards_beside(path: Path) -> list[Path]:
    pattern = re.compile(re.escape(path.stem) + r"\.shard\d+-of-\d+" + re.escape(path.suffix) + "$")
    return sorted(p for p in path.parent.glob(f"{path.stem}.shard*") if pattern.match(p.name))


def parse_shard(shard: str) -> tuple[int, int]:
    """`i/n` -> (i, n): shard i (from 0) of n."""
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", shard)
    if not match or not int(match[1]) < int(match[2]):
        raise ValueError(f"data.regenerate.shard must be i/n with 0 <= i < n (e.g. 0/4), got {shard!r}")
    return int(match[1]), int(match[2])


def shard_range(total: int, index: int, count: int) -> range:
    """Shard `index`'s contiguous slice of `total` conversations: the sizes differ by at most one."""
    return range(total * index // count, total * (index + 1) // count)
