#!/usr/bin/env python
"""Load test of draftsmith-serve's bounds, loopback only: while /health is polled (from a process of its
own, a new connection each time) one attacker holding a valid API key sends, all at once, a 20 MB body, 100
slowloris connections (half send their head a line a second, half a whole head then one byte a second of a 100 kB
body), 50 streams opened and never read, and a flood of chat requests; meanwhile another client, with another key,
asks a normal chat request every few seconds. Reports /health's latency (median, p95, max; the target is under
100 ms), whether the normal client was served, what each attack got back, and the server's RSS idle, at its peak and
after (the target: peak within 1.5x idle).

    python benchmarks/serve_load.py --out results.json                # tiny random target, SmolLM2's tokenizer
    python benchmarks/serve_load.py --model smollm2 --duration 60 --out results.json   # the real SmolLM2-135M
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from draftsmith.peers.processes import free_port, wait_healthy

KEYS = ("attacker-key", "normal-key")
MODEL = "load"
CHAT = "/v1/chat/completions"


@dataclass
class LoadConfig:
    model: str = "tiny"  # tiny (a random 3-layer llama with SmolLM2's tokenizer) | smollm2 (the real 135M target)
    spec: str = "ngram"
    duration_s: float = 40.0  # the attack's length: past header_timeout_s (10) and body_timeout_s (30)
    body_mb: float = 20.0
    slowloris: int = 100
    unread_streams: int = 50
    flood_concurrency: int = 100  # the attacker's requests in flight at once, each sent again once answered
    normal_every_s: float = 4.0
    health_every_s: float = 0.05
    server_args: list[str] = field(default_factory=list)  # more draftsmith-serve overrides (key=value)


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    host: str
    port: int


def tiny_target(folder: Path) -> Path:
    """A tiny random llama with the real SmolLM2 tokenizer and chat template (as the tests' tiny_target)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from draftsmith.serve.models.target import TargetConfig, resolve_target

    tokenizer = AutoTokenizer.from_pretrained(resolve_target(TargetConfig()), local_files_only=True)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def start_server(cfg: LoadConfig, work: Path) -> Server:
    port = free_port()
    target = [f"target.path={tiny_target(work / 'tiny')}", "target.dtype=float32"] if cfg.model == "tiny" else []
    args = [*target, f"spec={cfg.spec}", f"port={port}", f"model_name={MODEL}", f"api_key=[{','.join(KEYS)}]"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "offline"}
    log = open(work / "server.log", "w")  # the server's for its lifetime
    cmd = [sys.executable, "-m", "draftsmith.serve.http", *args, *cfg.server_args]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=work)
    server = Server(proc, f"http://127.0.0.1:{port}", "127.0.0.1", port)
    if wait_healthy(proc, server.url):
        return server
    proc.kill()
    tail = (work / "server.log").read_text()[-4000:]
    raise SystemExit(f"draftsmith-serve did not start:\n{tail}")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def chat(max_tokens: int, content: str = "Write a short poem about the sea.", stream: bool = False) -> dict:
    messages = [{"role": "user", "content": content}]
    return {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": stream}


def request_head(key: str, length: int) -> bytes:
    return (
        f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


# -- /health, from a process of its own: the attacker's own event loop does not delay the measure


def poll_health(host: str, port: int, every_s: float, stop, out) -> None:
    """(when, seconds) of each GET /health, a new connection each (seconds None: it failed), until `stop`. A plain
    socket: an HTTP client's own setup (httpx builds an SSL context per call) would be counted as the server's."""
    polls: list[tuple[float, float | None]] = []
    while not stop.is_set():
        when, began = time.time(), time.perf_counter()
        ok = health_once(host, port)
        polls.append((when, time.perf_counter() - began if ok else None))
        time.sleep(every_s)
    out.put(polls)


def health_once(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=10) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            answer = b""
            while chunk := s.recv(4096):
                answer += chunk
    except OSError:
        return False
    return answer.startswith(b"HTTP/1.1 200") and answer.endswith(b'{"status":"ok"}')


def health_summary(polls: list[tuple[float, float | None]], window: tuple[float, float]) -> dict:
    during = [(when, t) for when, t in polls if window[0] <= when <= window[1]]
    failures = sum(t is None for _, t in during)
    timed = [(t * 1000, when - window[0]) for when, t in during if t is not None]
    ms = sorted(t for t, _ in timed)
    if not ms:
        return {"polls": 0, "failures": failures}
    p95 = ms[min(len(ms) - 1, int(0.95 * len(ms)))]
    return {
        "polls": len(ms),
        "failures": failures,
        "over_100ms": sum(t >= 100 for t in ms),
        "slowest_at_s": round(max(timed)[1], 2),  # seconds into the window
        "median_ms": round(statistics.median(ms), 2),
        "p95_ms": round(p95, 2),
        "max_ms": round(ms[-1], 2),
        "under_100ms": ms[-1] < 100 and not failures,
    }


# -- the attacks


async def big_body(server: Server, mb: float) -> dict:
    """A body of `mb` MB with its Content-Length: sent until the server answers or closes. The head goes first, and
    an answer to it alone is waited for a moment (else the reset of a refused body's connection may drop it)."""
    payload = json.dumps(chat(16, "lighthouse " * int(mb * 2**20 / 11))).encode()
    began = time.perf_counter()
    reader, writer = await asyncio.open_connection(server.host, server.port)
    answer = asyncio.create_task(reader.readline())
    sent = 0
    try:
        writer.write(request_head(KEYS[0], len(payload)))
        await asyncio.wait({answer}, timeout=0.5)
        for at in range(0, len(payload), 65536):
            if answer.done():
                break
            writer.write(payload[at : at + 65536])
            await writer.drain()
            sent += 65536
    except (ConnectionError, OSError):
        pass
    try:
        status = (await asyncio.wait_for(answer, 60)).decode(errors="replace").strip()
    except (ConnectionError, OSError, TimeoutError) as e:
        status = f"no answer ({type(e).__name__})"
    writer.close()
    seconds = round(time.perf_counter() - began, 3)
    return {"bytes": len(payload), "sent_before_answer": min(sent, len(payload)), "answer": status, "seconds": seconds}


async def slowloris(server: Server, i: int, stop: asyncio.Event) -> dict:
    """Even i: a request head a line a second, never finished. Odd i: a whole head, then a byte a second of a
    100 kB body. Until the server closes the connection (or answers), or the attack ends."""
    reader, writer = await asyncio.open_connection(server.host, server.port)
    began = time.perf_counter()
    start, drip = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n", b"X-a: b\r\n")
    if i % 2:
        start, drip = request_head(KEYS[0], 100_000), b" "
    answer = asyncio.create_task(reader.read(200))
    try:
        writer.write(start)
        while not stop.is_set() and not answer.done():
            await asyncio.wait({answer}, timeout=1.0)
            if not answer.done():
                writer.write(drip)
    except (ConnectionError, OSError):
        pass
    closed = answer.done()
    got = answer.result() if closed and not answer.exception() else b""
    answer.cancel()
    writer.close()
    status = got.split(b"\r\n", 1)[0].decode(errors="replace")
    after = round(time.perf_counter() - began, 1)
    return {"kind": "body" if i % 2 else "head", "closed_by_server": closed, "after_s": after, "answer": status}


def unread_streams(server: Server, n: int, max_tokens: int) -> list[socket.socket]:
    """n streaming requests sent on plain sockets with small receive buffers, never read."""
    payload = json.dumps(chat(max_tokens, stream=True)).encode()
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect((server.host, server.port))
        s.sendall(request_head(KEYS[0], len(payload)) + payload)
        socks.append(s)
    return socks


async def flood(server: Server, concurrency: int, stop: asyncio.Event) -> dict:
    """`concurrency` chat requests in flight from the attacker's key, each sent again once answered."""
    statuses: Counter[str] = Counter()
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def one(http: httpx.AsyncClient) -> None:
        while not stop.is_set():
            try:
                r = await http.post(CHAT, json=chat(32), headers=auth(KEYS[0]))
                statuses[str(r.status_code)] += 1
                await asyncio.sleep(0.05 if r.status_code == 429 else 0)
            except httpx.HTTPError as e:
                statuses[type(e).__name__] += 1

    async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=120) as http:
        workers = [asyncio.create_task(one(http)) for _ in range(concurrency)]
        await stop.wait()
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    return dict(statuses)


async def normal_client(server: Server, every_s: float, stop: asyncio.Event) -> list[dict]:
    """Another key's chat request every `every_s`, each timed."""
    out = []
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
        while not stop.is_set():
            out.append(await normal_request(http))
            try:
                await asyncio.wait_for(stop.wait(), every_s)
            except TimeoutError:
                pass
    return out


async def normal_request(http: httpx.AsyncClient) -> dict:
    began = time.perf_counter()
    status: int | str  # the HTTP status, or the error that left none
    try:
        r = await http.post(CHAT, json=chat(16, "Hi, how are you?"), headers=auth(KEYS[1]))
        status = r.status_code
    except httpx.HTTPError as e:
        status = type(e).__name__
    return {"status": status, "seconds": round(time.perf_counter() - began, 3)}


async def rss_peak(pid: int, stop: asyncio.Event) -> float:
    peak = 0.0
    while not stop.is_set():
        peak = max(peak, rss_mb(pid))
        await asyncio.sleep(0.2)
    return peak


# -- the run


async def attack(server: Server, cfg: LoadConfig) -> dict:
    began, stop = time.time(), asyncio.Event()
    peak = asyncio.create_task(rss_peak(server.proc.pid, stop))
    normal = asyncio.create_task(normal_client(server, cfg.normal_every_s, stop))
    flooding = asyncio.create_task(flood(server, cfg.flood_concurrency, stop))
    loris = [asyncio.create_task(slowloris(server, i, stop)) for i in range(cfg.slowloris)]
    streams = await asyncio.to_thread(unread_streams, server, cfg.unread_streams, 1024)
    body = await big_body(server, cfg.body_mb)
    await asyncio.sleep(max(0.0, cfg.duration_s - 1))
    stop.set()
    for s in streams:
        s.close()
    window = (began, time.time())
    return {
        "window": window,
        "big_body": body,
        "slowloris": slowloris_summary(await asyncio.gather(*loris)),
        "unread_streams": len(streams),
        "flood": await flooding,
        "normal": await normal,
        "rss_peak_mb": round(await peak, 1),
    }


def slowloris_summary(runs: list[dict]) -> dict:
    out = {}
    for kind in ("head", "body"):
        mine = [r for r in runs if r["kind"] == kind]
        closed = [r for r in mine if r["closed_by_server"]]
        out[kind] = {
            "opened": len(mine),
            "closed_by_server": len(closed),
            "closed_after_s_max": max((r["after_s"] for r in closed), default=None),
            "answers": dict(Counter(r["answer"] for r in closed)),
        }
    return out


def run(cfg: LoadConfig) -> dict:
    with tempfile.TemporaryDirectory(prefix="serve-load-") as tmp:
        server = start_server(cfg, Path(tmp))
        try:
            return measured(server, cfg)
        finally:
            server.proc.terminate()
            server.proc.wait(timeout=60)


def measured(server: Server, cfg: LoadConfig) -> dict:
    time.sleep(2)
    idle = rss_mb(server.proc.pid)
    ctx = mp.get_context("spawn")
    stop, out = ctx.Event(), ctx.Queue()
    poller = ctx.Process(
        target=poll_health, args=(server.host, server.port, cfg.health_every_s, stop, out), daemon=True
    )
    poller.start()
    time.sleep(3)  # the poller starts, and answers a while idle
    try:
        results = asyncio.run(attack(server, cfg))
    finally:
        stop.set()
    polls = out.get(timeout=60)
    window = results.pop("window")
    health = {
        **health_summary(polls, window),
        "idle": health_summary(polls, (polls[0][0] if polls else 0.0, window[0])),
    }
    poller.join(timeout=30)
    time.sleep(3)
    after = asyncio.run(after_attack(server))
    rss = {
        "idle_mb": round(idle, 1),
        "peak_mb": results.pop("rss_peak_mb"),
        "after_mb": round(rss_mb(server.proc.pid), 1),
    }
    rss["peak_over_idle"] = round(rss["peak_mb"] / rss["idle_mb"], 3)
    return {"config": asdict(cfg), "health": health, "rss": rss, **results, "normal_after": after}


async def after_attack(server: Server) -> dict:
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
        return await normal_request(http)


def latencies(h: dict) -> str:
    slow = f", {h['over_100ms']} over 100 ms" if h.get("over_100ms") else ""
    spread = f"{h.get('median_ms')} / {h.get('p95_ms')} / {h.get('max_ms')} ms"
    return f"{spread} ({h['polls']} polls{slow}, {h['failures']} failed)"


def markdown(r: dict) -> str:
    h, rss = r["health"], r["rss"]
    normal = r["normal"]
    served = sum(n["status"] == 200 for n in normal)
    loris = r["slowloris"]
    rows = [
        ("/health median / p95 / max, idle", latencies(h["idle"]), "", ""),
        ("/health median / p95 / max, attacked", latencies(h), "max < 100 ms", "yes" if h.get("under_100ms") else "NO"),
        (
            "normal client (another key)",
            f"{served}/{len(normal)} answered 200, slowest {max((n['seconds'] for n in normal), default=0):.2f} s",
            "all served",
            "yes" if served == len(normal) else "NO",
        ),
        (
            "normal request after",
            f"{r['normal_after']['status']} in {r['normal_after']['seconds']} s",
            "200",
            "yes" if r["normal_after"]["status"] == 200 else "NO",
        ),
        (
            "RSS idle / peak / after",
            f"{rss['idle_mb']} / {rss['peak_mb']} / {rss['after_mb']} MB (peak {rss['peak_over_idle']}x)",
            "peak <= 1.5x idle",
            "yes" if rss["peak_over_idle"] <= 1.5 else "NO",
        ),
        (
            f"{r['config']['body_mb']:g} MB body",
            f"{r['big_body']['answer']} after {r['big_body']['seconds']} s, "
            f"{r['big_body']['sent_before_answer']} bytes sent",
            "413",
            "",
        ),
        (
            "slowloris (head / body)",
            f"closed by the server: {loris['head']['closed_by_server']}/"
            f"{loris['head']['opened']} / {loris['body']['closed_by_server']}/{loris['body']['opened']}",
            "",
            "",
        ),
        ("flood (attacker key)", ", ".join(f"{k}: {v}" for k, v in sorted(r["flood"].items())), "", ""),
        ("unread streams", f"{r['unread_streams']} opened, never read", "", ""),
    ]
    lines = ["| measure | result | target | met |", "|---|---|---|---|"]
    return "\n".join([*lines, *(f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows)])


def parse_args() -> tuple[LoadConfig, Path | None]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = LoadConfig()
    p.add_argument("--model", choices=("tiny", "smollm2"), default=d.model)
    p.add_argument("--spec", default=d.spec)
    p.add_argument("--duration", type=float, default=d.duration_s, help="seconds the attack lasts")
    p.add_argument("--body-mb", type=float, default=d.body_mb)
    p.add_argument("--slowloris", type=int, default=d.slowloris)
    p.add_argument("--unread-streams", type=int, default=d.unread_streams)
    p.add_argument("--flood", type=int, default=d.flood_concurrency, help="the flooder's requests in flight")
    p.add_argument("--server-arg", action="append", default=[], help="a draftsmith-serve override, key=value")
    p.add_argument("--out", type=Path, help="results.json")
    a = p.parse_args()
    cfg = LoadConfig(
        a.model, a.spec, a.duration, a.body_mb, a.slowloris, a.unread_streams, a.flood, server_args=a.server_arg
    )
    return cfg, a.out


def main() -> None:
    cfg, out = parse_args()
    results = run(cfg)
    if out is not None:
        out.write_text(json.dumps(results, indent=2) + "\n")
    print(markdown(results))


if __name__ == "__main__":
    main()
