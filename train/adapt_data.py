"""The adaptation trainer's examples: captured requests (ADAPT_DIR/capture, one request per shard, read so that a
missing, corrupt or misshapen shard is skipped, never fatal) and a seeded replay sample of the head's original
training features (a train/features.py cache), cut to one window each and mixed."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from .features import CachedFeatures

log = logging.getLogger(__name__)

Item = dict[str, Tensor]  # input_ids, loss_mask, hidden and (when the head reads layers) aux, as CachedFeatures'


@dataclass
class Shard:
    """One captured request as the manifest lists it."""

    file: str
    seq: int


@dataclass
class Split:
    """A manifest snapshot cut into training shards (older) and the held-back judging slice (newest)."""

    train: list[Shard]
    heldout: list[Shard]


@dataclass
class ReadResult:
    items: list[Item] = field(default_factory=list)
    skipped: int = 0


def listed_shards(manifest: dict) -> list[Shard]:
    """The manifest's shards, oldest first (by capture sequence number)."""
    shards = [Shard(s["file"], int(s.get("seq", i))) for i, s in enumerate(manifest.get("shards", []))]
    return sorted(shards, key=lambda s: s.seq)


def split_heldout(shards: list[Shard], holdout: float) -> Split:
    """The newest `holdout` fraction (at least one request) judges; the older rest trains."""
    if not shards:
        return Split([], [])
    held = min(len(shards), max(1, round(len(shards) * holdout)))
    return Split(shards[: len(shards) - held], shards[len(shards) - held :])


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


def replay_sample(cache: CachedFeatures | None, count: int, rng: random.Random) -> ReadResult:
    """`count` examples of the replay cache drawn without replacement (all of it when it holds fewer)."""
    out = ReadResult()
    if cache is None or count <= 0:
        return out
    for i in rng.sample(range(len(cache)), min(count, len(cache))):
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
