"""draftsmith-serve's request checks without a server: parse() and the admit steps that need no tokenizer give
the OpenAI API's error (status, param, code) for each bad body, and take what the API takes (null for a default);
an empty folder passed as a drafter is called what it is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftsmith.heads.drafter_folder import read_meta
from draftsmith.serve.drafters import draft_lm
from draftsmith.serve.http.admit import parse, refuse_unsupported, text
from draftsmith.serve.http.errors import APIError


def body(**changes) -> bytes:
    return json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], **changes}).encode()


def refused(raw: bytes) -> APIError:
    with pytest.raises(APIError) as e:
        req = parse(raw)
        refuse_unsupported(req)
        for i, m in enumerate(req.messages):
            text(m, i)
    return e.value


def test_null_n_and_stream_mean_their_defaults():
    req = parse(body(n=None, stream=None))
    refuse_unsupported(req)
    assert not req.stream and req.n in (None, 1)


@pytest.mark.parametrize(
    "changes, param",
    [
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": "8"}, "max_tokens"),
        ({"max_tokens": 8.0}, "max_tokens"),
        ({"temperature": "0"}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"top_p": "1"}, "top_p"),
        ({"seed": False}, "seed"),
        ({"n": True}, "n"),
        ({"stream": 1}, "stream"),
        ({"stream": "true"}, "stream"),
        ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ],
    ids=lambda x: json.dumps(x) if isinstance(x, dict) else x,
)
def test_a_value_of_the_wrong_type_is_refused_not_coerced(changes, param):
    e = refused(body(**changes))
    assert (e.status, e.kind, e.param, e.code) == (400, "invalid_request_error", param, "invalid_value")
    assert param in e.message


def test_numbers_the_api_takes_are_taken():
    req = parse(body(temperature=0, top_p=1, max_tokens=8, seed=3, stream=True))
    assert (req.temperature, req.top_p, req.max_tokens, req.seed, req.stream) == (0, 1, 8, 3, True)


def test_a_message_without_content_is_a_missing_parameter():
    e = refused(body(messages=[{"role": "user"}]))
    assert (e.status, e.param, e.code) == (400, "messages[0].content", "missing_required_parameter")


def test_an_empty_folder_is_not_called_a_target_folder(tmp_path: Path):
    for load in (read_meta, lambda folder: draft_lm(folder, None)):  # type: ignore[arg-type]
        with pytest.raises(FileNotFoundError) as e:
            load(tmp_path)
        message = str(e.value)
        assert "target folder" not in message and "not a draftsmith drafter folder" in message
        assert '"kind"' in message and "model.safetensors" in message


def test_an_assistant_message_echoed_back_from_a_response_is_taken():
    echoed = {"role": "assistant", "content": "Hello", "refusal": None, "tool_calls": None, "function_call": None}
    echoed |= {"audio": None, "annotations": []}
    req = parse(body(messages=[{"role": "user", "content": "Hi"}, echoed, {"role": "user", "content": "More"}]))
    refuse_unsupported(req)
    refuse_unsupported(parse(body(prediction=None)))
    calls = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    e = refused(body(messages=[{"role": "assistant", "content": None, "tool_calls": calls}]))
    assert e.status == 400 and "tool_calls" in (e.param or "")
