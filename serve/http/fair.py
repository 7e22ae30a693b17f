"""A queue fair between clients: each client's requests wait in a FIFO of their own, and the taker serves the clients
round-robin, one request per turn, so a client that floods the server delays only itself: another client's request
waits for at most one request of each other client, not for everything queued before it. A client may hold at most
`per_client` waiting requests (past it, ClientFull: 429), and the queue `total` (past it, Full: 503). The admission
thread (admission.py) and the engine thread (worker.py) each take from one. Thread-safe."""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Collection
from typing import Generic, TypeVar

T = TypeVar("T")


class Full(Exception):
    """The queue holds `total` requests."""


class ClientFull(Exception):
    """The client holds `per_client` waiting requests."""


class FairQueue(Generic[T]):
    def __init__(self, per_client: int, total: int | None = None, uncapped: Collection[str] = ()) -> None:
        """uncapped: clients per_client does not apply to (total still does)."""
        self.per_client, self.total, self.uncapped = per_client, total, frozenset(uncapped)
        self.queues: OrderedDict[str, deque[T]] = OrderedDict()  # whose turn is next first; a client with none leaves
        self.size = 0
        self.closed = False
        self.ready = threading.Condition()

    def check(self, client: str) -> None:
        """Raise ClientFull (or Full) if `client` could not put a request now."""
        with self.ready:
            self.refuse_if_full(client)

    def put(self, client: str, item: T) -> None:
        with self.ready:
            self.refuse_if_full(client)
            self.queues.setdefault(client, deque()).append(item)
            self.size += 1
            self.ready.notify()

    def refuse_if_full(self, client: str) -> None:
        if self.total is not None and self.size >= self.total:
            raise Full(self.size)
        if client not in self.uncapped and len(self.queues.get(client, ())) >= self.per_client:
            raise ClientFull(client)

    def get(self, timeout: float | None = None) -> T | None:
        """The next client's oldest request, in turn; None once closed (or after `timeout` with nothing waiting)."""
        with self.ready:
            if not self.ready.wait_for(lambda: self.size or self.closed, timeout) or self.closed:
                return None
            client, waiting = next(iter(self.queues.items()))
            item = waiting.popleft()
            if waiting:
                self.queues.move_to_end(client)  # its next request waits for every other client's turn
            else:
                del self.queues[client]
            self.size -= 1
            return item

    def close(self) -> list[T]:
        """Stop the taker (get returns None) and hand back what waited, to be told it will not run."""
        with self.ready:
            self.closed = True
            left = [item for waiting in self.queues.values() for item in waiting]
            self.queues.clear()
            self.size = 0
            self.ready.notify_all()
            return left

    def __len__(self) -> int:
        with self.ready:
            return self.size
