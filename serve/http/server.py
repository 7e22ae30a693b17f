"""draftsmith-serve's body: load the target, build the engine, warm it up, serve the app with uvicorn."""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable, Sequence

import uvicorn

from draftsmith.serve.adapt.adaptation import Adaptation
from draftsmith.serve.build import build_engine
from draftsmith.serve.engine.engine import Engine
from draftsmith.serve.engine.observer import Observer
from draftsmith.serve.engine.sampling import SamplingParams
from draftsmith.serve.http.admission import Admission
from draftsmith.serve.http.admit import Limits
from draftsmith.serve.http.app import Backend, make_app
from draftsmith.serve.http.auth import api_keys, exposure_problem
from draftsmith.serve.http.bounds import resolve
from draftsmith.serve.http.chat_text import ChatEncoder
from draftsmith.serve.http.client import new_salt
from draftsmith.serve.http.config import ServeConfig
from draftsmith.serve.http.metrics import ServeMetrics
from draftsmith.serve.http.protocol import timed_h11
from draftsmith.serve.http.worker import Job, Worker
from draftsmith.serve.models.target import encode_chat, load_target


def build_backend(cfg: ServeConfig, observers: Sequence[Callable[[Job], Observer]] = ()) -> Backend:
    """observers: what else watches each request (worker.py). adapt=true adds the capture of each request's
    tokens and target features, and head versions swapped in between requests (serve/adapt/)."""
    target = load_target(cfg.target)
    engine = build_engine(
        target,
        cfg.spec,
        cfg.prefix_cache,
        cfg.max_seq_len,
        cfg.cuda_graphs,
        int(cfg.prefix_cache_gb * 2**30),
        cfg.target.cache_dir,
    )
    warm_up(engine, encode_chat(target.tokenizer, [{"role": "user", "content": "Hello"}]))
    name = cfg.model_name or target.target_id.split("@")[0]
    metrics = ServeMetrics(name, cfg.spec.name)
    watchers, between, closers, salt = list(observers), None, [], new_salt()
    if cfg.adapt:
        adaptation = Adaptation(cfg.adaptation, target, cfg.target, cfg.spec, engine)
        adaptation.register_metrics(metrics.registry)
        watchers.append(lambda job: adaptation.observer(job.prompt_ids, job.client))
        between, closers = adaptation.between_requests, [adaptation.close]
        salt = adaptation.client_salt  # a client keeps its id across restarts, for its caps and judging
    worker = Worker(engine, target.tokenizer, metrics, cfg.max_queue, watchers, between, cfg.max_queue_per_client)
    limits = Limits(name, engine.max_seq_len, cfg.max_tokens, resolve(cfg.limits, engine.max_seq_len))
    admission = Admission(ChatEncoder(target.tokenizer, cfg.parse_special_tokens), limits, cfg.max_queue_per_client)
    keys = api_keys(cfg.api_key)
    return Backend(
        worker, admission, cfg.spec.name, metrics, keys, cfg.metrics_need_key, closers=closers, client_salt=salt
    )


def warm_up(engine: Engine, prompt_ids: list[int]) -> None:
    """One short untimed request (first-call costs, CUDA graph capture), then the caches it filled and what the draft
    policy learnt from it emptied: the first client neither pays for it nor hits it."""
    engine.generate(prompt_ids, 4, SamplingParams())
    engine.forget()  # its 4-token drafts say nothing of the drafter's depth or acceptance


def serve(cfg: ServeConfig) -> None:
    if (problem := exposure_problem(cfg.host, api_keys(cfg.api_key), cfg.allow_unauthenticated)) is not None:
        sys.exit(f"draftsmith-serve: {problem}")  # before the model loads: nothing is served open by mistake
    backend = build_backend(cfg)
    limits = backend.admission.limits
    keyed = f", {len(backend.keys)} API key(s)" if backend.keys else ""
    frozen = freeze_startup_heap()
    print(
        f"draftsmith-serve: {limits.model_name} (spec={backend.spec}, context {limits.context} tokens{keyed}, "
        f"{frozen} startup objects out of the collector's sweeps) on http://{cfg.host}:{cfg.port}/v1",
        flush=True,
    )
    uvicorn.Server(uvicorn_config(cfg, backend)).run()


def freeze_startup_heap() -> int:
    """Moves every object alive after start-up (torch, transformers, the model, the tokenizer: some 300k) out of the
    garbage collector's reach, as vLLM does. Why: a full collection sweeps them all, ~0.1-0.2 s on a small CPU, and
    it runs on the event loop's thread whenever allocation triggers it, so /health and every stream stall that long.
    Returns how many objects it froze."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def uvicorn_config(cfg: ServeConfig, backend: Backend) -> uvicorn.Config:
    bounds = cfg.limits
    return uvicorn.Config(
        make_app(backend),
        host=cfg.host,
        port=cfg.port,
        log_level=cfg.log_level,
        http=timed_h11(bounds.header_timeout_s, bounds.connections_per_peer),
        timeout_keep_alive=bounds.timeout_keep_alive_s,
        limit_concurrency=bounds.limit_concurrency,
        h11_max_incomplete_event_size=bounds.max_header_kb * 1024,
    )
