"""Errors in the OpenAI API's shape: {"error": {"message", "type", "param", "code"}} with the status it uses."""

from __future__ import annotations

from fastapi.responses import JSONResponse


class APIError(Exception):
    """A request refused (4xx) or failed (5xx); the message says what was wrong and what to do."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


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
