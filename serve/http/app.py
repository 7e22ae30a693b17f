"""The FastAPI app: POST /v1/chat/completions (JSON or server-sent events), GET /v1/models, GET /metrics, GET /health.

A handler checks the request (admit.py, in admission.py's thread), queues it for the engine thread (worker.py) and
answers from the job's events: a JSON object once it has ended, or one chunk per piece of text as it becomes final.
A client that leaves cancels its job: skipped while it waits, stopped at the engine's next step while it runs. Both
queues take the clients round-robin (fair.py), each client known by its API key, else its address (client.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from draftsmith.serve.http.admission import Admission
from draftsmith.serve.http.admit import Admitted
from draftsmith.serve.http.auth import CLIENT, OPEN_PATHS, KeyCheck
from draftsmith.serve.http.body import read_body
from draftsmith.serve.http.client import client_id, new_salt, queue_client
from draftsmith.serve.http.errors import APIError, server_error, unexpected
from draftsmith.serve.http.metrics import CONTENT_TYPE, ServeMetrics
from draftsmith.serve.http.responses import DONE, Reply, event, model_card, stats
from draftsmith.serve.http.worker import Done, Failed, Job, Piece, Worker


@dataclass
class Backend:
    """What the handlers share: the engine's worker, the admission of requests (off the event loop) and the limits
    it checks them against, the API keys taken (none: no key asked for)."""

    worker: Worker
    admission: Admission
    spec: str
    metrics: ServeMetrics
    keys: list[str] = field(default_factory=list)
    metrics_need_key: bool = True
    created: int = field(default_factory=lambda: int(time.time()))
    closers: list[Callable[[], None]] = field(default_factory=list)  # run at shutdown, after the worker stopped
    client_salt: bytes = field(default_factory=new_salt, repr=False)  # keys the client ids (client.py)


def make_app(backend: Backend) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        backend.worker.start()
        yield
        await asyncio.to_thread(backend.worker.stop)
        backend.admission.close()
        for close in backend.closers:
            await asyncio.to_thread(close)

    app = FastAPI(title="draftsmith-serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_exception_handler(APIError, lambda request, e: e.response())
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)
    open_paths = OPEN_PATHS if backend.metrics_need_key else (*OPEN_PATHS, "/metrics")
    app.add_middleware(KeyCheck, keys=backend.keys, open_paths=open_paths)
    limits = backend.admission.limits
    name = limits.model_name

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card(name, backend.created)]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict:
        if model != name:
            raise APIError(
                404, f"The model `{model}` does not exist. This server serves `{name}`.", "model", "model_not_found"
            )
        return model_card(name, backend.created)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        owner = queue_client(request, backend.client_salt)
        backend.admission.check(owner)  # a client with its most requests waiting: 429 before its body is read
        body = await read_body(request, limits.bounds.body_bytes, limits.bounds.body_timeout_s)
        admitted = await backend.admission(body, owner)
        salt = cache_salt(getattr(request.state, CLIENT, None), admitted.request.cache_salt)
        job = Job(
            admitted.prompt_ids,
            admitted.max_new_tokens,
            admitted.sampling,
            admitted.stop,
            asyncio.get_running_loop(),
            salt,
        )
        job.client = client_id(
            request, admitted.request.user, backend.client_salt
        )  # adaptation's per-client caps and judging
        job.owner = owner
        backend.worker.submit(job)
        reply = Reply(name, backend.spec)
        if admitted.request.stream:
            return StreamingResponse(stream(job, reply, admitted), media_type="text/event-stream")
        return JSONResponse(await complete(request, job, reply, admitted))

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(backend.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    return app


async def complete(request: Request, job: Job, reply: Reply, admitted: Admitted) -> dict:
    watcher = asyncio.create_task(cancel_on_disconnect(request, job))
    pieces: list[str] = []
    try:
        while not isinstance(ev := await job.events.get(), Done):
            if isinstance(ev, Failed):
                raise server_error(ev.message)
            pieces.append(ev.text)
    finally:
        watcher.cancel()
        if not job.ended:
            job.cancel()
    if ev.generation is None:
        raise APIError(503, "The server is shutting down; the request was not run.", kind="server_error")
    g = ev.generation
    ids = g.output_ids if admitted.request.return_token_ids else None
    return reply.completion("".join(pieces), ev.finish_reason, g, job_stats(reply, job, g), ids, admitted.prompt_ids)


async def stream(job: Job, reply: Reply, admitted: Admitted) -> AsyncIterator[str]:
    """chat.completion.chunk events: the role, the text as it becomes final, the finish reason with the draft
    statistics, the usage if asked, [DONE]. An error after the first chunk is sent as an error event."""
    req = admitted.request
    try:
        ids = req.return_token_ids
        yield reply.chunk({"role": "assistant", "content": ""}, prompt_token_ids=admitted.prompt_ids if ids else None)
        while not isinstance(ev := await job.events.get(), Done):
            if isinstance(ev, Failed):
                yield event(server_error(ev.message).body())
                break
            if isinstance(ev, Piece) and (ev.text or ids):
                yield reply.chunk({"content": ev.text}, token_ids=ev.token_ids if ids else None)
        if isinstance(ev, Done) and ev.generation is not None:
            g = ev.generation
            yield reply.chunk({}, ev.finish_reason, draftsmith=job_stats(reply, job, g))
            if req.stream_options is not None and req.stream_options.include_usage:
                yield reply.usage_chunk(g)
        yield DONE
    finally:  # the client left (the response task is cancelled) or the stream ended
        if not job.ended:
            job.cancel()


async def cancel_on_disconnect(request: Request, job: Job) -> None:
    """The body is read: the next ASGI message is the client leaving."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.cancel()


def cache_salt(client: str | None, asked: str | None) -> str:
    """Whose prefix-cache entries a request may hit: its API key's, and within them its cache_salt's."""
    if client is None and asked is None:
        return ""
    return f"{client or ''}:{asked or ''}"


def job_stats(reply: Reply, job: Job, g) -> dict:
    started = job.started if job.started is not None else job.arrived
    first = job.first_token if job.first_token is not None else started
    return stats(reply.spec, g, started - job.arrived, first - job.arrived)


async def http_error(request: Request, e: Exception) -> JSONResponse:
    """Unknown paths and methods (starlette's HTTPException) in the API's error shape."""
    status, detail = (e.status_code, str(e.detail)) if isinstance(e, HTTPException) else (500, str(e))
    words = {404: "Not found", 405: "Method not allowed"}.get(status, detail)
    return APIError(status, f"{words}: {request.method} {request.url.path}").response()
