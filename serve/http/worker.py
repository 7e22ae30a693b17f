"""The request queue and the one thread that runs the engine (batch 1), request after request.

A handler puts a Job on the queue and reads its events (text pieces as they become final, then Done or Failed)
from an asyncio queue the engine thread fills through the event loop. A job whose client left is marked
cancelled: skipped if still waiting, stopped at its next step if running (its observer returns False).

The queue is fair between clients (fair.py): the engine takes one request of each client with one waiting in turn, so
a client that floods the server waits behind its own requests; each client may have max_queue_per_client waiting
(429 past it), all of them max_queue (503 past it).

Per-request hooks: `observers` are factories Job -> Observer (serve/engine/observer.py), each told the request's
target outputs as the engine runs them and its Generation when it ends: where traffic capture plugs in.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from draftsmith.serve.engine.engine import Engine
from draftsmith.serve.engine.generation import Generation
from draftsmith.serve.engine.observer import Observer, Observers
from draftsmith.serve.engine.sampling import SamplingParams
from draftsmith.serve.http.client import LOCAL
from draftsmith.serve.http.detok import TextStream
from draftsmith.serve.http.errors import overloaded, too_many_waiting
from draftsmith.serve.http.fair import ClientFull, FairQueue, Full
from draftsmith.serve.http.metrics import ServeMetrics

log = logging.getLogger("draftsmith.serve")


@dataclass
class Piece:
    """Output text made final, and the tokens the step made (which may run past a stop string)."""

    text: str
    token_ids: list[int]


@dataclass
class Done:
    generation: Generation | None  # None: the client left before the engine took the request
    finish_reason: str  # stop | length | abort


@dataclass
class Failed:
    message: str


@dataclass
class Job:
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    stop: list[str]
    loop: asyncio.AbstractEventLoop
    cache_salt: str = ""  # the client's: its prefix-cache entries are its own (app.py: the API key, the cache_salt)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=time.perf_counter)
    started: float | None = None
    first_token: float | None = None
    ended: bool = False  # Done or Failed was posted
    client: str = "local"  # who sent it (client.py): adaptation's per-client caps and judging group by it
    owner: str = LOCAL  # whose turn it waits for in the queue (client.py's queue_client)

    def post(self, event: Piece | Done | Failed) -> None:
        """From the engine thread to the handler waiting on `events`."""
        if isinstance(event, Done | Failed):
            self.ended = True
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is gone: the server is shutting down
            pass

    def cancel(self) -> None:
        """The client left: skip the request, or stop it at its next step."""
        self.cancelled.set()


class JobObserver(Observer):
    """Turns the engine's new tokens into text pieces for the job's handler; stops the request at a stop string or
    once its client has left."""

    def __init__(self, job: Job, tokenizer) -> None:
        self.job = job
        self.text = TextStream(tokenizer, job.stop)

    def emit(self, new_ids: list[int]) -> bool:
        if self.job.first_token is None:
            self.job.first_token = time.perf_counter()
        self.job.post(Piece(self.text.push(new_ids), new_ids))
        return not (self.text.stopped or self.job.cancelled.is_set())

    def finish(self, generation: Generation) -> None:
        rest = self.text.flush()
        if rest:
            self.job.post(Piece(rest, []))

    def finish_reason(self, g: Generation) -> str:
        if self.text.stopped or g.finished_by == "eos":
            return "stop"
        return "length" if g.finished_by == "length" else "abort"


@contextmanager
def client_salt(engine: Engine, salt: str) -> Iterator[None]:
    """The engine's prefix-cache salt with the client's added for one request: a client's prompts hit only its own
    entries, so a hit (its count, or its speed) tells nothing about what other clients sent; likewise what a proposer
    learns across requests (suffix decoding's global tree) is kept per client. The engine thread is
    the only one that reads or changes the salt, and a head swapped in between requests sets a new base."""
    if (proposer := getattr(engine, "proposer", None)) is not None:  # suffix decoding's global tree: the client's own
        proposer.set_client(salt)
    if not salt:
        yield
        return
    base = engine.salt
    engine.salt = f"{base}|client={salt}"
    try:
        yield
    finally:
        engine.salt = base


class Worker:
    def __init__(
        self,
        engine: Engine,
        tokenizer,
        metrics: ServeMetrics,
        max_queue: int,
        observers: Sequence[Callable[[Job], Observer]] = (),
        between: Callable[[], None] | None = None,
        per_client: int = 64,
    ) -> None:
        """between: what runs in the engine thread before each request (a head version swapped in). per_client:
        the requests one client may have waiting (max_queue_per_client)."""
        self.engine = engine
        self.tokenizer = copy.deepcopy(tokenizer)  # its own: the handlers encode with theirs on the event loop
        self.metrics = metrics
        self.observers = list(observers)
        self.between = between
        self.queue: FairQueue[Job] = FairQueue(per_client, max_queue, uncapped=(LOCAL,))
        self.current: Job | None = None  # the job the engine runs
        self.thread = threading.Thread(target=self.run, name="draftsmith-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def submit(self, job: Job) -> None:
        try:
            self.queue.put(job.owner, job)
        except Full:
            raise overloaded(len(self.queue)) from None
        except ClientFull:
            raise too_many_waiting(self.queue.per_client, "for the engine") from None
        self.metrics.waiting.set(len(self.queue))

    def stop(self) -> None:
        """Cancel what waits and what runs (it stops at its next step), end the thread."""
        if (running := self.current) is not None:
            running.cancel()
        for job in self.queue.close():
            job.cancel()
            job.post(Done(None, "abort"))
        if self.thread.is_alive():
            self.thread.join(timeout=30)

    def run(self) -> None:
        while (job := self.queue.get()) is not None:
            self.metrics.waiting.set(len(self.queue))
            self.run_between()
            self.serve(job)

    def run_between(self) -> None:
        if self.between is None:
            return
        try:
            self.between()
        except Exception:  # the hook's failure is logged; requests are served on
            log.exception("the between-requests hook failed")

    def serve(self, job: Job) -> None:
        if job.cancelled.is_set():
            self.metrics.ended_early("abort")
            job.post(Done(None, "abort"))
            return
        job.started = time.perf_counter()
        watch = JobObserver(job, self.tokenizer)
        observer = Observers(watch, *(make(job) for make in self.observers)) if self.observers else watch
        self.metrics.running.set(1)
        self.current = job
        try:
            with client_salt(self.engine, job.cache_salt):
                g = self.engine.generate(job.prompt_ids, job.max_new_tokens, job.sampling, observer)
        except Exception as e:  # the server goes on; the request gets a 500 and the log the traceback
            log.exception("the engine failed on a request")
            self.metrics.ended_early("error")
            job.post(Failed(f"The engine failed on this request: {type(e).__name__}: {e}"))
            return
        finally:
            self.current = None
            self.metrics.running.set(0)
        end = time.perf_counter()
        reason = watch.finish_reason(g)
        first = job.first_token if job.first_token is not None else end
        self.metrics.finished(g, reason, job.started - job.arrived, first - job.arrived, end - job.arrived)
        job.post(Done(g, reason))
