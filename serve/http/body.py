"""A request's body read with a cap and a deadline: refused from its Content-Length before a byte is read, or as soon
as what arrived passes the cap (a chunked body has no length), or when it has not arrived whole in time (a client
that sends a byte now and then would hold its connection and its memory forever)."""

from __future__ import annotations

import asyncio
import time

from starlette.requests import ClientDisconnect, Request

from draftsmith.serve.http.errors import APIError

CLOSE = {"Connection": "close"}  # the rest of a refused body is not read: the connection cannot carry another request


async def read_body(request: Request, max_bytes: int, timeout_s: float) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise too_large(int(declared), max_bytes)
    chunks: list[bytes] = []
    size, deadline = 0, time.monotonic() + timeout_s
    stream = request.stream()
    while True:
        try:
            chunk = await asyncio.wait_for(anext(stream), max(deadline - time.monotonic(), 0.001))
        except StopAsyncIteration:
            break
        except TimeoutError:
            raise APIError(
                408,
                f"The request body did not arrive within {timeout_s:g} s (limits.body_timeout_s); send it whole.",
                code="timeout",
                headers=CLOSE,
            ) from None
        except ClientDisconnect:
            raise APIError(400, "The client closed the connection before the body was read.") from None
        size += len(chunk)
        if size > max_bytes:
            raise too_large(size, max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def too_large(size: int, max_bytes: int) -> APIError:
    return APIError(
        413,
        f"The request body ({size} bytes or more) is larger than this server takes ({max_bytes} bytes, "
        "limits.max_body_mb); shorten the messages.",
        code="request_too_large",
        headers=CLOSE,
    )
