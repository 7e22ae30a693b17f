"""The rollback judgment, made by the trainer for the server: once the live version has served rollback_window
distinct captured requests, it and the version it replaced are scored on exactly those requests (paired, teacher-
forced as the publish gate scores, each client's requests one group and each group one vote), and the verdict is
written to verdicts/<version>.json (serve/adapt/verdict.py). The server rolls the version back when its mean gain
is below -rollback_margin. A version is judged once."""

from __future__ import annotations

import logging

from draftsmith.serve.adapt.verdict import Verdict
from draftsmith.serve.adapt.versions import read_json

from ..dataset import pad_id
from .data import Item, Shard, by_client, distinct, listed_shards, read_captured
from .gate import Shape
from .groups import as_rows, mean_gain, score_groups
from .round import Trainer, batches, load_head, usable

log = logging.getLogger(__name__)


def due_for_review(trainer: Trainer) -> tuple[str, str, list[Shard]] | None:
    """(live, previous, the distinct requests live served) when live awaits its verdict and has served enough."""
    ws = trainer.ws
    live = read_json(ws.live_file) or {}
    version, previous = live.get("live"), live.get("previous")
    if not isinstance(version, str) or not isinstance(previous, str) or Verdict.read(ws, version) is not None:
        return None
    served = distinct([s for s in listed_shards(ws.manifest() or {}) if s.version == version])
    return (version, previous, served) if len(served) >= trainer.options.rollback_window else None


def review(trainer: Trainer) -> Verdict | None:
    """The verdict on the live version, written; None when none is due (or nothing it served could be read)."""
    due = due_for_review(trainer)
    if due is None:
        return None
    version, previous, served = due
    new, old = load_head(trainer, version), load_head(trainer, previous)
    groups = served_groups(trainer, served, new.layers)
    if not groups:
        return None
    pad, size = pad_id(trainer.target.tokenizer), trainer.options.batch_size
    batched = {name: batches(items, size, pad, trainer, new.layers) for name, items in groups.items()}
    sizes = {name: len(items) for name, items in groups.items()}
    scores = score_groups(new.module, old.module, batched, sizes, Shape.of(new.meta["draft"]))
    gain = round(mean_gain(scores), 4)
    verdict = Verdict(version, previous, sum(sizes.values()), gain, gain < -trainer.options.rollback_margin)
    verdict.groups = as_rows(scores)
    verdict.write(trainer.ws)
    decision = "roll back" if verdict.roll_back else "keep"
    log.info("%s against %s on %d requests it served: %+.4f tau, %s", version, previous, len(served), gain, decision)
    return verdict


def served_groups(trainer: Trainer, served: list[Shard], layers: tuple[int, ...]) -> dict[str, list[Item]]:
    stored = list((trainer.ws.manifest() or {}).get("layers", []))
    groups = {}
    for client, own in by_client(served).items():
        if items := usable(read_captured(trainer.ws.capture, own, layers, stored).items, trainer.options.max_length):
            groups[client] = items
    return groups
