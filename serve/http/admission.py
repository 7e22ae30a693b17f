"""Admission off the event loop: parsing, validation, the chat template and tokenization of one request run in a
thread of their own, so a large or slow-to-tokenize body delays only its own answer, never /health or the text
streamed to other clients. One thread: the tokenizer is not safe to call from two at once (a fast tokenizer's
settings are changed per call), and admissions are short once the bounds have cut a body to the context's size.

The thread takes requests from a queue fair between clients (fair.py): round-robin, each client at most
max_queue_per_client waiting (429 past it), so one client that floods the server delays its own admissions only."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

from draftsmith.serve.http.admit import Admitted, Limits, admit, parse
from draftsmith.serve.http.chat_text import ChatEncoder
from draftsmith.serve.http.client import LOCAL
from draftsmith.serve.http.errors import too_many_waiting
from draftsmith.serve.http.fair import ClientFull, FairQueue


@dataclass
class Ticket:
    """A request waiting for admission, and where its handler awaits the outcome."""

    body: bytes
    future: asyncio.Future[Admitted]
    loop: asyncio.AbstractEventLoop


class Admission:
    def __init__(self, encoder: ChatEncoder, limits: Limits, per_client: int = 64) -> None:
        self.encoder = encoder
        self.limits = limits
        self.queue: FairQueue[Ticket] = FairQueue(per_client, uncapped=(LOCAL,))
        self.thread = threading.Thread(target=self.serve, name="draftsmith-admit", daemon=True)
        self.thread.start()

    def check(self, client: str) -> None:
        """429 before the body is read, when the client already has its most requests waiting."""
        try:
            self.queue.check(client)
        except ClientFull:
            raise too_many_waiting(self.queue.per_client, "for admission") from None

    async def __call__(self, body: bytes, client: str = LOCAL) -> Admitted:
        loop = asyncio.get_running_loop()
        ticket = Ticket(body, loop.create_future(), loop)
        try:
            self.queue.put(client, ticket)
        except ClientFull:
            raise too_many_waiting(self.queue.per_client, "for admission") from None
        return await ticket.future  # cancelled when the client leaves: the thread skips it

    def run(self, body: bytes) -> Admitted:
        return admit(parse(body), self.encoder, self.limits)

    def serve(self) -> None:
        while (ticket := self.queue.get()) is not None:
            self.admit_one(ticket)
            del ticket  # its body is not kept while the thread waits for the next

    def admit_one(self, ticket: Ticket) -> None:
        if ticket.future.done():  # its client left while it waited
            return
        try:
            outcome: Admitted | BaseException = self.run(ticket.body)
        except Exception as e:  # an APIError to answer, or a fault the handler turns into a 500
            outcome = e
        settle_soon(ticket, outcome)

    def close(self) -> None:
        for ticket in self.queue.close():
            settle_soon(ticket, None)


def settle_soon(ticket: Ticket, outcome: Admitted | BaseException | None) -> None:
    """From the admission thread: the handler's future gets the outcome (None: cancelled, the server is stopping)."""

    def settle() -> None:
        if ticket.future.done():
            return
        if outcome is None:
            ticket.future.cancel()
        elif isinstance(outcome, BaseException):
            ticket.future.set_exception(outcome)
        else:
            ticket.future.set_result(outcome)

    try:
        ticket.loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the event loop is gone: the server is shutting down
        pass
