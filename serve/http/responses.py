"""The response objects of the OpenAI API (chat.completion, chat.completion.chunk, model, list) as plain dicts, and
the `draftsmith` field each response carries: the request's draft statistics."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from draftsmith.serve.engine.generation import Generation


@dataclass
class Reply:
    """What every object of one response shares."""

    model: str
    spec: str
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))

    def head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def completion(
        self, text: str, reason: str, g: Generation, stats: dict, token_ids: list[int] | None, prompt_ids: list[int]
    ) -> dict:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": reason,
            "logprobs": None,
        }
        out = {**self.head("chat.completion"), "choices": [choice], "usage": usage(g)}
        if token_ids is not None:
            choice["token_ids"] = token_ids
            out["prompt_token_ids"] = prompt_ids
        return {**out, "draftsmith": stats}

    def chunk(
        self,
        delta: dict,
        reason: str | None = None,
        token_ids: list[int] | None = None,
        prompt_token_ids: list[int] | None = None,
        draftsmith: dict | None = None,
    ) -> str:
        """One chat.completion.chunk event; the token ids (return_token_ids) and the statistics when given."""
        choice: dict = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
        if token_ids is not None:
            choice["token_ids"] = token_ids
        out = {**self.head("chat.completion.chunk"), "choices": [choice]}
        if prompt_token_ids is not None:
            out["prompt_token_ids"] = prompt_token_ids
        if draftsmith is not None:
            out["draftsmith"] = draftsmith
        return event(out)

    def usage_chunk(self, g: Generation) -> str:
        return event({**self.head("chat.completion.chunk"), "choices": [], "usage": usage(g)})


def usage(g: Generation) -> dict:
    m = g.metrics
    return {
        "prompt_tokens": m.prompt_tokens,
        "completion_tokens": m.new_tokens,
        "total_tokens": m.prompt_tokens + m.new_tokens,
    }


def stats(spec: str, g: Generation, queued_s: float, ttft_s: float) -> dict:
    """The request's draft statistics (the `draftsmith` field): drafts, tokens drafted and accepted, tau =
    1 + accepted / drafts, and where its time went."""
    m = g.metrics
    return {
        "spec": spec,
        "drafts": m.drafts,
        "draft_tokens": m.draft_tokens,
        "accepted_tokens": m.accepted_tokens,
        "tau": round(m.mean_acceptance_length, 4),
        "accepted_per_position": m.accepted_per_position,
        "target_forward_passes": m.target_forward_passes,
        "prefix_cache_hit_tokens": m.prefix_hit_tokens,
        "queue_ms": round(queued_s * 1000, 3),
        "ttft_ms": round(ttft_s * 1000, 3),
        "tpot_ms": round(m.tpot_s * 1000, 3),
        "tokens_per_s": round(m.tokens_per_s, 3),
    }


def model_card(name: str, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "draftsmith"}


def event(obj: dict | str) -> str:
    """One server-sent event: `data: <json>` and a blank line."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


DONE = event("[DONE]")
