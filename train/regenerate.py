"""Regeneration: the target answers each conversation's user turns itself, turn by turn (each
answer is fed back before the next user turn), so a drafter learns what the target says, not what the source's
model said.

The answers come from vLLM's offline batched generation where it is installed (train/regenerate_vllm.py), else from
draftsmith's own decoders (train/regenerate_backends.py). They are appended to a JSONL file one finished conversation
at a time (train/regenerate_file.py): a rerun skips the ids already there. Scale-out is by id range: each machine
writes its shard (`data.regenerate.shard=i/n`), and whoever trains merges the shards found beside the file.

    draftsmith-regenerate data.max_conversations=600 data.max_length=512
    draftsmith-regenerate data.regenerate.shard=0/4 data.regenerate.out=answers.jsonl    # one machine of four
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from draftsmith.serve.models.target import LoadedTarget, TargetConfig, keyed_cache_path
from draftsmith.serve.shared.conversations import Conversation, Skipped, provenance

from .data import ANSWER_FIELDS, RECORDED_WHEN_ON, DataConfig, RegenerateConfig, answer_settings
from .features import source_stamp
from .fidelity import FidelityCheck
from .regenerate_backends import describe, open_backend, uses_own
from .regenerate_file import (
    append_row,
    locked_output,
    merge_into,
    parse_shard,
    part_path,
    read_rows,
    shard_path,
    shard_range,
    shards_beside,
)
from .regenerate_vllm import VllmUnavailable, VllmWorker, find_vllm_python
from .turns import Chat, draws, prepare

TREE_ROOM = 8  # context left free for the engine's draft tree
FOREIGN_FILE = "point data.regenerate.out at another file, or ask for the settings it was made with"


@dataclass
class Regenerated:
    """What one run wrote: conversations and new tokens, how long it took, and who answered."""

    conversations: int = 0
    tokens: int = 0
    seconds: float = 0.0
    generator: dict = field(default_factory=dict)
    cut_short: int = 0  # conversations whose context filled before their last user turn (kept, answered so far)
    rejected: int = 0  # conversations stopped at a later turn the chat template rejects (kept, answered so far)
    ended_at_cut: int = 0  # conversations ended at an answer cut at the token limit (end_at_cut; kept)
    answers: int = 0
    truncated: int = 0  # answers that stopped at the token limit (kept, marked in their rows)
    looped: int = 0  # answers with fewer than half their 6-grams unique (turns.loops)
    start_s: float = 0.0  # the backend's start (vLLM's engine and its compile)
    draws: int = 1  # rows per source conversation (data.regenerate.answers): `conversations` counts rows

    def __str__(self) -> str:
        if not self.conversations:
            return "nothing to regenerate: every conversation was already answered"
        rows = f"{self.conversations} conversations"
        if self.draws > 1:
            rows = f"{self.conversations} rows of {self.draws} draws per conversation"
        rate = self.tokens / max(self.seconds, 1e-9)
        start = f" (+{self.start_s:.0f} s to start it)" if self.start_s >= 1 else ""
        rejected = f", {self.rejected} stopped at a turn the chat template rejects" if self.rejected else ""
        cut = f", {self.ended_at_cut} ended at a cut answer before their last user turn" if self.ended_at_cut else ""
        return (
            f"regenerated {rows} ({self.tokens} new tokens) in {self.seconds:.0f} s, "
            f"{rate:.0f} tok/s, by {describe(self.generator)}{start}; of {self.answers} answers "
            f"{self.truncated} ({share(self.truncated, self.answers)}) hit the token limit and {self.looped} "
            f"({share(self.looped, self.answers)}) loop (fewer than half their 6-grams unique); {self.cut_short} "
            f"conversations filled max_length before their last user turn{rejected}{cut} (all kept)"
        )


def share(part: int, whole: int) -> str:
    return f"{100 * part / max(whole, 1):.0f}%"


def row_of(chat: Chat, generator: dict) -> dict:
    row = {"id": chat.id, "messages": chat.messages, "generator": generator}
    return row | ({"truncated": chat.truncated} if chat.truncated else {})


def generate_into(
    path: Path,
    todo: list[tuple[Chat, list[int]]],
    target: LoadedTarget,
    cfg: RegenerateConfig,
    limit: int,
    show: bool,
    cache_dir: str | None = None,
    say: Callable[[str], None] = print,
    then: Callable[[VllmWorker | None], None] = lambda _: None,
) -> Regenerated:
    """The answers to `todo` appended to `path`; `then(its vLLM worker or None)` runs once all are written, before
    the backend closes (the fidelity check may ask the same vLLM)."""
    with locked_output(path) as (f, rows):
        todo = [(chat, ids) for chat, ids in todo if chat.id not in rows]
        if not todo:
            return Regenerated()
        backend = open_backend(target, cfg, limit, path.with_suffix(".vllm.log"), cache_dir, say)
        done = Regenerated(generator=backend.generator, start_s=backend.start_s, draws=cfg.answers)
        began = time.perf_counter()
        try:
            with tqdm(total=len(todo), desc="regenerate", unit="conv", disable=not show, dynamic_ncols=True) as bar:
                for finished, new_tokens in backend.answer(todo):
                    for chat in finished:
                        append_row(f, row_of(chat, backend.generator))
                    done.conversations += len(finished)
                    done.answers += sum(chat.turn for chat in finished)
                    done.truncated += sum(len(chat.truncated) for chat in finished)
                    done.looped += sum(chat.looped for chat in finished)
                    done.cut_short += sum(chat.stopped == "max_length" for chat in finished)
                    done.rejected += sum(chat.stopped == "template" for chat in finished)
                    done.ended_at_cut += sum(chat.stopped == "cut" for chat in finished)
                    done.tokens += new_tokens
                    done.seconds = time.perf_counter() - began
                    bar.set_postfix(tok_s=f"{done.tokens / done.seconds:.0f}", refresh=False)
                    bar.update(len(finished))
            say(str(done))
            then(backend.worker)
        finally:
            backend.close()
        return done


# ---- entry points


def regenerate(
    convs: list[Conversation],
    target: LoadedTarget,
    cfg: RegenerateConfig,
    path: Path,
    max_length: int,
    skipped: Skipped,
    rank: int = 0,
    world: int = 1,
    barrier: Callable[[], None] = lambda: None,
    cache_dir: str | None = None,
    say: Callable[[str], None] = print,
    done: Callable[[Regenerated], None] = lambda _: None,
) -> list[Conversation]:
    """`convs` with the target's answers (input order, data.regenerate.answers draws of each; the unanswerable ones
    counted in `skipped`), generated into `path` where not there already (shards beside it merged in first). Over
    several processes the own
    decoder deals every world-th conversation to each rank's part file, which rank 0 then appends to `path`;
    vLLM runs on rank 0 alone (it takes every core, or every GPU it is given). With data.regenerate.shard=i/n only
    the i-th of n contiguous slices is answered, into the shard's own file. `done` hears what this process
    regenerated (its rows, tokens and time; not rows merged in from shards)."""
    if not convs:
        raise ValueError("regeneration got no conversations: check data.source and data.max_conversations")
    limit = min(max_length, target.model.config.max_position_embeddings - TREE_ROOM)
    todo = prepare(draws(convs, cfg.answers), target.tokenizer, limit, skipped)
    order = [chat.id for chat, _ in todo]
    if rank == 0 and not cfg.shard and (shards := shards_beside(path)):
        for shard in shards:
            check_shard(shard, target.target_id, cfg)
        merge_into(path, shards, order)
    barrier()
    own, mine = path, todo
    if cfg.shard:
        if world > 1:
            raise ValueError(
                "data.regenerate.shard is for the regeneration command run once per machine, not under DDP"
            )
        index, count = parse_shard(cfg.shard)
        own, mine = shard_path(path, index, count), [todo[i] for i in shard_range(len(todo), index, count)]
        wanted = {chat.id for chat, _ in mine}
    elif world > 1:  # vLLM takes the machine on rank 0; without it the own decoder splits the work
        split = uses_own(cfg, str(target.model.device)) or (cfg.backend == "auto" and not vllm_found(cfg, cache_dir))
        mine = [t for i, t in enumerate(todo) if i % world == rank] if split else (todo if rank == 0 else [])
        own = part_path(path, rank, world) if split else path
    there = read_rows(path)
    # a file keyed by these settings holds them; one named by data.regenerate.out (or a shard or part beside it,
    # whose rows a resumed run keeps) may not
    check_made_alike(path, there, target.target_id, cfg, FOREIGN_FILE)
    if own != path:
        check_made_alike(own, read_rows(own), target.target_id, cfg, FOREIGN_FILE)
    mine = [t for t in mine if t[0].id not in there]
    if mine:
        quiet = say if rank == 0 else lambda _: None
        check = FidelityCheck(target, convs, cfg, own.with_suffix(".fidelity.json"), cache_dir, say)
        made = generate_into(own, mine, target, cfg, limit, rank == 0, cache_dir, quiet, check.on_worker)
        check.after(made.generator)
        done(made)
    if world > 1:
        barrier()
        if rank == 0 and split:
            parts = [part_path(path, r, world) for r in range(world)]
            merge_into(path, parts, order)
            for part in parts:
                part.unlink(missing_ok=True)
        barrier()
    rows = read_rows(path) | (read_rows(own) if cfg.shard else {})  # a shard's ids may be in the file already
    out = [conversation(rows[i]) for i in order if i in rows and (not cfg.shard or i in wanted)]
    if not out:
        raise ValueError(f"regeneration left no conversation to train on (skipped: {skipped})")
    return out


def vllm_found(cfg: RegenerateConfig, cache_dir: str | None) -> bool:
    try:
        find_vllm_python(cfg.vllm_python, cache_dir)
    except VllmUnavailable:
        return False
    return True


def check_made_alike(path: Path, rows: dict[str, dict], target_id: str, cfg: RegenerateConfig, fix: str) -> None:
    """Rows are used only if written by this target with these answer settings (a setting a row does not record,
    written before it existed, is not judged)."""
    wanted = {k: getattr(cfg, k) for k in (*ANSWER_FIELDS, *RECORDED_WHEN_ON)} | {"target": target_id}
    for row in rows.values():
        if not isinstance(made := row.get("generator"), dict):
            continue  # nothing recorded to judge
        generator = dict.fromkeys(RECORDED_WHEN_ON, False) | made
        differ = {k: generator[k] for k, v in wanted.items() if k in generator and generator[k] != v}
        if differ:
            raise ValueError(
                f"{path} holds answers made with {differ}, but this run asks for "
                f"{ {k: wanted[k] for k in differ} }: {fix}"
            )


def check_shard(shard: Path, target_id: str, cfg: RegenerateConfig) -> None:
    check_made_alike(shard, read_rows(shard), target_id, cfg, "move it away, or regenerate it with these settings")


def conversation(row: dict) -> Conversation:
    return Conversation(row["id"], row["messages"], *provenance(row))


def answers_path(data: DataConfig, target: LoadedTarget, cache_dir: str | None) -> Path:
    """data.regenerate.out, else <cache_root(cache_dir)>/regenerate/<target>-<key hash>.jsonl, keyed by what changes the
    answers (not max_conversations: a run with more conversations appends to the same file)."""
    if data.regenerate.out:
        return Path(data.regenerate.out).expanduser()
    key = {
        "target": target.target_id,
        "source": data.source,
        "source_stamp": source_stamp(data.source),
        "max_length": data.max_length,
        "chat_template": hashlib.sha256((target.tokenizer.chat_template or "").encode()).hexdigest()[:12],
        **answer_settings(data.regenerate),
    }
    return adopt_legacy(keyed_cache_path(cache_dir, "regenerate", target.target_id, key, ".jsonl"))


LEGACY_GROUP = "distill"  # the cache group regenerated answers were kept in before it was named for regeneration


def adopt_legacy(path: Path) -> Path:
    """path, with the answers (whole, sharded or in parts, and their logs) that an older draftsmith kept under the
    legacy group moved beside it when it has none of its own, so no regenerated answer is lost or made again."""
    pattern = path.stem + ".*"  # the answers, a shard's or a part's, their logs
    if path.parent.is_dir() and any(path.parent.glob(pattern)):
        return path
    for f in sorted((path.parent.parent / LEGACY_GROUP).glob(pattern)):
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(f, path.parent / f.name)
        except FileNotFoundError:  # another process of the run moved it first
            pass
    return path


@dataclass
class RegenerateRun:
    """`draftsmith-regenerate` (conf/regenerate.yaml): the train split of `data`, answered by `target`."""

    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)


def run(cfg: RegenerateRun) -> Path:
    from draftsmith.serve.models.target import load_target
    from draftsmith.serve.shared.conversations import load_conversations

    data = cfg.data
    convs, skipped = load_conversations(data.source, data.heldout_fraction, limit=data.max_conversations)
    target = load_target(cfg.target, offline=True)
    path = answers_path(cfg.data, target, cfg.target.cache_dir)
    out = regenerate(convs, target, data.regenerate, path, data.max_length, skipped, cache_dir=cfg.target.cache_dir)
    answers = sum(m["role"] == "assistant" for c in out for m in c.messages)
    written = shard_path(path, *parse_shard(data.regenerate.shard)) if data.regenerate.shard else path
    print(f"{len(out)} conversations ({answers} answers by {target.target_id}) in {written}; skipped: {skipped}")
    return written


def main() -> None:
    import hydra
    from omegaconf import DictConfig

    from draftsmith.serve.shared.cli import typed_or_exit

    @hydra.main(config_path="../conf", config_name="regenerate", version_base=None)
    def _main(cfg: DictConfig) -> None:
        try:
            run(typed_or_exit(cfg, RegenerateRun, "draftsmith-regenerate"))
        except VllmUnavailable as e:  # its cause and its log's path are in the one line
            sys.exit(f"draftsmith-regenerate: {e}")

    _main()


if __name__ == "__main__":
    main()
