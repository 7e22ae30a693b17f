"""API keys, as vLLM's --api-key: `Authorization: Bearer KEY` on every route but /health (and /metrics when
metrics_need_key=false), compared in constant time; several keys at once, so one can be rotated while the other
still works. And the refusal to bind a non-loopback address without a key unless allow_unauthenticated says so."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
from collections.abc import Sequence

from starlette.types import ASGIApp, Receive, Scope, Send

from draftsmith.serve.http.errors import APIError

ENV_KEYS = "DRAFTSMITH_API_KEY"  # comma-separated, added to api_key
OPEN_PATHS = ("/health",)
CHALLENGE = {"WWW-Authenticate": "Bearer"}
CLIENT = "client"  # request.state.client: the digest of the key a request came with (absent without keys)


def api_keys(configured: Sequence[str]) -> list[str]:
    """The keys taken: conf's api_key and $DRAFTSMITH_API_KEY's."""
    from_env = [k.strip() for k in os.environ.get(ENV_KEYS, "").split(",") if k.strip()]
    return [*configured, *from_env]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def exposure_problem(host: str, keys: Sequence[str], allow_unauthenticated: bool) -> str | None:
    """Why this server must not start (one line that names the fix), or None."""
    if keys or allow_unauthenticated or is_loopback(host):
        return None
    return (
        f"host={host} serves beyond this machine, and no API key is set: set api_key=[KEY] (or {ENV_KEYS}=KEY), "
        "or allow_unauthenticated=true if a proxy in front checks clients"
    )


def one_authorization(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The request's Authorization header; several are refused, as a proxy and this server might each read another."""
    found = [value for name, value in headers if name.lower() == b"authorization"]
    if len(found) > 1:
        raise APIError(400, "Send one Authorization header, not several.", code="several_authorization_headers")
    return found[0] if found else None


def digest(key: str | bytes) -> bytes:
    # compared as digests: equal lengths, so the comparison's time says nothing of a key's length either
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


class KeyCheck:
    """ASGI middleware: a request without a valid key gets 401 in the OpenAI API's error shape."""

    def __init__(self, app: ASGIApp, keys: Sequence[str], open_paths: Sequence[str] = OPEN_PATHS) -> None:
        self.app = app
        self.digests = [digest(k) for k in keys]
        self.open_paths = tuple(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.digests or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        try:
            client = self.identify(one_authorization(scope["headers"]))
        except APIError as e:
            await e.response()(scope, receive, send)
            return
        scope.setdefault("state", {})[CLIENT] = client
        await self.app(scope, receive, send)

    def identify(self, header: bytes | None) -> str:
        """The client a valid key names (its digest, in hex), or the 401 to answer."""
        scheme, _, given = (header or b"").partition(b" ")
        if header is None or scheme.lower() != b"bearer" or not given.strip():
            raise APIError(
                401,
                "You didn't provide an API key. Send it in an Authorization header using Bearer auth "
                "(Authorization: Bearer YOUR_KEY), or `api_key=` in the openai client.",
                code="missing_api_key",
                headers=CHALLENGE,
            )
        got = digest(given.strip())
        matches = [hmac.compare_digest(got, d) for d in self.digests]  # every key compared: no early exit
        if not any(matches):
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key", headers=CHALLENGE)
        return got.hex()
