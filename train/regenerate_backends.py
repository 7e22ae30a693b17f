"""Who writes the target's answers: vLLM's offline batched generation (in its own Python), or draftsmith's own
decoders (many conversations in slots, continuously batched, or the engine one conversation at a time). Each
backend answers chats turn by turn, yielding the chats that are done, and says who it is (the `generator` every
row records)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from importlib.metadata import PackageNotFoundError, version
from itertools import islice
from pathlib import Path

from draftsmith.serve.build import build_engine
from draftsmith.serve.engine.sampling import SamplingParams
from draftsmith.serve.models.target import LoadedTarget, eos_ids, native_bf16, offline_dtype
from draftsmith.serve.spec import SpecConfig

from .batch_decode import Todo, Turns, answer_in_slots
from .data import RegenerateConfig, answer_settings
from .regenerate_vllm import VllmJob, VllmUnavailable, VllmWorker, find_vllm_python
from .turns import Chat, finish_turn, turn_seed

# chats, their prompts, token budgets -> each prompt's new tokens (an end-of-turn token included where one ended it)
Generate = Callable[[list[Chat], list[list[int]], list[int]], list[list[int]]]
Answer = Callable[[Todo], Iterator[tuple[list[Chat], int]]]  # chats -> (those done, new tokens) as they finish
OWN_BATCH, VLLM_BATCH = 64, 256  # conversations in flight by default: vLLM schedules its own batches within them


@dataclass
class Backend:
    answer: Answer
    generator: dict  # who writes the answers: engine, version, dtype, sampling, target
    batch_size: int  # conversations in flight (a kill loses at most their work)
    close: Callable[[], None] = lambda: None
    start_s: float = 0.0  # seconds this backend took to start (vLLM's engine and its compile)
    worker: VllmWorker | None = None  # vLLM's, while open: the fidelity check asks it too where it runs fp32


def generator_record(engine: str, engine_version: str, dtype: str, cfg: RegenerateConfig, target_id: str) -> dict:
    return {"engine": engine, "version": engine_version, "dtype": dtype, **answer_settings(cfg), "target": target_id}


def describe(generator: dict) -> str:
    """One line for logs and cards: `vllm 0.32.0, bfloat16, greedy`."""
    how = "greedy" if not generator.get("temperature") else f"temperature {generator['temperature']}"
    return f"{generator.get('engine')} {generator.get('version')}, {generator.get('dtype')}, {how}"


def open_backend(
    target: LoadedTarget, cfg: RegenerateConfig, limit: int, log: Path, cache_dir: str | None, say
) -> Backend:
    """data.regenerate.backend: vllm, draftsmith, or auto: draftsmith's own decoder where the device has no native bf16
    (there vLLM runs fp32, no faster than the own slots; docs/benchmarks.md), else vLLM where it is installed and
    starts, else the own decoder, saying so in one line."""
    if own_first(cfg, str(target.model.device)):
        say("regeneration runs draftsmith's own batched decoder: no native bf16 here, where vLLM runs fp32 no faster")
    elif not uses_own(cfg, str(target.model.device)):
        try:
            return vllm_backend(target, cfg, limit, log, cache_dir)
        except VllmUnavailable as e:
            if cfg.backend == "vllm":
                raise
            say(f"regeneration falls back to draftsmith's own batched decoder (slower): {e}")
    return own_backend(target, cfg, limit)


def uses_own(cfg: RegenerateConfig, device: str) -> bool:
    """Regeneration runs the own decoder without trying vLLM: asked for it, or own_first."""
    return cfg.backend == "draftsmith" or own_first(cfg, device)


def own_first(cfg: RegenerateConfig, device: str) -> bool:
    """backend=auto on a device without native bf16 kernels: there vLLM runs fp32, and the own decoder's slots
    generate at its pace without its start (docs/benchmarks.md); where bf16 is native vLLM's bf16 batches are faster."""
    return cfg.backend == "auto" and not native_bf16(device)


def vllm_backend(target: LoadedTarget, cfg: RegenerateConfig, limit: int, log: Path, cache_dir: str | None) -> Backend:
    if target.folder is None:
        raise VllmUnavailable("the target was not loaded from a folder vLLM could read")
    python = find_vllm_python(cfg.vllm_python, cache_dir)
    began = time.perf_counter()
    job = VllmJob(str(target.folder), vllm_dtype(cfg.dtype), limit, dict(cfg.engine_args), seeded=cfg.temperature > 0)
    worker = VllmWorker(python, job, log)
    eos = list(eos_ids(target))

    def generate(chats: list[Chat], prompts: list[list[int]], budgets: list[int]) -> list[list[int]]:
        batch = {"prompts": prompts, "max_tokens": budgets, "stop_token_ids": eos}
        batch |= {"seeds": [turn_seed(cfg.seed, c.id, c.turn) for c in chats]}
        return worker.generate(batch | {"temperature": cfg.temperature, "top_p": cfg.top_p})["outputs"]

    record = generator_record("vllm", worker.version, vllm_dtype(cfg.dtype), cfg, target.target_id)
    batch = cfg.batch_size or VLLM_BATCH
    answer = in_rounds(generate, batch, target, cfg, limit)
    return Backend(answer, record, batch, worker.close, time.perf_counter() - began, worker)


def vllm_dtype(name: str) -> str:
    """data.regenerate.dtype: auto is bfloat16 where the device computes it natively (as target.dtype=auto while
    training and regenerating, serve/models/target.py offline_dtype)."""
    return offline_dtype(name, "auto")


def own_backend(target: LoadedTarget, cfg: RegenerateConfig, limit: int) -> Backend:
    batch = cfg.batch_size or OWN_BATCH
    if batch == 1:
        answer = in_rounds(engine_generate(target, cfg, limit), 1, target, cfg, limit)
    else:
        answer = in_slots(target, cfg, limit, batch)
    dtype = str(target.model.weights_dtype).removeprefix("torch.")
    return Backend(answer, generator_record("draftsmith", draftsmith_version(), dtype, cfg, target.target_id), batch)


def draftsmith_version() -> str:
    try:
        return version("draftsmith")
    except PackageNotFoundError:
        return "unknown"


def engine_generate(target: LoadedTarget, cfg: RegenerateConfig, limit: int) -> Generate:
    """The engine, one conversation at a time, with a lossless proposer (data.regenerate.spec)."""
    engine = build_engine(target, SpecConfig(cfg.spec), prefix_cache=False, max_seq_len=limit)
    sp = SamplingParams(cfg.temperature, cfg.top_p)

    def generate(chats: list[Chat], prompts: list[list[int]], budgets: list[int]) -> list[list[int]]:
        seeds = [turn_seed(cfg.seed, c.id, c.turn) for c in chats]
        rows = zip(prompts, budgets, seeds, strict=True)
        return [engine.generate(p, n, replace(sp, seed=s)).output_ids for p, n, s in rows]

    return generate


def in_slots(target: LoadedTarget, cfg: RegenerateConfig, limit: int, slots: int) -> Answer:
    """Many conversations continuously batched on the engine's runner (train/batch_decode.py); a chat keeps its slot,
    and its KV, for all its turns."""
    sp, eos = SamplingParams(cfg.temperature, cfg.top_p), eos_ids(target)
    turns = Turns(
        budget=lambda prompt: min(cfg.max_new_tokens, limit - len(prompt)),
        seed=lambda chat: turn_seed(cfg.seed, chat.id, chat.turn),
        after=lambda chat, out: finish_turn(chat, out, target.tokenizer, eos, limit, cfg.end_at_cut),
    )
    return lambda todo: answer_in_slots(target.model, todo, slots, limit, sp, eos, turns)


def in_rounds(generate: Generate, batch_size: int, target: LoadedTarget, cfg: RegenerateConfig, limit: int) -> Answer:
    """A backend that answers a round of turns at once: up to batch_size conversations in flight, one turn each per
    round; a finished chat's place goes to a waiting one, so a kill loses at most batch_size chats' work."""
    eos = eos_ids(target)

    def answer(todo: Todo) -> Iterator[tuple[list[Chat], int]]:
        waiting: Iterator = iter(todo)
        active: Todo = []
        while True:
            active += islice(waiting, batch_size - len(active))
            if not active:
                return
            budgets = [min(cfg.max_new_tokens, limit - len(ids)) for _, ids in active]
            outs = generate([chat for chat, _ in active], [ids for _, ids in active], budgets)
            kept, finished = [], []
            for (chat, _), out in zip(active, outs, strict=True):
                ids = finish_turn(chat, out, target.tokenizer, eos, limit, cfg.end_at_cut)
                if ids is None:
                    finished.append(chat)
                else:
                    kept.append((chat, ids))
            active = kept
            yield finished, sum(map(len, outs))

    return answer
