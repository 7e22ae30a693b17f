"""Who writes the target's answers: vLLM's offline batched generation (in its own Python), or, as the fallback when
vLLM is missing, draftsmith's own decoders (the engine one conversation at a time, or many in lockstep). Each
backend answers a round of turns and says who it is (the `generator` every row records)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from draftsmith.serve.build import build_engine
from draftsmith.serve.engine.sampling import SamplingParams
from draftsmith.serve.models.target import LoadedTarget, eos_ids, offline_dtype
from draftsmith.serve.spec import SpecConfig

from .batch_decode import generate_batch
from .data import DistillConfig
from .turns import Chat, turn_seed
from .vllm_backend import VllmJob, VllmUnavailable, VllmWorker, find_vllm_python

# chats, their prompts, token budgets -> each prompt's new tokens (an end-of-turn token included where one ended it)
Generate = Callable[[list[Chat], list[list[int]], list[int]], list[list[int]]]
OWN_BATCH, VLLM_BATCH = 16, 256  # conversations in flight by default: vLLM schedules its own batches within them


@dataclass
class Backend:
    generate: Generate
    generator: dict  # who writes the answers: engine, version, dtype, sampling, target
    batch_size: int  # conversations in flight (a kill loses at most their work)
    close: Callable[[], None] = lambda: None
    start_s: float = 0.0  # seconds this backend took to start (vLLM's engine and its compile)
    worker: VllmWorker | None = None  # vLLM's, while open: the fidelity check asks it too where it runs fp32


def generator_record(engine: str, engine_version: str, dtype: str, cfg: DistillConfig, target_id: str) -> dict:
    sampling = {k: getattr(cfg, k) for k in ("temperature", "top_p", "seed", "max_new_tokens")}
    return {"engine": engine, "version": engine_version, "dtype": dtype, **sampling, "target": target_id}


def describe(generator: dict) -> str:
    """One line for logs and cards: `vllm 0.32.0, bfloat16, greedy`."""
    how = "greedy" if not generator.get("temperature") else f"temperature {generator['temperature']}"
    return f"{generator.get('engine')} {generator.get('version')}, {generator.get('dtype')}, {how}"


def open_backend(
    target: LoadedTarget, cfg: DistillConfig, limit: int, log: Path, cache_dir: str | None, say
) -> Backend:
    """data.distill.backend: vllm, draftsmith, or auto (vLLM where it is installed and starts, else draftsmith's
    own decoder, saying so in one line)."""
    if cfg.backend != "draftsmith":
        try:
            return vllm_backend(target, cfg, limit, log, cache_dir)
        except VllmUnavailable as e:
            if cfg.backend == "vllm":
                raise
            say(f"regeneration falls back to draftsmith's own batched decoder (slower): {e}")
    return own_backend(target, cfg, limit)


def vllm_backend(target: LoadedTarget, cfg: DistillConfig, limit: int, log: Path, cache_dir: str | None) -> Backend:
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
    return Backend(generate, record, batch, worker.close, time.perf_counter() - began, worker)


def vllm_dtype(name: str) -> str:
    """data.distill.dtype: auto is bfloat16 where the device computes it natively (as target.dtype=auto while
    training and regenerating, serve/models/target.py offline_dtype)."""
    return offline_dtype(name, "auto")


def own_backend(target: LoadedTarget, cfg: DistillConfig, limit: int) -> Backend:
    batch = cfg.batch_size or OWN_BATCH
    generate = engine_generate(target, cfg, limit) if batch == 1 else batched_generate(target, cfg)
    dtype = str(target.model.weights_dtype).removeprefix("torch.")
    return Backend(generate, generator_record("draftsmith", draftsmith_version(), dtype, cfg, target.target_id), batch)


def draftsmith_version() -> str:
    try:
        return version("draftsmith")
    except PackageNotFoundError:
        return "unknown"


def engine_generate(target: LoadedTarget, cfg: DistillConfig, limit: int) -> Generate:
    """The engine, one conversation at a time, with a lossless proposer (data.distill.spec)."""
    engine = build_engine(target, SpecConfig(cfg.spec), prefix_cache=False, max_seq_len=limit)
    sp = SamplingParams(cfg.temperature, cfg.top_p)

    def generate(chats: list[Chat], prompts: list[list[int]], budgets: list[int]) -> list[list[int]]:
        seeds = [turn_seed(cfg.seed, c.id, c.turn) for c in chats]
        rows = zip(prompts, budgets, seeds, strict=True)
        return [engine.generate(p, n, replace(sp, seed=s)).output_ids for p, n, s in rows]

    return generate


def batched_generate(target: LoadedTarget, cfg: DistillConfig) -> Generate:
    """Many conversations in lockstep on the engine's runner (train/batch_decode.py); a chat's KV is kept between
    its turns."""
    sp, eos = SamplingParams(cfg.temperature, cfg.top_p), eos_ids(target)

    def generate(chats: list[Chat], prompts: list[list[int]], budgets: list[int]) -> list[list[int]]:
        seeds = [turn_seed(cfg.seed, c.id, c.turn) for c in chats]
        outs, pasts = generate_batch(target.model, prompts, budgets, sp, seeds, eos, [c.past for c in chats])
        for chat, past in zip(chats, pasts, strict=True):
            chat.past = past
        return outs

    return generate
