"""One chat-completions request through the official async client, timed at the client: its outcome as a log line's
fields (status, latency, TTFT at the first content chunk when streamed, token counts, the `draftsmith` statistics,
the finish reason, the text). A refused or failed request is an outcome too, never an exception."""

from __future__ import annotations

import time
from dataclasses import dataclass

import openai


@dataclass
class Sampling:
    model: str
    max_tokens: int
    temperature: float
    stream: bool


def outcome(status: str = "ok", error: str | None = None, **fields) -> dict:
    base = {
        "status": status,
        "error": error,
        "latency_s": None,
        "ttft_s": None,
        "prompt_tokens": None,
        "completion_tokens": None,
        "finish_reason": None,
        "draftsmith": None,
        "text": None,
    }
    return {**base, **fields}


async def send(client: openai.AsyncOpenAI, messages: list[dict], s: Sampling) -> dict:
    start = time.perf_counter()
    try:
        fields = await (streamed if s.stream else whole)(client, messages, s, start)
    except openai.APIStatusError as e:
        return outcome(f"http {e.status_code}", api_message(e), latency_s=time.perf_counter() - start)
    except openai.APIConnectionError as e:
        return outcome("connection error", f"{e} ({e.__cause__ or type(e).__name__})")
    except openai.APIError as e:  # an error event in the stream, after a 200 and some chunks
        return outcome("stream error", str(e), latency_s=time.perf_counter() - start)
    return outcome(latency_s=time.perf_counter() - start, **fields)


def api_message(e: openai.APIStatusError) -> str:
    body = e.body if isinstance(e.body, dict) else {}
    error = body.get("error", body)
    return str(error.get("message") if isinstance(error, dict) and error.get("message") else e.message)


def request(messages: list[dict], s: Sampling) -> dict:
    return {"model": s.model, "messages": messages, "max_tokens": s.max_tokens, "temperature": s.temperature}


async def whole(client: openai.AsyncOpenAI, messages: list[dict], s: Sampling, start: float) -> dict:
    r = await client.chat.completions.create(**request(messages, s))
    choice = r.choices[0]
    return {
        "prompt_tokens": r.usage.prompt_tokens if r.usage else None,
        "completion_tokens": r.usage.completion_tokens if r.usage else None,
        "finish_reason": choice.finish_reason,
        "draftsmith": (r.model_extra or {}).get("draftsmith"),
        "text": choice.message.content or "",
    }


async def streamed(client: openai.AsyncOpenAI, messages: list[dict], s: Sampling, start: float) -> dict:
    """SSE: TTFT at the first chunk with text; the statistics, finish reason and usage from the chunks that carry
    them (the usage chunk is asked for with stream_options.include_usage)."""
    fields: dict = {"ttft_s": None}
    pieces: list[str] = []
    stream = await client.chat.completions.create(
        **request(messages, s), stream=True, stream_options={"include_usage": True}
    )
    async for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.content:
                if fields["ttft_s"] is None:
                    fields["ttft_s"] = time.perf_counter() - start
                pieces.append(choice.delta.content)
            if choice.finish_reason:
                fields["finish_reason"] = choice.finish_reason
        if (chunk.model_extra or {}).get("draftsmith") is not None:
            fields["draftsmith"] = chunk.model_extra["draftsmith"]
        if chunk.usage is not None:
            fields["prompt_tokens"], fields["completion_tokens"] = (
                chunk.usage.prompt_tokens,
                chunk.usage.completion_tokens,
            )
    return {**fields, "text": "".join(pieces)}
