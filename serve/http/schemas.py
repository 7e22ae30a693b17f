"""The chat-completions request as the OpenAI API defines it (pydantic), and the parameters the engine cannot honour.

Unknown fields are refused, as OpenAI refuses them, and types are strict, as OpenAI's are: a bool is not a number
and a string is not a number (pydantic's lax mode would take `true` as 1 and "0" as 0). Parameters of the API the
engine does not implement are listed in UNSUPPORTED with the values that mean "off": any other value is refused,
not ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]] | None = None  # a string, or parts: only {"type": "text", "text": ...}
    name: str | None = None
    # what an assistant message echoed back from a response carries (the openai client's model_dump): null or empty
    refusal: str | None = None
    tool_calls: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    annotations: list[Any] | None = None

    @field_validator("tool_calls", "function_call", "audio")
    @classmethod
    def empty(cls, value: Any) -> Any:
        if value:
            raise ValueError("tool and function calls and audio are not supported: send them empty or null")
        return value


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False  # a last chunk with the usage (and no choices) before [DONE]


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    messages: list[Message] = Field(min_length=1)
    temperature: float | None = Field(None, ge=0, le=2)  # None: 1, as OpenAI; 0: greedy
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)  # not OpenAI's (vLLM's extra_body): 0 = off
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens; wins when both are set
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None  # None: False, as OpenAI
    stream_options: StreamOptions | None = None
    n: int | None = None  # None: 1, as OpenAI
    return_token_ids: bool = False  # not OpenAI's (vLLM's extra_body): the prompt's and the completion's token ids
    user: str | None = None  # an end-user id: adaptation's client when the request has no API key (client.py)
    # not OpenAI's (vLLM's extra_body): requests share prefix-cache entries only with requests of the same salt (and
    # the same API key)
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    # the API's parameters the engine does not implement: refused unless at a value in UNSUPPORTED
    logprobs: bool | None = None
    top_logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None
    reasoning_effort: str | None = None
    store: bool | None = None
    metadata: Any = None
    service_tier: str | None = None
    prediction: Any = None


# parameter -> the values that leave it off (None: not sent); anything else is refused
UNSUPPORTED: dict[str, tuple] = {
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None, False),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "modalities": (None, ["text"]),
    "reasoning_effort": (None,),
    "store": (None, False),
    "metadata": (None, {}),
    "service_tier": (None, "auto", "default"),
    "prediction": (None,),
}
