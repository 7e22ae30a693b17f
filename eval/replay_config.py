"""ReplayConfig: draftsmith-replay's settings (conf/replay.yaml), checked when built, before anything is sent."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .replay_chats import TURNS
from .suites import SuiteConfig

ARRIVALS = ("poisson", "fixed")
OPEN_LOOP_CONCURRENCY = 64  # in flight at most, at a rate, when concurrency is not set


@dataclass
class ReplayConfig:
    out: str  # the log: JSON lines, appended
    chats: str | None = None  # a JSONL file of chats ...
    suite: SuiteConfig | None = None  # ... or a packaged suite (hydra group `suite`)
    base_url: str = "http://127.0.0.1:8000/v1"
    model: str | None = None  # None: the first model the server lists (GET /v1/models)
    api_key: str = "unused"
    rate: float | None = None  # requests/s; 0 or None: closed loop, each slot sends when its last request ended
    arrivals: str = "poisson"  # poisson (exponential gaps drawn with `seed`) | fixed (1/rate apart)
    seed: int = 0
    concurrency: int | None = None  # in flight at most; None: 1 closed loop, OPEN_LOOP_CONCURRENCY at a rate
    max_tokens: int = 128
    temperature: float = 0.0  # 0: greedy
    stream: bool = False  # server-sent events; TTFT measured at the first text chunk
    turns: str = "first"  # prompt lines: first (the first user turn) | all (every turn, with the answers before it)
    limit: int | None = None  # the first N chats
    repeat: int = 1  # send the chats this many times over
    timeout_s: float = 600.0  # per request

    def __post_init__(self) -> None:
        if self.rate is not None and not (math.isfinite(self.rate) and self.rate >= 0):
            raise ValueError(f"rate must be >= 0 requests/s (0 or null: closed loop), got {self.rate}")
        if self.arrivals not in ARRIVALS:
            raise ValueError(f"arrivals must be one of {', '.join(ARRIVALS)}, got {self.arrivals!r}")
        if self.turns not in TURNS:
            raise ValueError(f"turns must be one of {', '.join(TURNS)}, got {self.turns!r}")
        for name in ("concurrency", "limit"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or null, got {value}")
        if self.repeat < 1 or self.max_tokens < 1:
            raise ValueError(f"repeat and max_tokens must be >= 1, got {self.repeat} and {self.max_tokens}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0: greedy), got {self.temperature}")

    @property
    def open_loop(self) -> bool:
        return bool(self.rate)

    @property
    def slots(self) -> int:
        return self.concurrency or (OPEN_LOOP_CONCURRENCY if self.open_loop else 1)
