"""Errors in the OpenAI API's shape: {"error": {"message", "type", "param", "code"}} with the status it uses."""

from __future__ import annotations

import logging

from fastapi.responses import JSONResponse
from starlette.requests import Request

log = logging.getLogger("draftsmith.serve")


class APIError(Exception):
    """A request refused (4xx) or failed (5xx); the message says what was wrong and what to do."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        message, param = printable(message), None if param is None else printable(param)
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def server_error(message: str) -> APIError:
    return APIError(500, message, kind="server_error")


def overloaded(waiting: int) -> APIError:
    return APIError(
        503,
        f"The engine is overloaded ({waiting} requests waiting); retry later.",
        code="overloaded",
        kind="server_error",
    )


def too_many_waiting(cap: int, where: str) -> APIError:
    """A client past max_queue_per_client (fair.py), in the shape of OpenAI's rate-limit error."""
    return APIError(
        429,
        f"You have {cap} requests waiting {where} on this server, the most one client may (max_queue_per_client); "
        "wait for one to be answered before sending another.",
        code="rate_limit_exceeded",
        kind="requests",
        headers={"Retry-After": "1"},
    )


def printable(text: str) -> str:
    """text that encodes as UTF-8: a lone surrogate echoed back from a request would fail the response itself."""
    return text.encode("utf-8", "replace").decode("utf-8")


async def unexpected(request: Request, e: Exception) -> JSONResponse:
    """Whatever no other handler caught: a JSON 500 that names no internals (the traceback goes to the log)."""
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=e)
    return server_error("The server had an error while processing your request; it is logged. Retry.").response()
