"""draftsmith-replay: send chats to a draftsmith-serve (or any OpenAI-compatible) endpoint at a set rate, with at
most `concurrency` in flight, and log one JSON line per request (eval/replay_log.py) for draftsmith-eval replay=LOG.

At a rate, chats arrive on a schedule (Poisson with a seed, or a fixed interval) whether or not earlier ones have
been answered (open loop); without one, each of `concurrency` slots sends its next chat when its last one ended
(closed loop). A chat of several turns sends them in order, each after the answer to the one before.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from itertools import count

import hydra
import numpy as np
import openai
from omegaconf import DictConfig
from tqdm import tqdm

from draftsmith.serve.shared.cli import typed_or_exit

from .replay_chats import Chat, load_chats
from .replay_client import Sampling, send
from .replay_config import ReplayConfig
from .replay_log import LogWriter

Unit = tuple[int, Chat]  # (repeat, chat)


class ServerDown(RuntimeError):
    """No server answers at base_url."""


@dataclass
class Run:
    """What every chat of one replay shares."""

    client: openai.AsyncOpenAI
    sampling: Sampling
    log: LogWriter
    bar: tqdm
    start: float
    index: count
    ok: int = 0
    failed: int = 0

    def now(self) -> float:
        return time.perf_counter() - self.start


def arrival_times(n: int, rate: float, arrivals: str, seed: int) -> list[float]:
    """Seconds from the start at which each of n chats is due."""
    if arrivals == "fixed":
        return [i / rate for i in range(n)]
    gaps = np.random.default_rng(seed).exponential(1 / rate, size=n)
    return list(np.concatenate([[0.0], np.cumsum(gaps[1:])]))


async def first_model(client: openai.AsyncOpenAI, url: str) -> str:
    """The server's first model, which also checks that one answers."""
    try:
        page = await client.models.list()
    except openai.APIConnectionError as e:
        raise ServerDown(
            f"no server answers at {url} ({e.__cause__ or e}): start one with `draftsmith-serve` (it serves "
            "http://127.0.0.1:8000/v1; port=N for another), or pass base_url=URL of a running one"
        ) from None
    if not page.data:
        raise ServerDown(f"the server at {url} lists no models (GET /models): pass model=NAME")
    return page.data[0].id


async def replay_chat(run: Run, unit: Unit, scheduled: float | None) -> None:
    repeat, chat = unit
    messages = list(chat.messages)
    for turn, ask in enumerate(chat.turns or [None]):
        if ask is not None:
            messages.append({"role": "user", "content": ask})
        index, sent = next(run.index), run.now()
        result = await send(run.client, messages, run.sampling)
        where = {"index": index, "id": chat.id, "turn": turn, "repeat": repeat, "scheduled_s": scheduled}
        run.log.request({**where, "sent_s": round(sent, 6), **result})
        run.bar.update(1)
        if result["status"] != "ok":
            run.failed += 1
            run.bar.total -= chat.requests - turn - 1  # later turns need this answer: not sent
            break
        run.ok += 1
        messages.append({"role": "assistant", "content": result["text"]})
        run.bar.set_postfix(ok=run.ok, failed=run.failed)


async def open_loop(run: Run, units: list[Unit], cfg: ReplayConfig) -> None:
    assert cfg.rate
    slots, tasks = asyncio.Semaphore(cfg.slots), []

    async def one(unit: Unit, due: float) -> None:
        try:
            await replay_chat(run, unit, round(due, 6))
        finally:
            slots.release()

    for unit, due in zip(units, arrival_times(len(units), cfg.rate, cfg.arrivals, cfg.seed), strict=True):
        await asyncio.sleep(max(0.0, due - run.now()))
        await slots.acquire()  # at most `concurrency` in flight: a due chat waits here, and is sent late
        tasks.append(asyncio.create_task(one(unit, due)))
    await asyncio.gather(*tasks)


async def closed_loop(run: Run, units: list[Unit], slots: int) -> None:
    queue = iter(units)

    async def slot() -> None:
        for unit in queue:
            await replay_chat(run, unit, None)

    await asyncio.gather(*(slot() for _ in range(slots)))


def settings(cfg: ReplayConfig, model: str, chats: int, requests: int) -> dict:
    source = {"chats": cfg.chats} if cfg.chats else {"suite": cfg.suite.name if cfg.suite else None}
    keep = ("base_url", "rate", "arrivals", "seed", "max_tokens", "temperature", "stream", "turns", "repeat")
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    total = {"chats_sent": chats, "requests_planned": requests, "concurrency": cfg.slots}
    return {**source, "model": model, **{k: getattr(cfg, k) for k in keep}, **total, "started": started}


async def replay(cfg: ReplayConfig, chats: list[Chat]) -> Run:
    client = openai.AsyncOpenAI(base_url=cfg.base_url, api_key=cfg.api_key, max_retries=0, timeout=cfg.timeout_s)
    model = cfg.model or await first_model(client, cfg.base_url)
    if cfg.model:
        await first_model(client, cfg.base_url)
    units = [(r, chat) for r in range(cfg.repeat) for chat in chats]
    requests = sum(c.requests for _, c in units)
    log = LogWriter(cfg.out, settings(cfg, model, len(units), requests))
    bar = tqdm(total=requests, unit="req", desc="draftsmith-replay", dynamic_ncols=True)
    run = Run(
        client, Sampling(model, cfg.max_tokens, cfg.temperature, cfg.stream), log, bar, time.perf_counter(), count()
    )
    try:
        await (open_loop(run, units, cfg) if cfg.open_loop else closed_loop(run, units, cfg.slots))
    finally:
        bar.close()
        log.close()
        await client.close()
    return run


def run_replay(cfg: ReplayConfig) -> Run:
    """The whole replay; a bad setting or a server that is down is a ValueError / ServerDown before anything is
    sent."""
    chats = load_chats(cfg.chats, cfg.suite, cfg.turns, cfg.limit)
    return asyncio.run(replay(cfg, chats))


@hydra.main(config_path="../conf", config_name="replay", version_base=None)
def _main(cfg: DictConfig) -> None:
    config = typed_or_exit(cfg, ReplayConfig, "draftsmith-replay")
    try:
        run = run_replay(config)
    except (ValueError, FileNotFoundError, ServerDown) as e:
        sys.exit(f"draftsmith-replay: {e}")
    print(
        f"draftsmith-replay: {run.ok + run.failed} requests ({run.ok} ok, {run.failed} failed) in {run.now():.1f} s "
        f"to {config.base_url}; log: {config.out} (draftsmith-eval replay={config.out} out=DIR reads it)"
    )


def main() -> None:
    _main()


if __name__ == "__main__":
    main()
