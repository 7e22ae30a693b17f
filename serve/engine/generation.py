"""Generation: what one request through the engine made."""

from __future__ import annotations

from dataclasses import dataclass

from draftsmith.serve.engine.metrics import Metrics


@dataclass
class Generation:
    output_ids: list[int]
    metrics: Metrics
    finished_by: str  # "eos", "length", or "stopped" (its observer stopped it)
