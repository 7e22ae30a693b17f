"""A request's body -> what the engine runs (prompt ids, token budget, sampling, stop strings), or the APIError
the OpenAI API would answer. Everything is checked here, before the request is queued."""

from __future__ import annotations

import json
from dataclasses import dataclass

from pydantic import ValidationError

from draftsmith.serve.engine.sampling import SamplingParams
from draftsmith.serve.http.bounds import Bounds
from draftsmith.serve.http.chat_text import ChatEncoder
from draftsmith.serve.http.errors import APIError, invalid
from draftsmith.serve.http.json_checks import MAX_DEPTH, check_json
from draftsmith.serve.http.schemas import UNSUPPORTED, ChatRequest, Message

MAX_STOP = 4  # stop strings per request, as OpenAI allows
GREEDY_BELOW = 1e-5  # a temperature below this is greedy, as vLLM takes it (1/T would overflow the logits)
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes
TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}  # pydantic's union tags (or with a "[")


@dataclass
class Limits:
    """What a request is checked against."""

    model_name: str
    context: int  # prompt + completion tokens the engine holds
    default_max_tokens: int | None  # a request's budget when it sets none; None: what the context has left
    bounds: Bounds  # messages, characters, stop strings


@dataclass
class Admitted:
    request: ChatRequest
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    stop: list[str]


def parse(body: bytes) -> ChatRequest:
    try:
        data = json.loads(body)
    except RecursionError:
        raise too_deep() from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, and an integer past Python's 4300 digits
        raise invalid(
            f"We could not parse the JSON body of your request ({e}). The body must be a JSON object; "
            "check the JSON and the Content-Type: application/json header."
        ) from None
    if not isinstance(data, dict):
        raise invalid(f"The body of your request must be a JSON object, got a JSON {type(data).__name__}.")
    check_json(data)
    try:
        return ChatRequest.model_validate(data)
    except ValidationError as e:
        raise refusal(e) from None


def too_deep() -> APIError:
    return invalid(
        f"The JSON body of your request is nested too deeply (a chat-completions request needs under {MAX_DEPTH} "
        "levels).",
        None,
        "invalid_value",
    )


def refusal(e: ValidationError) -> APIError:
    """The first validation error, worded as OpenAI words it."""
    err = e.errors()[0]
    where = dotted(err["loc"])
    if err["type"] == "missing":
        return invalid(f"Missing required parameter: '{where}'.", where, "missing_required_parameter")
    if err["type"] == "extra_forbidden":
        return invalid(f"Unrecognized request argument supplied: {where}", where, "unknown_parameter")
    return invalid(f"Invalid '{where}': {err['msg']}.", where, "invalid_value")


def dotted(loc: tuple) -> str:
    """('messages', 0, 'role') -> messages[0].role; a union member's tag ('str', 'list[str]') is left out."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.lower() not in TYPE_TAGS and "[" not in part:
            out += f".{part}" if out else part
    return out


def admit(req: ChatRequest, encoder: ChatEncoder, limits: Limits) -> Admitted:
    if req.model != limits.model_name:
        raise APIError(
            404,
            f"The model `{req.model}` does not exist. This server serves `{limits.model_name}` (GET /v1/models).",
            "model",
            "model_not_found",
        )
    refuse_unsupported(req)
    chat = messages_in_bounds(req.messages, limits)
    prompt_ids = encode(encoder, chat)
    stop = stop_strings(req, limits.bounds.stop_chars)
    return Admitted(req, prompt_ids, budget(req, len(prompt_ids), limits), sampling(req), stop)


def messages_in_bounds(messages: list[Message], limits: Limits) -> list[dict]:
    """The chat the template takes, refused before any template or tokenizer runs when it cannot fit: more
    messages, or more characters, than the context could hold."""
    bounds = limits.bounds
    if len(messages) > bounds.messages:
        raise invalid(
            f"Your request has {len(messages)} messages; this server takes at most {bounds.messages} "
            f"(limits.max_messages; the model's context is {limits.context} tokens). Send fewer.",
            "messages",
            "context_length_exceeded",
        )
    chat = [
        {"role": "system" if m.role == "developer" else m.role, "content": text(m, i)} for i, m in enumerate(messages)
    ]
    chars = sum(len(m["content"]) for m in chat)
    if chars > bounds.prompt_chars:
        raise invalid(
            f"Your messages hold {chars} characters; this server takes at most {bounds.prompt_chars} "
            f"(limits.max_prompt_chars), more than its {limits.context}-token context could hold. Shorten them.",
            "messages",
            "context_length_exceeded",
        )
    return chat


def refuse_unsupported(req: ChatRequest) -> None:
    if req.n not in (None, 1):
        raise invalid(
            f"n={req.n} is not supported: draftsmith-serve makes one choice per request (its engine runs batch 1). "
            "Send n=1, or the request n times with different seeds.",
            "n",
            "unsupported_value",
        )
    for name, off in UNSUPPORTED.items():
        if getattr(req, name) not in off:
            raise invalid(
                f"'{name}' is not supported by draftsmith-serve; leave it out (docs/serving.md lists what is).",
                name,
                "unsupported_parameter",
            )
    if req.stream_options is not None and not req.stream:
        raise invalid("The 'stream_options' parameter is only allowed when 'stream' is enabled.", "stream_options")


def encode(encoder: ChatEncoder, chat: list[dict]) -> list[int]:
    try:
        return encoder.encode(chat)
    except Exception as e:  # the template's own checks (e.g. roles out of order) are the client's to fix
        raise invalid(f"The messages do not fit the model's chat template: {e}", "messages") from None


def text(m: Message, i: int) -> str:
    if m.content is None:
        if m.role != "assistant":
            where = f"messages[{i}].content"
            raise invalid(f"Missing required parameter: '{where}'.", where, "missing_required_parameter")
        return ""
    if isinstance(m.content, str):
        return m.content
    pieces = []
    for j, part in enumerate(m.content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise invalid(
                f"Invalid 'messages[{i}].content[{j}]': only text parts ({{'type': 'text', 'text': ...}}) are "
                f"supported, got type {part.get('type')!r}.",
                f"messages[{i}].content[{j}]",
                "unsupported_value",
            )
        pieces.append(part["text"])
    return "\n".join(pieces)


def budget(req: ChatRequest, prompt_len: int, limits: Limits) -> int:
    """max_new_tokens: what the request asks, refused past the context; else what the server gives by default."""
    newer = req.max_completion_tokens is not None
    asked, param = (req.max_completion_tokens, "max_completion_tokens") if newer else (req.max_tokens, "max_tokens")
    if asked is not None and asked < 1:
        raise invalid(
            f"Invalid '{param}': integer below minimum value. Expected a value >= 1, but got {asked} instead.",
            param,
            "integer_below_min_value",
        )
    room = limits.context - prompt_len
    if room < 1:
        raise invalid(
            f"This model's maximum context length is {limits.context} tokens. However, your messages resulted in "
            f"{prompt_len} tokens, which leaves no room for a completion. Please reduce the length of the messages.",
            "messages",
            "context_length_exceeded",
        )
    if asked is not None and asked > room:
        raise invalid(
            f"This model's maximum context length is {limits.context} tokens. However, you requested "
            f"{prompt_len + asked} tokens ({prompt_len} in the messages, {asked} in the completion). Please reduce "
            "the length of the messages or completion.",
            param,
            "context_length_exceeded",
        )
    if asked is not None:
        return asked
    return min(room, limits.default_max_tokens or room)


def sampling(req: ChatRequest) -> SamplingParams:
    if req.seed is not None and not SEED_RANGE[0] <= req.seed <= SEED_RANGE[1]:
        raise invalid(f"Invalid 'seed': {req.seed} is outside the 64-bit range.", "seed", "invalid_value")
    temperature = 1.0 if req.temperature is None else req.temperature  # OpenAI's default
    if temperature < GREEDY_BELOW:
        temperature = 0.0
    top_p = 1.0 if req.top_p is None else req.top_p
    return SamplingParams(temperature, top_p, req.top_k or 0, req.seed)


def stop_strings(req: ChatRequest, max_chars: int) -> list[str]:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP:
        raise invalid(f"Invalid 'stop': at most {MAX_STOP} stop strings, got {len(stop)}.", "stop", "invalid_value")
    if any(not s for s in stop):
        raise invalid("Invalid 'stop': a stop string must not be empty.", "stop", "invalid_value")
    if (longest := max((len(s) for s in stop), default=0)) > max_chars:
        raise invalid(
            f"Invalid 'stop': a stop string of {longest} characters; this server takes at most {max_chars} "
            "(limits.max_stop_chars).",
            "stop",
            "invalid_value",
        )
    return stop
