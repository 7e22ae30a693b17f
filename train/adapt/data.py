"""The adaptation trainer's examples: captured requests (ADAPT_DIR/capture, one request per shard, read so that a
missing, corrupt or misshapen shard is skipped, never fatal) and a seeded replay sample of the head's original
training features (a train/features.py cache), cut to one window each and mixed.

Which requests judge: within each client's requests (identical prompts counted once), the fraction `holdout` picked
by a hash of the prompt, not by arrival: one client's burst of new requests is split like the rest of its traffic
instead of all judging, and it moves no other client's held-back requests. A replay cache's judging part is a fixed
seeded sample, never trained on in a round."""

from __future__ import annotations

import hashlib
import logging
import random
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from ..features import CachedFeatures

log = logging.getLogger(__name__)

REPLAY_JUDGED = 256  # the most replay examples kept from training to judge with (more only slows a round)
Item = dict[str, Tensor]  # input_ids, loss_mask, hidden and (when the head reads layers) aux, as CachedFeatures'


@dataclass
class Shard:
    """One captured request as the manifest lists it."""

    file: str
    seq: int
    client: str = "unknown"  # a store written before clients were recorded: one client
    prompt: str | None = None  # the prompt's digest (serve/adapt/capture.py)
    version: str | None = None  # the head version that served it

    @property
    def key(self) -> str:
        return self.prompt or self.file


@dataclass
class Split:
    """A manifest snapshot cut into training shards and the held-back judging slice."""

    train: list[Shard]
    heldout: list[Shard]


@dataclass
class ReadResult:
    items: list[Item] = field(default_factory=list)
    skipped: int = 0


def listed_shards(manifest: dict) -> list[Shard]:
    """The manifest's shards, oldest first (by capture sequence number)."""
    shards = [
        Shard(s["file"], int(s.get("seq", i)), str(s.get("client", "unknown")), s.get("prompt"), s.get("version"))
        for i, s in enumerate(manifest.get("shards", []))
    ]
    return sorted(shards, key=lambda s: s.seq)


def distinct(shards: list[Shard]) -> list[Shard]:
    """Identical prompts count once: the first of them stays."""
    seen: set[str] = set()
    out = []
    for s in shards:
        if s.key not in seen:
            seen.add(s.key)
            out.append(s)
    return out


def by_client(shards: list[Shard]) -> dict[str, list[Shard]]:
    groups: dict[str, list[Shard]] = defaultdict(list)
    for s in shards:
        groups[s.client].append(s)
    return dict(groups)


def split_heldout(shards: list[Shard], holdout: float) -> Split:
    """Per client, of its distinct prompts: the `holdout` fraction with the lowest prompt hashes judges (at least one
    of a client with two or more), the rest trains. Both lists stay oldest first."""
    held: set[str] = set()
    for own in by_client(distinct(shards)).values():
        count = min(len(own) - 1, max(1, round(len(own) * holdout))) if len(own) > 1 else 0
        held |= {s.key for s in sorted(own, key=lambda s: rank(s.key))[:count]}
    kept = distinct(shards)
    return Split([s for s in kept if s.key not in held], [s for s in kept if s.key in held])


def rank(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def read_captured(folder: Path, shards: list[Shard], layers: tuple[int, ...], stored: list[int]) -> ReadResult:
    """The requests of `shards` as items; each unreadable one is logged and counted, not raised."""
    out = ReadResult()
    for shard in shards:
        try:
            out.items.append(read_shard(folder / shard.file, layers, stored))
        except Exception as e:  # any damage to a file the server wrote is the file's problem, not the trainer's
            log.warning("capture shard %s skipped: %s", shard.file, e)
            out.skipped += 1
    return out


def read_shard(path: Path, layers: tuple[int, ...], stored: list[int]) -> Item:
    """One captured request, checked: keys, dtypes of ids and masks, and shapes agreeing with each other."""
    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    need = {"input_ids", "loss_mask", "offsets", "hidden", "have"} | ({"aux"} if layers else set())
    if missing := need - tensors.keys():
        raise ValueError(f"missing tensors {sorted(missing)}")
    ids, hidden = tensors["input_ids"], tensors["hidden"]
    n = ids.shape[0] if ids.dim() == 1 else -1
    if n < 1 or hidden.dim() != 2 or hidden.shape[0] != n:
        raise ValueError(f"input_ids {tuple(ids.shape)} and hidden {tuple(hidden.shape)} do not agree")
    if tensors["loss_mask"].shape != (n,) or tensors["have"].shape != (n,):
        raise ValueError("loss_mask or have is not one value per token")
    item = {"input_ids": ids.long(), "loss_mask": answer_mask(tensors["loss_mask"], tensors["have"]), "hidden": hidden}
    if layers:
        item["aux"] = pick_layers(tensors["aux"], n, hidden.shape[1], layers, stored)
    return from_first_run_row(item, tensors["have"])


def from_first_run_row(item: Item, have: Tensor) -> Item:
    """The request from its first row a forward ran: rows restored from the prefix cache are zeros, and a head
    attending over them as features would learn a context it never sees when it drafts."""
    run = torch.nonzero(have)
    if not run.numel():
        raise ValueError("no row of it was run by a forward")
    return {k: v[int(run[0]) :] for k, v in item.items()}


def answer_mask(loss_mask: Tensor, have: Tensor) -> Tensor:
    """The answer tokens whose target distribution is known: token t's comes from hidden[t - 1], a zero row where
    no forward ran it (have=0), so such tokens are not learned from or judged."""
    known = torch.cat([torch.zeros(1), have[:-1].float()])
    return loss_mask.float() * known


def pick_layers(aux: Tensor, n: int, width: int, layers: tuple[int, ...], stored: list[int]) -> Tensor:
    if aux.shape != (n, len(stored) * width):
        raise ValueError(f"aux {tuple(aux.shape)} is not {len(stored)} layers of {width} per token")
    index = [stored.index(x) for x in layers]
    return aux.view(n, len(stored), width)[:, index].reshape(n, -1)


def replay_pools(cache: CachedFeatures | None, holdout: float, seed: int) -> tuple[list[int], list[int]]:
    """(judging, training) example indices of the replay cache: a fixed seeded `holdout` fraction judges (none of a
    cache of one example), the rest may be trained on."""
    if cache is None:
        return [], []
    order = list(range(len(cache)))
    random.Random(seed).shuffle(order)
    judged = min(len(order) - 1, max(1, round(len(order) * holdout)), REPLAY_JUDGED) if len(order) > 1 else 0
    return order[:judged], order[judged:]


def replay_sample(cache: CachedFeatures | None, count: int, rng: random.Random, pool: list[int]) -> ReadResult:
    """`count` examples of the replay cache's `pool` drawn without replacement (all of it when it holds fewer)."""
    if cache is None or count <= 0:
        return ReadResult()
    return read_replay(cache, rng.sample(pool, min(count, len(pool))))


def read_replay(cache: CachedFeatures, indices: list[int]) -> ReadResult:
    out = ReadResult()
    for i in indices:
        try:
            out.items.append(cache[i])
        except Exception as e:
            log.warning("replay example %d skipped: %s", i, e)
            out.skipped += 1
    return out


def window(item: Item, max_length: int) -> Item:
    """At most max_length tokens: everything when it fits, else a window that starts one token before the answer
    (or ends at the last token, when less of the answer is left than that)."""
    n = item["input_ids"].shape[0]
    if n <= max_length:
        return item
    answer = torch.nonzero(item["loss_mask"] > 0)
    first = int(answer[0]) if answer.numel() else n - max_length
    start = max(0, min(first - 1, n - max_length))
    return {k: v[start : start + max_length] for k, v in item.items()}
