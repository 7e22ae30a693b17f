"""uvicorn's h11 protocol with a deadline on the request head: uvicorn times out idle keep-alive connections, but not
a client that opens a connection and sends its headers a byte at a time (slowloris), which would hold a connection
slot (limits.limit_concurrency) for as long as it likes. A connection with no request started within
header_timeout_s of opening, or of its last response, is closed. The body's own deadline is body.py's. And a cap on
the connections one address holds at once, so that slow connections from one client cannot fill every slot; loopback
peers are not capped (a proxy in front of the server connects from there for all its clients)."""

from __future__ import annotations

import asyncio
import ipaddress
from collections import Counter

from uvicorn.protocols.http.h11_impl import H11Protocol


class TimedH11(H11Protocol):
    header_timeout_s: float = 10.0
    per_peer: int = 64  # connections one non-loopback address may hold at once
    open_per_peer: Counter[str] = Counter()  # the class's own (timed_h11 makes one per server)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.head_timer: asyncio.TimerHandle | None = None
        self.peer = capped_peer(transport)
        if self.peer is not None:
            if self.open_per_peer[self.peer] >= self.per_peer:
                self.peer = None
                transport.close()
                return
            self.open_per_peer[self.peer] += 1
        self.arm_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self.arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
        if self.peer is not None:
            self.open_per_peer[self.peer] -= 1
            if not self.open_per_peer[self.peer]:
                del self.open_per_peer[self.peer]
        super().connection_lost(exc)

    def arm_head_timer(self) -> None:
        if (old := getattr(self, "head_timer", None)) is not None:
            old.cancel()
        self.head_timer = self.loop.call_later(self.header_timeout_s, self.head_overdue, self.cycle)

    def head_overdue(self, cycle_then: object) -> None:
        no_new_request = self.cycle is cycle_then and (self.cycle is None or self.cycle.response_complete)
        if no_new_request and not self.transport.is_closing():
            self.transport.close()


def capped_peer(transport: asyncio.Transport) -> str | None:
    """The peer's address where the per-address cap applies (not loopback, not a Unix socket); else None."""
    peer = transport.get_extra_info("peername")
    host = peer[0] if isinstance(peer, tuple) and peer else None
    try:
        return None if host is None or ipaddress.ip_address(host).is_loopback else host
    except ValueError:
        return None


def timed_h11(header_timeout_s: float, per_peer: int = 64) -> type[TimedH11]:
    settings = {"header_timeout_s": header_timeout_s, "per_peer": per_peer, "open_per_peer": Counter()}
    return type("TimedH11", (TimedH11,), settings)
