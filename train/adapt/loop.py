"""The adaptation trainer beside draftsmith-serve: `python -m draftsmith.train.adapt ADAPT_DIR`.

It reads everything from ADAPT_DIR/adapt.json (the target, the first drafter, the `adaptation` settings), runs at
the lowest CPU priority, polls the capture store, and once publish_every requests were captured since its last
round runs one (train/adapt/round.py), publishing versions the server swaps in; and once a new live version has served
rollback_window requests, it judges it against the version it replaced on them (train/adapt/review.py), which the
server rolls back on. SIGTERM abandons the round in progress; a half-written version is never visible
(train/adapt/publish.py).
"""

from __future__ import annotations

import argparse
import fcntl
import logging
import os
import signal
import time
from dataclasses import asdict, fields
from pathlib import Path

import torch

from draftsmith.serve.adapt.config import AdaptConfig
from draftsmith.serve.adapt.versions import Workspace, read_json
from draftsmith.serve.models.target import TargetConfig, load_target

from .data import listed_shards
from .review import review
from .round import Abandoned, Trainer, TrainerState, load_head, open_replay, run_round

log = logging.getLogger("draftsmith.train.adapt")

POLL_S = 1.5  # how often the capture manifest is read


def read_settings(root: Path) -> tuple[TargetConfig, AdaptConfig]:
    """adapt.json's target and options, refused with the fix when it is missing or malformed."""
    path = root / "adapt.json"
    data = read_json(path)
    if data is None or not isinstance(data.get("target"), dict):
        raise ValueError(f"{path} is missing or malformed: draftsmith-serve writes it before it starts the trainer")
    known = {f.name for f in fields(AdaptConfig)}
    options = {k: v for k, v in (data.get("options") or {}).items() if k in known}
    return TargetConfig(**data["target"]), AdaptConfig(**options)


def lower_priority(threads: int) -> None:
    """The trainer must never slow the server: lowest CPU priority (its autogroup too, where writable), few threads."""
    try:
        Path("/proc/self/autogroup").write_text("19")
    except OSError:
        pass
    os.nice(19)
    torch.set_num_threads(threads)


def start(root: Path) -> Trainer:
    """Settings, target (on the CPU), replay cache; the first drafter must load; stray partial versions go."""
    ws = Workspace(root)
    target_cfg, options = read_settings(root)
    lower_priority(options.threads)
    if not (ws.versions / "v0000").is_dir():
        raise FileNotFoundError(f"{ws.versions / 'v0000'} is missing: draftsmith-serve copies the drafter there first")
    removed = ws.clean_partials()
    if removed:
        log.warning("deleted half-written versions left by a stopped trainer: %s", ", ".join(removed))
    target = load_target(TargetConfig(**{**asdict(target_cfg), "device": "cpu"}))
    trainer = Trainer(ws, options, target, None)
    first = load_head(trainer, ws.live_version())
    trainer.replay = open_replay(options.replay, target.target_id, first.layers)
    return trainer


def due(trainer: Trainer, state: TrainerState) -> bool:
    """publish_every requests captured since the last round? Counted by capture sequence numbers: requests the
    store evicted since (a cap smaller than publish_every requests) count too."""
    manifest = trainer.ws.manifest()
    if manifest is None:
        return False
    shards = listed_shards(manifest)
    newest = int(manifest.get("capture", {}).get("next_seq", 0)) - 1
    newest = max([newest] + [s.seq for s in shards])
    return newest - state.last_seq >= trainer.options.publish_every and bool(shards)


def orphaned(parent: int) -> bool:
    """The server that started the trainer is gone (the trainer was re-parented): it stops too."""
    return parent > 1 and os.getppid() != parent


def hold_lock(ws: Workspace):
    """One trainer per workspace: an exclusive lock on trainer.lock, held while the process lives."""
    lock = (ws.root / "trainer.lock").open("w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        raise SystemExit(f"another trainer runs on {ws.root} (it holds trainer.lock): stop it first") from None
    return lock


def serve_rounds(trainer: Trainer, state: TrainerState, parent: int = 0) -> None:
    while not state.stop:
        if orphaned(parent):
            log.warning("the server that started this trainer is gone: stopping")
            return
        try:
            review(trainer)
        except Exception:  # a failed review is retried at the next poll; the server keeps the live version
            log.exception("reviewing the live version failed")
        if not due(trainer, state):
            time.sleep(POLL_S)
            continue
        try:
            result = run_round(trainer, state)
        except Abandoned:
            log.info("round %d abandoned: stopping", state.round)
            return
        except Exception:  # a bad round is logged (and journaled); the server keeps the live version
            log.exception("round %d failed", state.round)
            continue
        log.info("round %d: %s", result.round, result.published or result.reason)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m draftsmith.train.adapt", description=__doc__.split("\n")[0])
    parser.add_argument("adapt_dir", type=Path, help="draftsmith-serve's adaptation workspace")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s adapt %(levelname)s %(message)s")
    state = TrainerState()

    def stop(signum, frame) -> None:
        state.stop = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    parent = os.getppid()
    lock = hold_lock(Workspace(args.adapt_dir))
    trainer = start(args.adapt_dir)
    serve_rounds(trainer, state, parent)
    lock.close()
    log.info("stopped")
