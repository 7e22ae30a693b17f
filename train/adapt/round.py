"""One round of online adaptation: snapshot the capture store, fine-tune the live head on the captured requests mixed
with a replay sample of its original training data, judge the candidate against the live head on the same held-back
requests (each client's, and the replay cache's judging sample: one group each, train/adapt/groups.py), and publish it
as the next version when it gains more than min_gain over the groups and loses no more than that on any."""

from __future__ import annotations

import inspect
import logging
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from draftsmith.heads.drafter_folder import (
    Recipe,
    TargetInfo,
    config_hash,
    load_token_counts,
    read_drafter,
    read_meta,
    save_drafter,
)
from draftsmith.heads.kinds import DraftShape, get
from draftsmith.serve.adapt.config import AdaptConfig
from draftsmith.serve.adapt.versions import Workspace, read_json, version_name, version_number
from draftsmith.serve.drafters import target_info
from draftsmith.serve.models.target import LoadedTarget, native_bf16

from ..batch import FeatureBatch
from ..dataset import pad_id
from ..features import MANIFEST, CachedFeatures, collate
from ..trainer import feature_batch, loss_for
from .data import (
    Item,
    ReadResult,
    Shard,
    by_client,
    listed_shards,
    read_captured,
    read_replay,
    replay_pools,
    replay_sample,
    split_heldout,
    window,
)
from .gate import Shape
from .groups import REPLAY, as_rows, mean_gain, refusal, score_groups, too_few
from .publish import VersionRecord, publish

log = logging.getLogger(__name__)

MAX_GRAD_NORM = 0.5  # as draftsmith-train's default


class Abandoned(Exception):
    """The round was stopped (SIGTERM) before it published anything."""


@dataclass
class Trainer:
    """What every round reads: the workspace, the settings, the target (whose embedding and lm_head the head
    borrows) and the replay cache."""

    ws: Workspace
    options: AdaptConfig
    target: LoadedTarget
    replay: CachedFeatures | None


@dataclass
class TrainerState:
    """What carries from round to round."""

    round: int = 0
    last_seq: int = -1  # the newest capture sequence number a round has seen
    optimizer_state: dict | None = None
    optimizer_base: str | None = None  # the version whose weights that optimizer state continues from
    stop: bool = False  # set by SIGTERM: the round in progress is abandoned


@dataclass
class RoundResult:
    round: int
    base: str
    captured: int = 0
    replay: int = 0
    skipped: int = 0
    heldout: int = 0
    steps: int = 0
    loss: float | None = None
    tau_candidate: float | None = None  # the mean over the judging groups
    tau_live: float | None = None
    clients: list[str] = field(default_factory=list)  # the clients whose requests it trained on
    groups: dict[str, dict] = field(default_factory=dict)  # judging group -> requests, tau_base, tau_candidate, gain
    published: str | None = None
    reason: str = ""
    cpu_s: float = 0.0
    time: float = field(default_factory=time.time)


@dataclass
class Head:
    """A drafter version as a module, with what publishing its successor keeps from it."""

    name: str
    module: nn.Module
    meta: dict

    @property
    def kind(self) -> str:
        return self.meta["kind"]

    @property
    def layers(self) -> tuple[int, ...]:
        config = get(self.kind).config
        assert config is not None, "a drafter folder is of a trained kind"
        return get(self.kind).target_layers(config(**self.meta["config"]))


def load_head(trainer: Trainer, name: str) -> Head:
    """versions/<name> as a trainable fp32 module borrowing the target's pieces."""
    folder = trainer.ws.versions / name
    module = read_drafter(folder, target_info(trainer.target), trainer.target.model, device="cpu")
    return Head(name, module, read_meta(folder))


def open_replay(folder: str | None, target_id: str, layers: tuple[int, ...]) -> CachedFeatures | None:
    """The replay feature cache, refused with the fix when it cannot serve the head."""
    if folder is None:
        log.warning("adaptation.replay is not set: training on captured requests only (the head may forget)")
        return None
    path = Path(folder).expanduser()
    manifest = read_json(path / MANIFEST)
    if manifest is None:
        raise ValueError(
            f"adaptation.replay={folder} holds no readable {MANIFEST}: point it at the feature cache the head was "
            "trained on (<cache root>/features/<target>-<key>), or set it to null"
        )
    if config_hash(str(manifest.get("target", ""))) != config_hash(target_id):
        raise ValueError(f"adaptation.replay={folder} was made for {manifest.get('target')}, not {target_id}")
    if not set(layers) <= set(manifest.get("layers", [])):
        raise ValueError(f"adaptation.replay={folder} stores layers {manifest.get('layers')}; the head reads {layers}")
    return CachedFeatures(path, manifest, layers)


def loss_options(loss_fn, options: AdaptConfig) -> dict:
    """ttt_steps for a loss that takes it (EAGLE-3's); every other option at the loss's default."""
    return {"ttt_steps": options.ttt_steps} if "ttt_steps" in inspect.signature(loss_fn).parameters else {}


def usable(items: list[Item], max_length: int) -> list[Item]:
    """Windows of at most max_length tokens, of examples that have a pair and a token to predict and answers."""
    out = [window(it, max_length) for it in items]
    return [it for it in out if it["input_ids"].shape[0] >= 3 and bool((it["loss_mask"][2:] > 0).any())]


def batches(items: list[Item], size: int, pad: int, trainer: Trainer, layers: tuple[int, ...]) -> list[FeatureBatch]:
    model = trainer.target.model
    groups = [collate(items[i : i + size], pad) for i in range(0, len(items), size)]
    return [feature_batch(g, model, layers, "cpu") for g in groups]


def fine_tune(
    trainer: Trainer, state: TrainerState, head: Head, items: list[Item], rng: random.Random
) -> tuple[float, int]:
    """options.steps AdamW steps of the kind's loss on batches drawn from items; the mean loss and the tokens."""
    opts, pad = trainer.options, pad_id(trainer.target.tokenizer)
    loss_fn = loss_for(head.kind)
    kwargs = loss_options(loss_fn, opts)
    params = [p for p in head.module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=opts.lr, weight_decay=0.0)
    if state.optimizer_state is not None and state.optimizer_base == head.name:
        optimizer.load_state_dict(state.optimizer_state)
    head.module.train()
    fast_bf16 = native_bf16("cpu")  # bf16 autocast: ~1.7x a step on an AMX CPU; the weights and judging stay fp32
    losses, tokens = [], 0
    for _ in range(opts.steps):
        if state.stop:
            raise Abandoned
        picked = [items[i] for i in rng.choices(range(len(items)), k=opts.batch_size)]
        (batch,) = batches(picked, opts.batch_size, pad, trainer, head.layers)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=fast_bf16):
            loss, _ = loss_fn(head.module, batch, **kwargs)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
        optimizer.step()
        losses.append(loss.item())
        tokens += sum(it["input_ids"].shape[0] for it in picked)
    state.optimizer_state, state.optimizer_base = optimizer.state_dict(), head.name
    return sum(losses) / len(losses), tokens


def write_version(trainer: Trainer, parent: Head, candidate: Head, result: RoundResult, tokens: int):
    """The candidate as a drafter folder: target, config and draft shape as the parent's, a recipe of the round."""
    meta = parent.meta
    kind = get(meta["kind"])
    assert kind.config is not None, "a drafter folder is of a trained kind"
    recipe = Recipe(
        data=f"{parent.name} adapted on {result.captured} captured requests + {result.replay} replay examples",
        steps=result.steps,
        tokens=tokens,
        extra={"adapted_from": parent.name, "parent_recipe": meta.get("recipe", {})},
        acceptance={"tau_offline": result.tau_candidate, "source": "held-out captured requests, teacher-forced"},
    )
    folder = trainer.ws.versions / parent.name
    try:
        counts = load_token_counts(folder, trainer.target.model.config.vocab_size)
    except (FileNotFoundError, ValueError):
        counts = None
    info, config, draft = TargetInfo(**meta["target"]), kind.config(**meta["config"]), DraftShape(**meta["draft"])

    def write(out: Path) -> None:
        save_drafter(candidate.module, config, meta["kind"], info, recipe, out, counts, draft=draft)

    return write


def run_round(trainer: Trainer, state: TrainerState) -> RoundResult:
    """One round on a snapshot of the capture store; appends its line to trainer.jsonl."""
    ws = trainer.ws
    state.round += 1
    result = RoundResult(state.round, ws.live_version())
    try:
        train_and_judge(trainer, state, result)
    except Abandoned:
        result.reason = "abandoned: the trainer was stopped"
        raise
    except Exception as e:
        result.reason = f"failed: {type(e).__name__}: {e}"
        raise
    finally:
        result.cpu_s = round(time.process_time(), 2)
        ws.append_journal(asdict(result))
    return result


def train_and_judge(trainer: Trainer, state: TrainerState, result: RoundResult) -> None:
    ws, opts = trainer.ws, trainer.options
    manifest = ws.manifest() or {}
    shards = listed_shards(manifest)
    state.last_seq = max([s.seq for s in shards], default=state.last_seq)
    split = split_heldout(shards, opts.holdout)
    live = load_head(trainer, result.base)
    stored = list(manifest.get("layers", []))
    rng = random.Random(opts.seed + state.round)
    judge_pool, train_pool = replay_pools(trainer.replay, opts.holdout, opts.seed)
    train_shards = sorted(rng.sample(split.train, min(len(split.train), opts.steps * opts.batch_size)), key=seq)
    captured = read_captured(ws.capture, train_shards, live.layers, stored)
    replay = replay_sample(trainer.replay, round(opts.replay_ratio * len(captured.items)), rng, train_pool)
    groups, held_skipped = held_back(trainer, split.heldout, live.layers, stored, judge_pool)
    result.captured, result.replay = len(captured.items), len(replay.items)
    result.clients = sorted({s.client for s in train_shards})
    result.skipped = captured.skipped + held_skipped + replay.skipped
    result.heldout = sum(len(items) for items in groups.values())
    items = usable(captured.items + replay.items, opts.max_length)
    if not captured.items or not items:
        result.reason = "no readable captured training request"
        return
    if not groups:
        result.reason = "no readable held-out request to judge by"
        return
    if reason := too_few(list(groups), opts.min_clients):
        result.reason = reason  # refused before training: no gain could publish it
        return
    candidate = load_head(trainer, result.base)
    loss, tokens = fine_tune(trainer, state, candidate, items, rng)
    result.loss, result.steps = round(loss, 5), opts.steps
    pad = pad_id(trainer.target.tokenizer)
    batched = {name: batches(got, opts.batch_size, pad, trainer, live.layers) for name, got in groups.items()}
    sizes = {name: len(got) for name, got in groups.items()}
    scores = score_groups(candidate.module, live.module, batched, sizes, Shape.of(live.meta["draft"]))
    result.groups = as_rows(scores)
    result.tau_live = round(sum(s.tau_base for s in scores.values()) / len(scores), 4)
    result.tau_candidate = round(result.tau_live + mean_gain(scores), 4)
    if reason := refusal(scores, opts.min_clients, opts.min_gain):
        result.reason = reason
        return
    number = ws.next_version()
    record = VersionRecord(
        number,
        version_number(result.base),
        time.time(),
        {"captured": result.captured, "replay": result.replay, "steps": result.steps, "clients": result.clients},
        {"requests": result.heldout, "tau_candidate": result.tau_candidate, "tau_parent": result.tau_live}
        | {"groups": result.groups},
    )
    result.published = publish(ws, record, write_version(trainer, live, candidate, result, tokens))
    state.optimizer_base = result.published  # the optimizer state continues the published weights
    assert result.published == version_name(number)


def seq(shard: Shard) -> int:
    return shard.seq


def held_back(
    trainer: Trainer, shards: list[Shard], layers: tuple[int, ...], stored: list[int], replay_pool: list[int]
) -> tuple[dict[str, list[Item]], int]:
    """The judging groups' usable requests: each client's held-back ones, and as many of the replay cache's judging
    sample as the largest client group has; and how many could not be read."""
    groups: dict[str, list[Item]] = {}
    skipped = 0
    for client, own in by_client(shards).items():
        got = read_captured(trainer.ws.capture, own, layers, stored)
        skipped += got.skipped
        if judged := usable(got.items, trainer.options.max_length):
            groups[client] = judged
    if trainer.replay is not None and replay_pool:
        size = max((len(g) for g in groups.values()), default=0)
        got = read_replay(trainer.replay, replay_pool[:size]) if size else ReadResult()
        skipped += got.skipped
        if judged := usable(got.items, trainer.options.max_length):
            groups[REPLAY] = judged
    return groups, skipped
