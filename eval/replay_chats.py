"""What draftsmith-replay sends: chats read from a JSONL file (OpenAI `messages` lines, or the prompt-file lines of
docs/design.md) or taken from a packaged suite.

A `messages` line is one request, sent as it is. A prompt line's user `turns` are sent in order: turns=first sends
the first turn alone; turns=all sends each later turn after the earlier turns and the model's answers to them, as a
multi-turn chat does (so a server's prefix cache sees a real conversation).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith.serve.shared.conversations import utf8_line

from .prompts import Prompt, parse_prompt
from .suites import SuiteConfig, load_suite

ROLES = {"system", "developer", "user", "assistant"}
TURNS = ("first", "all")


@dataclass
class Chat:
    id: str
    messages: list[dict] = field(default_factory=list)  # sent as they are (a `messages` line) ...
    turns: list[str] = field(default_factory=list)  # ... or user turns, each answered before the next is sent

    @property
    def requests(self) -> int:
        return len(self.turns) or 1


def from_prompt(p: Prompt, turns: str) -> Chat:
    return Chat(p.id, turns=p.turns[:1] if turns == "first" else list(p.turns))


def parse_chat(line: str, where: str, turns: str) -> Chat:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg})") from e
    if isinstance(row, dict) and "messages" in row:
        return Chat(str(row.get("id", where)), messages=check_messages(row["messages"], where))
    return from_prompt(parse_prompt(line, where), turns)


def check_messages(messages: object, where: str) -> list[dict]:
    ok = isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages)
    if not ok:
        raise ValueError(f"{where}: `messages` must be a non-empty list of {{role, content}} objects")
    assert isinstance(messages, list)
    for i, m in enumerate(messages):
        if m.get("role") not in ROLES or "content" not in m:
            raise ValueError(
                f"{where}: messages[{i}] needs a role ({', '.join(sorted(ROLES))}) and a content, got {m!r}"
            )
    return messages


def read_chats(path: str | Path, turns: str) -> list[Chat]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"chats={path} does not exist: pass a JSONL file of chats, or suite=mt_bench")
    chats = []
    for lineno, raw in enumerate(path.read_bytes().splitlines(), 1):
        line = utf8_line(raw, f"{path}:{lineno}")
        if line.strip():
            chats.append(parse_chat(line, f"{path}:{lineno}", turns))
    if not chats:
        raise ValueError(f"chats={path} is empty: add JSON lines with `messages` (or `id` and `turns`)")
    return chats


def load_chats(chats: str | None, suite: SuiteConfig | None, turns: str, limit: int | None) -> list[Chat]:
    """The chats of exactly one source, the first `limit` of them (a suite's taken round-robin over categories)."""
    if turns not in TURNS:
        raise ValueError(f"turns must be one of {', '.join(TURNS)}, got {turns!r}")
    if (chats is None) == (suite is None):
        raise ValueError("pass exactly one of chats=FILE.jsonl or suite=mt_bench|humaneval|sharegpt")
    if suite is not None:
        return [from_prompt(p, turns) for p in load_suite(suite, limit)]
    assert chats is not None
    found = read_chats(chats, turns)
    return found[:limit] if limit else found
