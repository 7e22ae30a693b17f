"""draftsmith-serve as a client sees it: one real server process (python -m draftsmith.serve.http) on a tiny random
chat target, talked to with the official openai client and with raw HTTP: greedy output equal to plain decoding
token for token, streaming equal to non-streaming, multi-turn prefix-cache reuse, sampling and stop
strings, every bad input of the list with the OpenAI API's status and error body (and the server still serving),
a client leaving mid-stream, 100 concurrent connections, /metrics in the Prometheus text format.

The server drafts by suffix decoding: a random model's output seldom repeats itself (n-gram lookup finds little), but
suffix decoding drafts a request from the responses before it, so a repeated prompt is drafted and accepted whole."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import openai
import pytest
from hydra import compose, initialize_config_module

from draftsmith.serve.__main__ import GenerateConfig
from draftsmith.serve.__main__ import run as generate
from draftsmith.serve.build import build_engine
from draftsmith.serve.engine.sampling import SamplingParams
from draftsmith.serve.http.config import ServeConfig
from draftsmith.serve.http.detok import TextStream
from draftsmith.serve.http.errors import APIError
from draftsmith.serve.http.metrics import ServeMetrics
from draftsmith.serve.http.worker import Done, Failed, Job, Worker
from draftsmith.serve.models.target import TargetConfig, encode_chat, load_target
from draftsmith.serve.shared.cli import typed
from draftsmith.serve.spec import SpecConfig
from helpers import said, user
from serve_process import running_server

MODEL = "tiny"
NEW = 24
PROMPT = "Tell me about the sea, the sea, the sea."


@pytest.fixture(scope="module")
def server(tiny_target, tmp_path_factory):
    args = ["spec=suffix", f"model_name={MODEL}", "max_tokens=64"]
    with running_server(tiny_target, tmp_path_factory.mktemp("serve"), *args) as server:
        yield server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def chat(client, messages, **kw):
    return client.chat.completions.create(model=MODEL, messages=messages, **kw)


def test_models_lists_the_target(client, server):
    assert [m.id for m in client.models.list()] == [MODEL]
    frozen = re.search(r"(\d+) startup objects out of the collector's sweeps", server.log.read_text())
    assert frozen and int(frozen.group(1)) > 10_000  # serve() froze its start-up heap before serving
    assert client.models.retrieve(MODEL).owned_by == "draftsmith"


def test_greedy_output_equals_plain_decoding_token_for_token(client, tiny_target, capsys):
    r = chat(client, [user(PROMPT)], temperature=0, max_tokens=NEW, extra_body={"return_token_ids": True})
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.model == MODEL and r.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert (r.usage.completion_tokens, r.usage.total_tokens) == (NEW, r.usage.prompt_tokens + NEW)
    # the engine directly, plain decoding: the same tokens
    target = load_target(TargetConfig(path=str(tiny_target), dtype="float32"))
    prompt_ids = encode_chat(target.tokenizer, [user(PROMPT)])
    plain = build_engine(target, SpecConfig("ar"), False, 4096).generate(prompt_ids, NEW, SamplingParams())
    assert r.model_extra["prompt_token_ids"] == prompt_ids
    assert choice.model_extra["token_ids"] == plain.output_ids
    # draftsmith-generate's text
    generate(
        GenerateConfig(prompt=PROMPT, target=TargetConfig(path=str(tiny_target), dtype="float32"), max_new_tokens=NEW)
    )
    assert capsys.readouterr().out.split("\n\n[ar]")[0] == choice.message.content
    # again: drafted from the first response (suffix decoding's global tree), accepted, and still the same tokens
    again = chat(client, [user(PROMPT)], temperature=0, max_tokens=NEW, extra_body={"return_token_ids": True})
    assert again.choices[0].model_extra["token_ids"] == plain.output_ids
    stats = again.model_extra["draftsmith"]
    assert stats["spec"] == "suffix" and stats["drafts"] > 0 and stats["accepted_tokens"] > NEW // 2
    assert stats["tau"] == pytest.approx(1 + stats["accepted_tokens"] / stats["drafts"], abs=1e-4)
    assert stats["target_forward_passes"] < NEW // 2  # fewer target passes than tokens


def test_streaming_sends_the_same_output_in_chunks(client):
    whole = chat(client, [user(PROMPT)], temperature=0, max_tokens=NEW, extra_body={"return_token_ids": True})
    chunks = list(
        chat(
            client,
            [user(PROMPT)],
            temperature=0,
            max_tokens=NEW,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"return_token_ids": True},
        )
    )
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    texts = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert len([t for t in texts if t]) > 1  # the text came in pieces
    assert "".join(texts) == whole.choices[0].message.content
    ids = [t for c in chunks if c.choices for t in c.choices[0].model_extra.get("token_ids", [])]
    assert ids == whole.choices[0].model_extra["token_ids"]
    last, tail = chunks[-2], chunks[-1]
    assert last.choices[0].finish_reason == "length" and last.model_extra["draftsmith"]["drafts"] > 0
    assert tail.choices == [] and tail.usage.completion_tokens == NEW


def test_a_later_turn_reuses_the_prefix_cache(client, server):
    system = {"role": "system", "content": "You answer questions about lighthouses, briefly, in plain words. " * 3}
    first = chat(client, [system, user("Why are lighthouses tall?")], temperature=0, max_tokens=8)
    before = server.metrics()["draftsmith_prefix_cache_hit_tokens_total"]
    turns = [system, user("Why are lighthouses tall?"), said(first.choices[0].message.content), user("And red?")]
    second = chat(client, turns, temperature=0, max_tokens=8)
    hit = second.model_extra["draftsmith"]["prefix_cache_hit_tokens"]
    p1 = first.usage.prompt_tokens
    assert first.model_extra["draftsmith"]["prefix_cache_hit_tokens"] < 16  # a new system prompt: at most a block
    assert p1 >= 48 and hit >= 16 * (p1 // 16)  # every full block of the first turn's prompt came from the cache
    assert server.metrics()["draftsmith_prefix_cache_hit_tokens_total"] == before + hit


def test_sampling_settings_reach_the_engine(client):
    greedy = chat(client, [user(PROMPT)], temperature=0, max_tokens=12).choices[0].message.content
    # top_k=1 (or a tiny top_p) leaves one token to sample: whatever the temperature, the greedy output
    one = chat(client, [user(PROMPT)], temperature=1.5, max_tokens=12, seed=1, extra_body={"top_k": 1})
    assert one.choices[0].message.content == greedy
    assert chat(client, [user(PROMPT)], max_tokens=12, top_p=1e-9).choices[0].message.content == greedy
    sampled = chat(client, [user(PROMPT)], temperature=1.0, top_p=0.95, max_tokens=12, seed=3)
    assert sampled.usage.completion_tokens == 12 and sampled.model_extra["draftsmith"]["tau"] >= 1


def test_a_stop_string_ends_the_text_before_it(client):
    full = chat(client, [user(PROMPT)], temperature=0, max_tokens=NEW).choices[0].message.content
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    expected = full[: full.find(stop)]
    r = chat(client, [user(PROMPT)], temperature=0, max_tokens=NEW, stop=[stop, "never in the text \u2603"])
    assert r.choices[0].message.content == expected and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < NEW  # the engine stopped there
    chunks = list(chat(client, [user(PROMPT)], temperature=0, max_tokens=NEW, stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def body(**changes) -> dict:
    return {"model": MODEL, "messages": [user("Hi")], "max_tokens": 4, **changes}


LONG = " ".join(["lighthouse"] * 1100)  # past the tiny target's 1024-token context


@pytest.mark.parametrize(
    "payload, status, param, code",
    [
        (b'{"model": "tiny", "messages": [', 400, None, None),  # malformed JSON
        (b"[1, 2]", 400, None, None),
        ({"model": MODEL}, 400, "messages", "missing_required_parameter"),
        (body(model="gpt-4o"), 404, "model", "model_not_found"),
        (body(messages=[user(LONG)]), 400, "messages", "context_length_exceeded"),
        (body(max_tokens=0), 400, "max_tokens", "integer_below_min_value"),
        (body(max_tokens=-5), 400, "max_tokens", "integer_below_min_value"),
        (body(max_tokens=10**12), 400, "max_tokens", "context_length_exceeded"),
        (body(max_completion_tokens=0), 400, "max_completion_tokens", "integer_below_min_value"),
        (body(n=2), 400, "n", "unsupported_value"),
        (body(logprobs=True), 400, "logprobs", "unsupported_parameter"),
        (body(presence_penalty=0.5), 400, "presence_penalty", "unsupported_parameter"),
        (body(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools", "unsupported_parameter"),
        (body(min_p=0.1), 400, "min_p", "unknown_parameter"),
        (body(temperature=3), 400, "temperature", "invalid_value"),
        (body(top_p=0), 400, "top_p", "invalid_value"),
        (body(stop=["a", "b", "c", "d", "e"]), 400, "stop", "invalid_value"),
        (body(messages=[]), 400, "messages", "invalid_value"),
        (body(messages=[{"role": "tool", "content": "x"}]), 400, "messages[0].role", "invalid_value"),
        (
            body(messages=[user([{"type": "image_url", "image_url": {"url": "x"}}])]),
            400,
            "messages[0].content[0]",
            None,
        ),
        (body(stream_options={"include_usage": True}), 400, "stream_options", None),
        (body(max_tokens=True), 400, "max_tokens", "invalid_value"),
        (body(temperature="0"), 400, "temperature", "invalid_value"),
        (body(messages=[{"role": "user"}]), 400, "messages[0].content", "missing_required_parameter"),
    ],
    ids=[
        "malformed-json",
        "not-an-object",
        "no-messages",
        "unknown-model",
        "prompt-past-context",
        "max-tokens-0",
        "max-tokens-negative",
        "max-tokens-huge",
        "max-completion-tokens-0",
        "n-2",
        "logprobs",
        "presence-penalty",
        "tools",
        "unknown-field",
        "temperature-3",
        "top-p-0",
        "five-stops",
        "empty-messages",
        "tool-role",
        "image-part",
        "stream-options-unstreamed",
        "max-tokens-bool",
        "temperature-string",
        "message-without-content",
    ],
)
def test_bad_input_gets_the_openai_error_and_the_server_goes_on(server, payload, status, param, code):
    content = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    r = httpx.post(f"{server.url}/v1/chat/completions", content=content, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    if code is not None:
        assert error["code"] == code
    ok = httpx.post(f"{server.url}/v1/chat/completions", json=body(temperature=0, n=None, stream=None), timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4


def test_the_openai_client_reads_the_errors(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=[user("Hi")])
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="n=3 is not supported"):
        chat(client, [user("Hi")], n=3)
    r = httpx.get(f"{client.base_url}nowhere", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["message"].startswith("Not found")


def test_a_client_leaving_mid_stream_stops_its_request(server, client):
    before = server.metrics()
    request = body(max_tokens=900, stream=True, temperature=0)
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=request, timeout=60) as r:
        lines = r.iter_lines()
        got = [line for line in (next(lines) for _ in range(6)) if line.startswith("data: ")]
        assert len(got) == 3  # the role chunk and two pieces of text, then the client leaves
    key = 'draftsmith_requests_total{finish_reason="abort"}'
    deadline = time.monotonic() + 30
    while (after := server.metrics())[key] < before[key] + 1:
        assert time.monotonic() < deadline, "the request was not stopped"
        time.sleep(0.1)
    made = after["draftsmith_generation_tokens_total"] - before["draftsmith_generation_tokens_total"]
    assert 2 <= made < 900  # stopped at its next step, not run to max_tokens
    assert chat(client, [user("Hi")], temperature=0, max_tokens=3).usage.completion_tokens == 3  # the next is served


def test_a_hundred_concurrent_connections_are_all_answered(server):
    async def one(http: httpx.AsyncClient, i: int) -> httpx.Response:
        stream = i % 2 == 1
        return await http.post("/v1/chat/completions", json=body(max_tokens=3, temperature=0, stream=stream))

    async def all_at_once() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=120) as http:
            return await asyncio.gather(*(one(http, i) for i in range(100)))

    responses = asyncio.run(all_at_once())
    assert [r.status_code for r in responses] == [200] * 100
    assert all(r.json()["usage"]["completion_tokens"] == 3 for r in responses[::2])
    assert all(r.text.endswith("data: [DONE]\n\n") for r in responses[1::2])
    waited = [r.json()["draftsmith"]["queue_ms"] for r in responses[::2]]
    assert max(waited) > 10 * min(waited)  # they queued for the one engine


def test_metrics_are_prometheus_text(server):
    m = server.metrics()
    for family in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds"):
        count = m[f"draftsmith_{family}_count"]
        assert count > 0 and m[f'draftsmith_{family}_bucket{{le="+Inf"}}'] == count
    done = sum(m[f'draftsmith_requests_total{{finish_reason="{r}"}}'] for r in ("stop", "length"))
    assert done >= 100 and m['draftsmith_requests_total{finish_reason="error"}'] == 0
    assert m["draftsmith_spec_decode_drafts_total"] > 0 and m["draftsmith_spec_decode_mean_acceptance_length"] > 1
    tau = 1 + m["draftsmith_spec_decode_accepted_tokens_total"] / m["draftsmith_spec_decode_drafts_total"]
    assert m["draftsmith_spec_decode_mean_acceptance_length"] == pytest.approx(tau)
    assert m["draftsmith_generation_tokens_per_second"] > 0 and m["draftsmith_requests_running"] == 0
    assert m['draftsmith_server_info{model="tiny",spec="suffix"}'] == 1


class Chars:
    """A tokenizer whose tokens are characters (id = code point): enough for TextStream."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def pieces(stop: list[str], text: str) -> tuple[list[str], bool]:
    s = TextStream(Chars(), stop)
    out = [s.push([ord(c)]) for c in text]
    return out + [s.flush()], s.stopped


def test_text_stream_holds_back_what_may_begin_a_stop_string():
    out, stopped = pieces(["STOP"], "abc STOx STOP tail")
    assert "".join(out) == "abc STOx " and stopped
    assert out[4:8] == ["", "", "", "STOx"]  # "STO" waited until "x" showed it was not the stop string
    out, stopped = pieces(["zz"], "no stop here")
    assert "".join(out) == "no stop here" and not stopped and out == [*"no stop here", ""]
    out, _ = pieces(["bc", "abcd"], "xxabcd")
    assert "".join(out) == "xxa"  # the earliest stop string wins


def test_a_full_queue_refuses_with_503_and_stop_cancels_what_waits():
    loop = asyncio.new_event_loop()
    worker = Worker(None, Chars(), ServeMetrics("m", "ngram"), max_queue=2)  # not started: nothing takes jobs
    jobs = [Job([1, 2], 4, SamplingParams(), [], loop) for _ in range(3)]
    worker.submit(jobs[0])
    worker.submit(jobs[1])
    with pytest.raises(APIError) as e:
        worker.submit(jobs[2])
    assert e.value.status == 503 and e.value.body()["error"]["code"] == "overloaded"
    worker.stop()  # the waiting jobs are cancelled and told so
    loop.run_until_complete(asyncio.sleep(0))
    for job in jobs[:2]:
        assert job.cancelled.is_set() and job.events.get_nowait() == Done(None, "abort")
    loop.close()


class Broken:
    def generate(self, *args):
        raise RuntimeError("boom")


def test_an_engine_failure_fails_the_request_not_the_worker():
    loop = asyncio.new_event_loop()
    metrics = ServeMetrics("m", "ngram")
    worker = Worker(Broken(), Chars(), metrics, max_queue=4)
    worker.start()
    jobs = [Job([1, 2], 4, SamplingParams(), [], loop) for _ in range(2)]
    for job in jobs:
        worker.submit(job)
    while not all(job.ended for job in jobs):
        time.sleep(0.01)
    worker.stop()
    loop.run_until_complete(asyncio.sleep(0))
    assert not worker.thread.is_alive()
    assert [job.events.get_nowait() for job in jobs] == [
        Failed("The engine failed on this request: RuntimeError: boom")
    ] * 2
    assert b'draftsmith_requests_total{finish_reason="error"} 2.0' in metrics.render()
    loop.close()


def test_serve_config_refuses_bad_settings():
    def compose_serve(overrides: list[str]) -> ServeConfig:
        with initialize_config_module("draftsmith.conf", version_base=None):
            return typed(compose("serve", overrides), ServeConfig)

    assert compose_serve(["port=9000"]).port == 9000 and compose_serve([]).spec.name == "ngram"
    with pytest.raises(ValueError, match="port must be in"):
        compose_serve(["port=70000"])
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        compose_serve(["max_tokens=0"])


def test_the_startup_heap_leaves_the_collectors_sweeps():
    """What start-up loaded is frozen: a full collection afterwards sweeps only what was made since, so its pause
    does not grow with the model and libraries (docs/serving.md, Security)."""
    import gc

    from draftsmith.serve.http.server import freeze_startup_heap

    try:
        frozen = freeze_startup_heap()
        # torch and the test session's modules at least; a thread an earlier test left may freeze a few more since,
        # or free a few frozen ones (a frozen object still goes when its last reference does)
        assert frozen > 10_000 and abs(gc.get_freeze_count() - frozen) < frozen / 100
        assert len(gc.get_objects()) < frozen / 10  # what the collector still tracks
    finally:
        gc.unfreeze()
