"""A real draftsmith-serve process for the tests that talk to it over HTTP (test_serve_http, test_replay): started
on a free port, waited for until /health answers, stopped after."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from helpers import ENV


@dataclass
class Server:
    url: str
    log: Path

    def metrics(self, headers: dict[str, str] | None = None) -> dict[str, float]:
        """Every sample of GET /metrics (sent with `headers`: a server with keys asks for one), parsed, as
        name{labels} -> value."""
        text = httpx.get(f"{self.url}/metrics", headers=headers, timeout=30).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(target: Path, tmp: Path, *args: str, env: dict[str, str] | None = None) -> Iterator[Server]:
    """draftsmith-serve on `target` (float32) with `args` (and `env`, else the tests' ENV), its output in
    tmp/server.log."""
    port, log = free_port(), tmp / "server.log"
    args = (f"target.path={target}", "target.dtype=float32", f"port={port}", *args)
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "draftsmith.serve.http", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=ENV if env is None else env,
            cwd=tmp,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, f"draftsmith-serve exited:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"draftsmith-serve did not answer in 120 s:\n{log.read_text()}"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.25)
    try:
        yield Server(url, log)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
