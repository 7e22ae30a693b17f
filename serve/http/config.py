"""ServeConfig: draftsmith-serve's settings (conf/serve.yaml), checked when built, before any model loads."""

from __future__ import annotations

from dataclasses import dataclass, field

from draftsmith.serve.adapt.config import AdaptConfig
from draftsmith.serve.http.bounds import BoundsConfig
from draftsmith.serve.models.target import TargetConfig
from draftsmith.serve.spec import SpecConfig


@dataclass
class ServeConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    host: str = "127.0.0.1"  # localhost only; another address needs api_key (or allow_unauthenticated)
    port: int = 8000
    api_key: list[str] = field(default_factory=list)  # keys taken as `Authorization: Bearer KEY` (+ DRAFTSMITH_API_KEY)
    allow_unauthenticated: bool = False  # serve a non-loopback host without a key (behind a proxy that checks one)
    metrics_need_key: bool = True  # /metrics asks for the key too when one is set (/health never does)
    model_name: str | None = None  # the `model` requests name; None: the target's name (its folder's for a path)
    prefix_cache: bool = True  # kept across requests: a chat's later turns reuse the KV of its earlier prompts
    prefix_cache_gb: float = 1.0  # the prefix cache's byte budget (LRU)
    max_seq_len: int = 4096  # prompt + completion, capped by the model's context
    max_tokens: int | None = 1024  # a request's max_tokens when it sets none; None: what the context has left
    max_queue: int = 1024  # requests waiting for the engine past this are refused with 503
    max_queue_per_client: int = 64  # one client's requests waiting for admission, and for the engine; past it, 429
    cuda_graphs: str = "auto"  # serve/engine/graphs.py: auto | compile | graphs | eager | off
    limits: BoundsConfig = field(default_factory=BoundsConfig)  # body, messages, characters, timeouts, connections
    parse_special_tokens: bool = False  # true: special-token strings typed in a message become control tokens
    log_level: str = "warning"  # uvicorn's: critical | error | warning | info | debug | trace
    adapt: bool = False  # capture the traffic and adapt the drafter to it (docs/serving.md); nothing is kept if false
    adaptation: AdaptConfig = field(default_factory=AdaptConfig)

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in [1, 65535], got {self.port}")
        if self.max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {self.max_queue}")
        if self.max_queue_per_client < 1:
            raise ValueError(f"max_queue_per_client must be >= 1, got {self.max_queue_per_client}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 or null (what the context has left), got {self.max_tokens}")
        if any(not key.strip() or "," in key for key in self.api_key):
            raise ValueError("api_key: a key must be non-empty and hold no comma, e.g. api_key=[KEY1,KEY2]")
        if self.prefix_cache_gb <= 0:
            raise ValueError(f"prefix_cache_gb must be > 0, got {self.prefix_cache_gb}")
