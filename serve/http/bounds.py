"""How much work one request may ask of the server before the engine sees it: its body's size and the time it may
take to arrive, the messages and characters it may hold (sized from the context when not set), the stop strings;
and the connection limits uvicorn enforces."""

from __future__ import annotations

from dataclasses import dataclass

CHARS_PER_TOKEN = 16  # a prompt's characters per token, well above real text's (about 4): past it, it cannot fit
JSON_BYTES_PER_CHAR = 6  # the most a character costs in a JSON body (\uXXXX)
BODY_SLACK = 64 * 1024  # the body's fields besides the messages


@dataclass
class BoundsConfig:
    """conf/serve.yaml `limits:`. null: sized from the served context (max_seq_len)."""

    max_body_mb: float | None = None  # a request body past this is refused with 413 (Content-Length, or as it is read)
    max_messages: int | None = None  # messages per request; null: the context's tokens (each message takes one)
    max_prompt_chars: int | None = None  # characters over all messages; null: 16 per context token
    max_stop_chars: int = 256  # the longest stop string
    body_timeout_s: float = 30.0  # a body not received whole in this time is refused with 408 (slow clients)
    header_timeout_s: float = 10.0  # a connection that has not sent a whole request head in this time is closed
    timeout_keep_alive_s: int = 5  # an idle keep-alive connection is closed after this (uvicorn's timeout_keep_alive)
    limit_concurrency: int = 512  # connections and requests at once; past it, 503 (uvicorn's limit_concurrency)
    connections_per_peer: int = 64  # connections one non-loopback address holds at once; past it, closed at once
    max_header_kb: int = 16  # a request head past this is refused with 400 (uvicorn's h11_max_incomplete_event_size)

    def __post_init__(self) -> None:
        for name in ("max_body_mb", "max_messages", "max_prompt_chars"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"limits.{name} must be > 0 or null (sized from the context), got {value}")
        for name in ("max_stop_chars", "body_timeout_s", "header_timeout_s", "timeout_keep_alive_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"limits.{name} must be > 0, got {getattr(self, name)}")
        if self.connections_per_peer < 1:
            raise ValueError(f"limits.connections_per_peer must be >= 1, got {self.connections_per_peer}")
        if self.limit_concurrency < 2:
            raise ValueError(f"limits.limit_concurrency must be >= 2, got {self.limit_concurrency}")
        if self.max_header_kb < 1:
            raise ValueError(f"limits.max_header_kb must be >= 1, got {self.max_header_kb}")


@dataclass(frozen=True)
class Bounds:
    """BoundsConfig with every size resolved for the served context."""

    body_bytes: int
    messages: int
    prompt_chars: int
    stop_chars: int
    body_timeout_s: float


def resolve(cfg: BoundsConfig, context: int) -> Bounds:
    chars = cfg.max_prompt_chars or CHARS_PER_TOKEN * context
    body = int(cfg.max_body_mb * 2**20) if cfg.max_body_mb is not None else JSON_BYTES_PER_CHAR * chars + BODY_SLACK
    return Bounds(body, cfg.max_messages or context, chars, cfg.max_stop_chars, cfg.body_timeout_s)
