"""draftsmith-replay against a real draftsmith-serve process on a tiny random chat target: chats sent at a rate and
closed loop, streamed and not, multi-turn; one log line per request with the response's statistics; a server that
is down named with how to start one; then draftsmith-eval replay=LOG (one log, and two compared window by window)
writes its results JSON, report and plot. The statistics themselves are checked on a hand-made log."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from draftsmith.eval.replay import ServerDown, run_replay
from draftsmith.eval.replay_chats import load_chats
from draftsmith.eval.replay_config import ReplayConfig
from draftsmith.eval.replay_log import read_log
from draftsmith.eval.replay_stats import replay_result
from helpers import ENV, build_tiny_chat_target
from serve_process import free_port, running_server

MODEL = "tiny"
CHATS = [
    {"id": "sea", "messages": [{"role": "user", "content": "Tell me about the sea, the sea."}]},
    {"id": "sys", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]},
    {"id": "two", "category": "chat", "turns": ["Name a colour.", "And another one?"]},
]


@pytest.fixture(scope="module")
def chats_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("chats") / "chats.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in CHATS))
    return path


@pytest.fixture(scope="module")
def logs(smollm2_dir, chats_file, tmp_path_factory) -> dict[str, Path]:
    """Three replays of the chats: at a rate (A), closed loop and streamed (B, the same requests), every turn (C)."""
    tmp = tmp_path_factory.mktemp("replay")
    target = build_tiny_chat_target(tmp / "target", smollm2_dir)
    with running_server(target, tmp, "spec=suffix", f"model_name={MODEL}") as server:
        base = {"chats": str(chats_file), "base_url": f"{server.url}/v1", "max_tokens": 8, "repeat": 2}
        run_replay(ReplayConfig(out=str(tmp / "a.jsonl"), rate=20.0, seed=1, **base))
        run_replay(ReplayConfig(out=str(tmp / "b.jsonl"), stream=True, model=MODEL, **base))
        run_replay(ReplayConfig(out=str(tmp / "c.jsonl"), turns="all", concurrency=2, **{**base, "repeat": 1}))
    return {k: tmp / f"{k}.jsonl" for k in "abc"}


def test_each_request_is_logged_with_its_statistics(logs):
    for name, requests, streamed in (("a", 6, False), ("b", 6, True), ("c", 4, False)):
        log = read_log(logs[name])
        assert len(log.runs) == 1 and log.runs[0]["model"] == MODEL and log.runs[0]["requests_planned"] == requests
        assert [r["index"] for r in log.requests] == list(range(requests))
        for r in log.requests:
            assert r["status"] == "ok" and r["error"] is None, r
            assert r["completion_tokens"] > 0 and r["prompt_tokens"] > 0 and r["latency_s"] > 0
            assert r["draftsmith"]["spec"] == "suffix" and r["draftsmith"]["tau"] >= 1
            assert r["finish_reason"] in ("stop", "length") and isinstance(r["text"], str)
            assert (r["ttft_s"] is not None) == streamed
    a = read_log(logs["a"])
    assert a.runs[0]["rate"] == 20.0 and all(r["scheduled_s"] is not None for r in a.requests)
    assert a.requests[-1]["scheduled_s"] > 0  # Poisson arrivals, spread out
    two = [r for r in read_log(logs["c"]).requests if r["id"] == "two"]
    assert [r["turn"] for r in two] == [0, 1]
    assert two[1]["prompt_tokens"] > two[0]["prompt_tokens"] + two[0]["completion_tokens"]  # with the answer


def test_a_down_server_is_named_with_how_to_start_one(chats_file, tmp_path):
    url = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(ServerDown, match="draftsmith-serve"):
        run_replay(ReplayConfig(out=str(tmp_path / "log.jsonl"), chats=str(chats_file), base_url=url))
    done = subprocess.run(
        [sys.executable, "-m", "draftsmith.eval.replay", f"chats={chats_file}", f"out={tmp_path / 'log.jsonl'}"]
        + [f"base_url={url}"],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    assert done.returncode != 0 and f"no server answers at {url}" in done.stderr
    assert "start one with `draftsmith-serve`" in done.stderr
    assert not (tmp_path / "log.jsonl").exists()


def test_eval_reads_one_log_and_compares_two(logs, tmp_path):
    paths = f"replay=[{logs['a']},{logs['b']}]"
    out = tmp_path / "ev"
    done = subprocess.run(
        [sys.executable, "-m", "draftsmith.eval", paths, "replay_labels=[frozen,adapting]", "window=2", f"out={out}"],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "frozen: 6/6 ok" in done.stdout
    res = json.loads((out / "replay_results.json").read_text())
    assert res["kind"] == "replay" and res["window"] == 2
    assert [s["label"] for s in res["logs"]] == ["frozen", "adapting"]
    for s in res["logs"]:
        assert (s["requests"], s["ok"], s["failed"], len(s["windows"])) == (6, 6, 0, 3)
        assert s["throughput_tokens_per_s"] > 0 and s["latency_s"]["n"] == 6 and s["overall"]["tau"] >= 1
    assert res["logs"][1]["ttft_source"].startswith("client")
    c = res["comparison"]
    assert c["labels"] == ["frozen", "adapting"] and [w["paired"] for w in c["windows"]] == [2, 2, 2]
    assert c["overall"]["paired"] == 6 and c["overall"]["tau_ratio"] > 0
    report = (out / "report.md").read_text()
    assert "adapting over frozen, window by window" in report and "replay_windows.png" in report
    assert (out / "replay_windows.png").stat().st_size > 0


def line(index: int, drafts: int, accepted: int, tokens: int = 10, status: str = "ok", **extra) -> dict:
    stats = {"drafts": drafts, "accepted_tokens": accepted, "tau": 1 + accepted / drafts if drafts else 1.0}
    return {
        "run": 0,
        "index": index,
        "id": f"c{index}",
        "turn": 0,
        "repeat": 0,
        "sent_s": float(index),
        "status": status,
        "latency_s": 1.0,
        "ttft_s": None,
        "completion_tokens": tokens if status == "ok" else None,
        "draftsmith": stats if status == "ok" else None,
        **extra,
    }


def write_log(path: Path, rows: list[dict]) -> str:
    head = {"run": {"model": "m", "base_url": "u", "rate": None}}
    path.write_text("".join(json.dumps(r) + "\n" for r in [head, *rows]))
    return str(path)


def test_windows_pool_counters_and_the_comparison_pairs_requests(tmp_path):
    a = [line(i, 4, 4) for i in range(4)] + [line(4, 0, 0, status="http 503")]
    b = [line(i, 4, 8) for i in range(4)] + [line(4, 4, 8)]
    logs = [read_log(write_log(tmp_path / "a.jsonl", a)), read_log(write_log(tmp_path / "b.jsonl", b))]
    r = replay_result(logs, None, 2)
    first = r.logs[0]
    assert (first.requests, first.ok, first.failures) == (5, 4, {"http 503": 1})
    assert [(w.requests, w.ok, w.tau) for w in first.windows] == [(2, 2, 2.0), (2, 2, 2.0), (1, 0, None)]
    assert first.overall.tau == 2.0 and first.overall.tokens_per_s == 10.0 and first.duration_s == 5.0
    assert first.throughput_tokens_per_s == 40 / 5.0
    c = r.comparison
    assert c is not None and c.labels == ["a", "b"]
    assert [w.paired for w in c.windows] == [2, 2, 0] and c.windows[0].tau_ratio == 1.5
    assert c.overall.tau_ratio_interval == [1.5, 1.5]  # every request's ratio is 1.5: so is every resample's


def test_bad_chats_and_settings_are_refused_naming_them(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x", "messages": [{"role": "tool", "content": "y"}]}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: messages\[0\] needs a role"):
        load_chats(str(bad), None, "first", None)
    with pytest.raises(ValueError, match="exactly one of chats=FILE.jsonl or suite="):
        load_chats(None, None, "first", None)
    with pytest.raises(ValueError, match="rate must be >= 0"):
        ReplayConfig(out="x", rate=-1.0)
    with pytest.raises(ValueError, match="arrivals must be one of poisson, fixed"):
        ReplayConfig(out="x", arrivals="burst")


def test_a_stream_that_fails_after_its_first_chunk_is_logged_as_failed():
    import asyncio

    import httpx
    import openai

    from draftsmith.eval.replay_client import Sampling, send

    def handler(request):
        delta = {"role": "assistant", "content": "hi"}
        chunk = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m"}
        chunk["choices"] = [{"index": 0, "delta": delta, "finish_reason": None}]
        error = {"error": {"message": "engine failed", "type": "server_error", "code": 500}}
        body = f"data: {json.dumps(chunk)}\n\ndata: {json.dumps(error)}\n\ndata: [DONE]\n\n"
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body.encode())

    async def one() -> dict:
        http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        client = openai.AsyncOpenAI(base_url="http://x/v1", api_key="k", http_client=http, max_retries=0)
        return await send(client, [{"role": "user", "content": "q"}], Sampling("m", 8, 0.0, True))

    got = asyncio.run(one())
    assert got["status"] == "stream error" and "engine failed" in got["error"]
