"""draftsmith-serve's body: load the target, build the engine, warm it up, serve the app with uvicorn."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import uvicorn

from draftsmith.serve.adapt.adaptation import Adaptation
from draftsmith.serve.build import build_engine
from draftsmith.serve.engine.engine import Engine
from draftsmith.serve.engine.observer import Observer
from draftsmith.serve.engine.sampling import SamplingParams
from draftsmith.serve.http.admit import Limits
from draftsmith.serve.http.app import Backend, make_app
from draftsmith.serve.http.config import ServeConfig
from draftsmith.serve.http.metrics import ServeMetrics
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
    watchers, between, closers = list(observers), None, []
    if cfg.adapt:
        adaptation = Adaptation(cfg.adaptation, target, cfg.target, cfg.spec, engine)
        adaptation.register_metrics(metrics.registry)
        watchers.append(lambda job: adaptation.observer(job.prompt_ids))
        between, closers = adaptation.between_requests, [adaptation.close]
    worker = Worker(engine, target.tokenizer, metrics, cfg.max_queue, watchers, between)
    limits = Limits(name, engine.max_seq_len, cfg.max_tokens)
    return Backend(worker, target.tokenizer, limits, cfg.spec.name, metrics, closers=closers)


def warm_up(engine: Engine, prompt_ids: list[int]) -> None:
    """One short untimed request (first-call costs, CUDA graph capture), then the caches it filled and what the draft
    policy learnt from it emptied: the first client neither pays for it nor hits it."""
    engine.generate(prompt_ids, 4, SamplingParams())
    if engine.prefix_cache is not None:
        engine.prefix_cache.reset()
    if engine.proposer is not None:
        engine.proposer.forget()
    if engine.policy is not None:  # its 4-token drafts say nothing of the drafter's depth or acceptance
        engine.policy.forget()


def serve(cfg: ServeConfig) -> None:
    backend = build_backend(cfg)
    print(
        f"draftsmith-serve: {backend.limits.model_name} (spec={backend.spec}, context {backend.limits.context} "
        f"tokens) on http://{cfg.host}:{cfg.port}/v1",
        flush=True,
    )
    uvicorn.run(make_app(backend), host=cfg.host, port=cfg.port, log_level=cfg.log_level)
