"""uvicorn's h11 protocol with a deadline on the request head: uvicorn times out idle keep-alive connections, but not
a client that opens a connection and sends its headers a byte at a time (slowloris), which would hold a connection
slot (limits.limit_concurrency) for as long as it likes. A connection with no request started within
header_timeout_s of opening, or of its last response, is closed. The body's own deadline is body.py's."""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol


class TimedH11(H11Protocol):
    header_timeout_s: float = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.arm_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self.arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self.head_timer.cancel()
        super().connection_lost(exc)

    def arm_head_timer(self) -> None:
        if (old := getattr(self, "head_timer", None)) is not None:
            old.cancel()
        self.head_timer = self.loop.call_later(self.header_timeout_s, self.head_overdue, self.cycle)

    def head_overdue(self, cycle_then: object) -> None:
        no_new_request = self.cycle is cycle_then and (self.cycle is None or self.cycle.response_complete)
        if no_new_request and not self.transport.is_closing():
            self.transport.close()


def timed_h11(header_timeout_s: float) -> type[TimedH11]:
    return type("TimedH11", (TimedH11,), {"header_timeout_s": header_timeout_s})
