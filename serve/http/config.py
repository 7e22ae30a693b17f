"""ServeConfig: draftsmith-serve's settings (conf/serve.yaml), checked when built, before any model loads."""

from __future__ import annotations

from dataclasses import dataclass, field

from draftsmith.serve.adapt.config import AdaptConfig
from draftsmith.serve.models.target import TargetConfig
from draftsmith.serve.spec import SpecConfig


@dataclass
class ServeConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    host: str = "127.0.0.1"  # localhost only; 0.0.0.0 serves every interface (there is no authentication)
    port: int = 8000
    model_name: str | None = None  # the `model` requests name; None: the target's name (its folder's for a path)
    prefix_cache: bool = True  # kept across requests: a chat's later turns reuse the KV of its earlier prompts
    prefix_cache_gb: float = 1.0  # the prefix cache's byte budget (LRU)
    max_seq_len: int = 4096  # prompt + completion, capped by the model's context
    max_tokens: int | None = None  # a request's max_tokens when it sets none; None: what the context has left
    max_queue: int = 1024  # requests waiting for the engine past this are refused with 503
    cuda_graphs: str = "auto"  # serve/engine/graphs.py: auto | compile | graphs | eager | off
    log_level: str = "warning"  # uvicorn's: critical | error | warning | info | debug | trace
    adapt: bool = False  # capture the traffic and adapt the drafter to it (docs/serving.md); nothing is kept if false
    adaptation: AdaptConfig = field(default_factory=AdaptConfig)

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in [1, 65535], got {self.port}")
        if self.max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {self.max_queue}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 or null (what the context has left), got {self.max_tokens}")
        if self.prefix_cache_gb <= 0:
            raise ValueError(f"prefix_cache_gb must be > 0, got {self.prefix_cache_gb}")
