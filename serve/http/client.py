"""Which client a request is from, for online adaptation's per-client caps and judging (serve/adapt/): the API key
auth.py checked (the same id the prefix cache is keyed by), else any `Authorization: Bearer` value (no keys are set:
it is the client's word, as `user` is), else the request's `user` field, else the peer's address (not its port,
which changes per connection). Each is an HMAC under the server's secret salt (the adaptation workspace's, so ids
hold across restarts; else one drawn per process), so no key, name or address is written into the capture store,
nor can a guess of one be checked against it (an address space is small enough to try whole), and the id is short.

queue_client: whose turn a request waits for in the admission and engine queues (fair.py), known before the body is
read: the checked API key, else the peer's address. Not an unchecked key or `user`: a client could name a new one per
request and so take as many turns, and escape its cap. Loopback without a key is LOCAL, the owner (or a proxy in
front, which connects from there for all its clients): its cap does not apply."""

from __future__ import annotations

import hashlib
import hmac
import secrets

from fastapi import Request

from draftsmith.serve.http.auth import CLIENT, digest, is_loopback

BEARER = "bearer "
LOCAL = "local"  # loopback without a key
SALT_BYTES = 32


def new_salt() -> bytes:
    return secrets.token_bytes(SALT_BYTES)


def client_id(request: Request, user: str | None, salt: bytes) -> str:
    checked = getattr(request.state, CLIENT, None)  # the checked key's sha256, in hex
    if checked:
        return tagged("key", checked, salt)
    auth = request.headers.get("authorization", "").encode("latin-1")  # the header's bytes, as auth.py reads them
    if auth[: len(BEARER)].lower() == BEARER.encode() and auth[len(BEARER) :].strip():
        return tagged("key", hashed(auth[len(BEARER) :].strip()), salt)
    if user:
        return tagged("user", user, salt)
    return tagged("peer", request.client.host if request.client else "unknown", salt)


def hashed(key: str | bytes) -> str:
    """A key as auth.py names a checked one (the digest of its bytes), so a key reads the same id checked or not."""
    return digest(key).hex()


def tagged(kind: str, value: str, salt: bytes) -> str:
    digest = hmac.new(salt, f"{kind}:{value}".encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()[:16]
    return f"{kind}:{digest}"


def queue_client(request: Request, salt: bytes) -> str:
    checked = getattr(request.state, CLIENT, None)
    if checked:
        return tagged("key", checked, salt)
    host = request.client.host if request.client else "unknown"
    return LOCAL if is_loopback(host) else tagged("peer", host, salt)
