"""Prompt files (docs/design.md, Formats): JSON lines with `id`, optional `category`, and `turns` or `prompt`."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from draftsmith.serve.shared.conversations import utf8_line


@dataclass
class Prompt:
    id: str
    turns: list[str]  # user messages, answered in turn with the chat template
    raw: bool = False  # True: a single raw-text prompt, no template
    category: str = "default"


def load_prompts(path: str | Path, limit: int | None = None) -> list[Prompt]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompts file {path} does not exist")
    prompts = []
    for lineno, raw in enumerate(path.read_bytes().splitlines(), 1):
        line = utf8_line(raw, f"{path}:{lineno}")
        if line.strip():
            prompts.append(parse_prompt(line, f"{path}:{lineno}"))
    if not prompts:
        raise ValueError(f"prompts file {path} is empty: add JSON lines with `id` and `turns` or `prompt`")
    ids = [p.id for p in prompts]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"{path}: id {dup!r} appears more than once; ids must be unique")
    return prompts[:limit] if limit else prompts


def prompts_hash(prompts: list[Prompt]) -> str:
    """What the prompts say (an edited file or another suite version changes it), for resume and compare."""
    return hashlib.sha256(json.dumps([asdict(p) for p in prompts], sort_keys=True).encode()).hexdigest()[:16]


def parse_prompt(line: str, where: str) -> Prompt:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg})") from e
    if not isinstance(row, dict) or "id" not in row:
        raise ValueError(f"{where}: each line must be a JSON object with an `id`")
    category = str(row.get("category") or "default")
    if "turns" in row:
        turns = row["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise ValueError(f"{where}: `turns` must be a non-empty list of non-empty strings")
        return Prompt(str(row["id"]), turns, False, category)
    if isinstance(row.get("prompt"), str) and row["prompt"].strip():
        return Prompt(str(row["id"]), [row["prompt"]], True, category)
    raise ValueError(f"{where}: needs `turns` (list of user messages) or `prompt` (non-empty raw text)")
