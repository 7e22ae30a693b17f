"""Which client a request is from, for online adaptation's per-client caps and judging (serve/adapt/): the API key
auth.py checked (the same id the prefix cache is keyed by), else any `Authorization: Bearer` value (no keys are set:
it is the client's word, as `user` is), else the request's `user` field, else the peer's address (not its port,
which changes per connection). Each is hashed, so no key is written into the capture store and the id is short.

queue_client: whose turn a request waits for in the admission and engine queues (fair.py), known before the body is
read: the checked API key, else the peer's address. Not an unchecked key or `user`: a client could name a new one per
request and so take as many turns, and escape its cap. Loopback without a key is LOCAL, the owner (or a proxy in
front, which connects from there for all its clients): its cap does not apply."""

from __future__ import annotations

import hashlib

from fastapi import Request

from draftsmith.serve.http.auth import CLIENT, is_loopback

BEARER = "bearer "
LOCAL = "local"  # loopback without a key


def client_id(request: Request, user: str | None) -> str:
    checked = getattr(request.state, CLIENT, None)  # the checked key's sha256, in hex
    if checked:
        return f"key:{checked[:16]}"
    auth = request.headers.get("authorization", "")
    if auth[: len(BEARER)].lower() == BEARER and auth[len(BEARER) :].strip():
        return tagged("key", auth[len(BEARER) :].strip())
    if user:
        return tagged("user", user)
    return tagged("peer", request.client.host if request.client else "unknown")


def tagged(kind: str, value: str) -> str:
    digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"{kind}:{digest}"


def queue_client(request: Request) -> str:
    checked = getattr(request.state, CLIENT, None)
    if checked:
        return f"key:{checked[:16]}"
    host = request.client.host if request.client else "unknown"
    return LOCAL if is_loopback(host) else tagged("peer", host)
