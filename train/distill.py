"""Self-distillation: the target answers each conversation's user turns itself, turn by turn (each answer is fed
back before the next user turn), so a drafter learns what the target says, not what the source's model said.

Output: JSONL rows {"id", "messages"}, appended and fsynced one finished conversation at a time, under a file
lock; a rerun skips the ids already there (a killed run resumes, nothing is duplicated) and cuts a torn last line.

batch_size 1 runs each turn through the engine (serve/) with lossless n-gram speculation (~1.5x plain decoding
on SmolLM2's answers here). Larger batches pay more: many conversations decode in lockstep on the same runner,
reading the weights once per step for all rows (16 rows cost ~2 single-row steps on this CPU). Not HF's batched
generate: it was slower side by side, and would hold a second copy of the target. Each row is prefilled alone as
the engine does (a later turn only past the chat's KV so far); a batched step's logits differ from batch 1's by
float rounding only, so greedy answers are the target's greedy answers up to near-ties.

    python -m draftsmith.train.distill data.max_conversations=100 data.distill.max_new_tokens=256
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from itertools import islice
from pathlib import Path
from typing import BinaryIO

import torch
from jinja2 import TemplateError
from tqdm import tqdm

from draftsmith.heads.kv_cache import KVCache
from draftsmith.heads.llama import Transformer
from draftsmith.serve.build import Loaded, SpecConfig, build_engine, encode_chat, eos_ids
from draftsmith.serve.conversations import Conversation, Skipped
from draftsmith.serve.draft_model import causal_mask
from draftsmith.serve.sampling import SamplingParams, pick
from draftsmith.serve.target import TargetConfig, keyed_cache_path

from .data import ANSWER_FIELDS, DataConfig, DistillConfig
from .features import source_stamp
from .jsonl import complete_rows

TREE_ROOM = 8  # context left free for the engine's draft tree


@dataclass
class Past:
    """A chat's tokens so far and their KV (each layer's K, then V: [kv_heads, n, head_dim]). The next turn's
    prompt extends them, so only its new tokens need a prefill."""

    ids: list[int]
    kv: list[torch.Tensor]


@dataclass
class Chat:
    """A conversation being re-answered: the runs of messages still to answer, the messages so far."""

    id: str
    segments: list[list[dict]]  # the non-assistant messages before each answer (each with a user turn)
    messages: list[dict] = field(default_factory=list)
    turn: int = 0
    past: Past | None = None  # kept between turns by the batched path

    def next_messages(self) -> list[dict] | None:
        return self.messages + self.segments[self.turn] if self.turn < len(self.segments) else None

    def add(self, answer: str) -> None:
        self.messages = self.next_messages() + [{"role": "assistant", "content": answer}]
        self.turn += 1


def user_segments(messages: list[dict]) -> list[list[dict]]:
    """Runs of non-assistant messages, each answered once. A run without a user turn (a system message between
    two answers) joins the next run; a trailing one is dropped."""
    segments, pending = [], []
    for m in [*messages, {"role": "assistant"}]:  # a closing answer ends the last run
        if m["role"] != "assistant":
            pending.append(m)
        elif any(p["role"] == "user" for p in pending):
            segments.append(pending)
            pending = []
    return segments


def turn_seed(seed: int, conv_id: str, turn: int) -> int:
    """A sampling seed per answer: a rerun (or a resume, in any batch) draws the same answer."""
    return int.from_bytes(hashlib.sha256(f"{seed}|{conv_id}|{turn}".encode()).digest()[:8], "big") >> 1


def next_prompt(chat: Chat, tokenizer, limit: int) -> list[int] | None:
    """The chat-encoded prompt of the chat's next answer; None when no user turn is left or the prompt leaves
    no room under `limit` (data.max_length: what follows would be cut from the training example anyway)."""
    messages = chat.next_messages()
    if messages is None:
        return None
    ids = encode_chat(tokenizer, messages)
    return ids if len(ids) < limit else None


def prepare(convs: list[Conversation], tokenizer, limit: int, skipped: Skipped) -> list[tuple[Chat, list[int]]]:
    """Each answerable conversation with its first prompt; the others counted in `skipped`."""
    out, seen = [], set()
    for conv in convs:
        if conv.id in seen:  # ids key the output file: a second row with the same id would be lost
            skipped.add("with a duplicate id")
            continue
        seen.add(conv.id)
        chat = Chat(conv.id, user_segments(conv.messages))
        if not chat.segments:
            skipped.add("without a user turn to answer")
            continue
        try:
            ids = next_prompt(chat, tokenizer, limit)
        except TemplateError:
            skipped.add("rejected by the chat template")
            continue
        if ids is None:
            skipped.add(f"whose first prompt fills max_length ({limit} tokens)")
            continue
        out.append((chat, ids))
    return out


# ---- generating


# chats, their prompts, token budgets -> each prompt's new tokens (an end-of-turn token included)
Generate = Callable[[list[Chat], list[list[int]], list[int]], list[list[int]]]


def engine_generate(target: Loaded, cfg: DistillConfig, limit: int) -> Generate:
    engine = build_engine(target, SpecConfig(cfg.spec), prefix_cache=False, max_seq_len=limit)
    sp = SamplingParams(cfg.temperature, cfg.top_p)

    def generate(chats: list[Chat], prompts: list[list[int]], budgets: list[int]) -> list[list[int]]:
        seeds = [turn_seed(cfg.seed, c.id, c.turn) for c in chats]
        rows = zip(prompts, budgets, seeds, strict=True)
        return [engine.generate(p, n, replace(sp, seed=s)).output_ids for p, n, s in rows]

    return generate


def batched_generate(target: Loaded, cfg: DistillConfig) -> Generate:
    sp, eos = SamplingParams(cfg.temperature, cfg.top_p), eos_ids(target)

    def generate(chats: list[Chat], prompts: list[list[int]], budgets: list[int]) -> list[list[int]]:
        seeds = [turn_seed(cfg.seed, c.id, c.turn) for c in chats]
        outs, pasts = generate_batch(target.model, prompts, budgets, sp, seeds, eos, [c.past for c in chats])
        for chat, past in zip(chats, pasts, strict=True):
            chat.past = past
        return outs

    return generate


@torch.inference_mode()
def generate_batch(
    model: Transformer,
    prompts: list[list[int]],
    budgets: list[int],
    sp: SamplingParams,
    seeds: list[int],
    eos,
    pasts: list[Past | None],
) -> tuple[list[list[int]], list[Past]]:
    """Decode all prompts in lockstep. Prompts sit right-aligned in one cache (row i's at slots [p - len, p)),
    each at its own positions; a row stops at an end-of-turn token or its budget (finished rows ride along).
    Returns the new tokens and each row's Past for its next turn."""
    b, p, dev = len(prompts), max(map(len, prompts)), model.device
    cache = batch_cache(model, b, p + max(budgets))
    valid = torch.zeros(b, p + max(budgets), dtype=torch.bool, device=dev)  # slots a row may attend to
    rows = zip(prompts, pasts, strict=True)
    logits = torch.stack([prefill_row(model, cache, i, q, p, valid, past) for i, (q, past) in enumerate(rows)])
    gens = [torch.Generator(dev).manual_seed(s) for s in seeds]
    lengths = torch.tensor([len(q) for q in prompts], device=dev)
    out, live = [[] for _ in range(b)], [True] * b
    for t in range(max(budgets)):
        nxt = logits.argmax(-1).tolist() if sp.greedy else [pick(r, sp, g) for r, g in zip(logits, gens, strict=True)]
        for i in range(b):
            if live[i]:
                out[i].append(nxt[i])
                live[i] = nxt[i] not in eos and len(out[i]) < budgets[i]
        if not any(live):
            break
        valid[:, p + t] = True
        logits = decode_step(model, cache, torch.tensor(nxt, device=dev), lengths + t, p + t, valid[:, : p + t + 1])
    return out, [row_past(cache, i, q, o, p) for i, (q, o) in enumerate(zip(prompts, out, strict=True))]


def batch_cache(model: Transformer, b: int, slots: int) -> KVCache:
    c = model.config
    shape = (b, c.num_key_value_heads, slots, c.head_dim)
    # zeros, not empty: masked slots still enter attention's weighted sum (with weight 0, and 0 * nan = nan)
    new = lambda: [torch.zeros(shape, dtype=model.dtype, device=model.device) for _ in range(c.num_hidden_layers)]
    return KVCache(new(), new())


def prefill_row(
    model: Transformer, cache: KVCache, i: int, prompt: list[int], p: int, valid, past: Past | None
) -> torch.Tensor:
    """The engine's own prefill of one prompt (after the tokens `past` already holds), its KV then copied into
    row i, right-aligned at slot p."""
    n, dev = len(prompt), model.device
    hit = min(common_prefix(past.ids, prompt), n - 1) if past else 0  # at least one token runs: the logits
    row = model.new_cache(n)
    if hit:
        row.write(0, [t[None, :, :hit] for t in past.kv])
    ids, positions = torch.tensor(prompt[hit:], device=dev), torch.arange(hit, n, device=dev)
    out = model(ids, positions, row, hit, causal_mask(hit, n - hit, dev), slice(-1, None))
    for big, small in zip((*cache.k, *cache.v), (*row.k, *row.v), strict=True):
        big[i, :, p - n : p] = small[0]
    valid[i, p - n : p] = True
    return out.logits[-1]


def row_past(cache: KVCache, i: int, prompt: list[int], out: list[int], p: int) -> Past:
    """Row i's prompt and new tokens but the last (which never ran), and their KV."""
    end = p + len(out) - 1
    return Past(prompt + out[:-1], [t[i, :, p - len(prompt) : end].clone() for t in (*cache.k, *cache.v)])


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def decode_step(model: Transformer, cache: KVCache, tokens, positions, slot: int, valid) -> torch.Tensor:
    """One token per row at cache slot `slot`; positions [b] per row, shaped [b, 1, 1] so rope broadcasts over
    heads."""
    b = tokens.shape[0]
    x, _ = model.layers_forward(tokens.view(b, 1), positions.view(b, 1, 1), cache, slot, valid.view(b, 1, 1, -1), ())
    return model.lm_head(model.model.norm(x[:, -1])).float()


def answer_all(
    todo: list[tuple[Chat, list[int]]], generate: Generate, cfg: DistillConfig, limit: int, tokenizer, eos
) -> Iterator[tuple[list[Chat], int]]:
    """Up to batch_size conversations in flight, one turn each per round; yields each round's finished chats and
    new tokens. A finished chat's place goes to a waiting one, so a kill loses at most batch_size chats' work."""
    waiting: Iterator = iter(todo)
    active: list[tuple[Chat, list[int]]] = []
    while True:
        active += islice(waiting, cfg.batch_size - len(active))
        if not active:
            return
        budgets = [min(cfg.max_new_tokens, limit - len(ids)) for _, ids in active]
        outs = generate([chat for chat, _ in active], [ids for _, ids in active], budgets)
        kept, finished = [], []
        for (chat, _), out in zip(active, outs, strict=True):
            chat.add(answer_text(tokenizer, out, eos))
            try:
                ids = next_prompt(chat, tokenizer, limit)
            except TemplateError:  # a later turn the template rejects: keep the answers so far
                ids = None
            if ids is None:
                chat.past = None
                finished.append(chat)
            else:
                kept.append((chat, ids))
        active = kept
        yield finished, sum(map(len, outs))


def answer_text(tokenizer, out: list[int], eos) -> str:
    return tokenizer.decode(out[:-1] if out and out[-1] in eos else out, skip_special_tokens=True)


# ---- the output file


def parse_rows(data: bytes, path: Path) -> tuple[dict[str, list], int]:
    """id -> messages of the complete rows, and the byte length they span (a torn last line excluded)."""
    bad = "is not a self-distillation row ({id, messages}): delete the file or set data.distill.out to another path"
    rows, end = complete_rows(data, path, is_answer_row, bad)
    return {row["id"]: row["messages"] for row in rows}, end


def is_answer_row(row: dict) -> bool:
    return isinstance(row.get("id"), str) and isinstance(row.get("messages"), list)


def read_rows(path: Path) -> dict[str, list]:
    return parse_rows(path.read_bytes(), path)[0] if path.is_file() else {}


@contextmanager
def locked_output(path: Path) -> Iterator[tuple[BinaryIO, dict[str, list]]]:
    """The file open for appending under an exclusive lock (a second writer waits, then finds the rows done),
    and its rows; a torn last line, left by a kill mid-write, is cut off first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        rows, end = parse_rows(f.read(), path)
        f.truncate(end)
        yield f, rows


def append_row(f: BinaryIO, conv_id: str, messages: list[dict]) -> None:
    f.write((json.dumps({"id": conv_id, "messages": messages}, ensure_ascii=False) + "\n").encode())
    f.flush()
    os.fsync(f.fileno())


def generate_into(
    path: Path, todo: list[tuple[Chat, list[int]]], target: Loaded, cfg: DistillConfig, limit: int, show: bool
) -> None:
    with locked_output(path) as (f, rows):
        todo = [(chat, ids) for chat, ids in todo if chat.id not in rows]
        if not todo:
            return
        generate = engine_generate(target, cfg, limit) if cfg.batch_size == 1 else batched_generate(target, cfg)
        began, tokens = time.perf_counter(), 0
        with tqdm(total=len(todo), desc="self-distill", unit="conv", disable=not show, dynamic_ncols=True) as bar:
            for finished, new_tokens in answer_all(todo, generate, cfg, limit, target.tokenizer, eos_ids(target)):
                for chat in finished:
                    append_row(f, chat.id, chat.messages)
                tokens += new_tokens
                bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - began):.1f}", refresh=False)
                bar.update(len(finished))


def merge_parts(path: Path, parts: list[Path], order: list[str]) -> None:
    """Append the part files' rows to `path` in input order, then delete the parts."""
    with locked_output(path) as (f, rows):
        found = {}
        for part in parts:
            found.update(read_rows(part))
        for conv_id in order:
            if conv_id in found and conv_id not in rows:
                append_row(f, conv_id, found[conv_id])
    for part in parts:
        part.unlink(missing_ok=True)


# ---- entry points


def distill(
    convs: list[Conversation],
    target: Loaded,
    cfg: DistillConfig,
    path: Path,
    max_length: int,
    skipped: Skipped,
    rank: int = 0,
    world: int = 1,
    barrier: Callable[[], None] = lambda: None,
) -> list[Conversation]:
    """`convs` with the target's answers (input order; the unanswerable ones counted in `skipped`), generated
    into `path` where not there already. Over several processes rank r answers every world-th conversation into
    a part file of its own, which rank 0 then appends to `path`."""
    if not convs:
        raise ValueError("self-distillation got no conversations: check data.source and data.max_conversations")
    limit = min(max_length, target.model.config.max_position_embeddings - TREE_ROOM)
    todo = prepare(convs, target.tokenizer, limit, skipped)
    there = read_rows(path)
    mine = [t for i, t in enumerate(todo) if i % world == rank and t[0].id not in there]
    own = path if world == 1 else part_path(path, rank, world)
    if mine:
        generate_into(own, mine, target, cfg, limit, show=rank == 0)
    if world > 1:
        barrier()
        if rank == 0:
            merge_parts(path, [part_path(path, r, world) for r in range(world)], [c.id for c, _ in todo])
        barrier()
    rows = read_rows(path)
    out = [Conversation(chat.id, rows[chat.id]) for chat, _ in todo if chat.id in rows]
    if not out:
        raise ValueError(f"self-distillation left no conversation to train on (skipped: {skipped})")
    return out


def part_path(path: Path, rank: int, world: int) -> Path:
    return path.with_name(f"{path.stem}.part{rank}-of-{world}{path.suffix}")


def distill_path(data: DataConfig, target: Loaded, cache_dir: str | None) -> Path:
    """data.distill.out, else <cache_root(cache_dir)>/distill/<target>-<key hash>.jsonl, keyed by what changes the
    answers (not max_conversations: a run with more conversations appends to the same file)."""
    if data.distill.out:
        return Path(data.distill.out).expanduser()
    key = {
        "target": target.target_id,
        "source": data.source,
        "source_stamp": source_stamp(data.source),
        "max_length": data.max_length,
        "chat_template": hashlib.sha256((target.tokenizer.chat_template or "").encode()).hexdigest()[:12],
        **{k: getattr(data.distill, k) for k in ANSWER_FIELDS},
    }
    return keyed_cache_path(cache_dir, "distill", target.target_id, key, ".jsonl")


@dataclass
class DistillRun:
    """`python -m draftsmith.train.distill` (conf/distill.yaml): the train split of `data`, answered by `target`."""

    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)


def run(cfg: DistillRun) -> Path:
    from draftsmith.serve.build import load
    from draftsmith.serve.conversations import load_conversations

    data = cfg.data
    convs, skipped = load_conversations(data.source, data.heldout_fraction, limit=data.max_conversations)
    target = load(cfg.target)
    path = distill_path(cfg.data, target, cfg.target.cache_dir)
    out = distill(convs, target, cfg.data.distill, path, cfg.data.max_length, skipped)
    answers = sum(m["role"] == "assistant" for c in out for m in c.messages)
    print(f"{len(out)} conversations ({answers} answers by {target.target_id}) in {path}; skipped: {skipped}")
    return path


def main() -> None:
    import hydra
    from omegaconf import DictConfig

    from draftsmith.serve.cli import typed_or_exit

    @hydra.main(config_path="../conf", config_name="distill", version_base=None)
    def _main(cfg: DictConfig) -> None:
        run(typed_or_exit(cfg, DistillRun, "python -m draftsmith.train.distill"))

    _main()


if __name__ == "__main__":
    main()
