#!/usr/bin/env python
"""The domain-shift experiment: a drafter trained on ShareGPT serves code, then documentation, frozen or adapting.

Three draftsmith-serve processes on the real SmolLM2-135M target: `frozen` (the head as trained), `adapting` (the same
head, adapt=true: its traffic captured and the trainer beside it publishing versions it swaps in) and `plain` (no
draft). The stream is HumanEval's chat prompts, then pydocs' (questions on Python standard-library documentation);
each stream request goes to all three arms in a rotating order, greedy, then the machine idles `--gap` seconds (the
stream's arrival rate leaves the trainer that idle time). Every output is checked identical to plain decoding's.
The trainer is paused (SIGSTOP) in every other block of `--block` requests, serving time and all, so that serving
throughput with the trainer running and paused is measured side by side on the same stream.

After the stream the adapting server stops; its live version, served frozen by a fourth server, and the original head
answer held-out prompts of both domains the stream never contained, again interleaved with plain decoding.

    python benchmarks/domain_shift.py --out runs/domain-shift           # ~30 min on a 2-core CPU
    python benchmarks/domain_shift.py --stream 16 --heldout 8 --gap 1   # a quick look
The report (JSON, Markdown, PNG) is written by domain_shift_report.py (beside it) at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import httpx  # noqa: E402
from tqdm import tqdm  # noqa: E402

from draftsmith.eval.prompts import Prompt  # noqa: E402
from draftsmith.eval.suites import SuiteConfig, load_suite  # noqa: E402
from draftsmith.peers.processes import free_port, stop  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from domain_shift_report import report  # noqa: E402

MODEL = "smollm2-135m"
# the quick recipe's lr; 2 threads: the trainer runs at the lowest priority, on what serving leaves idle
ADAPTATION = ["adaptation.lr=1e-3", "adaptation.publish_every=16", "adaptation.steps=60", "adaptation.threads=2"]
DOMAINS = {"code": SuiteConfig("humaneval", chat=True), "docs": SuiteConfig("pydocs")}


@dataclass
class Arm:
    name: str
    url: str
    proc: subprocess.Popen
    log: list[dict] = field(default_factory=list)


def split(n_stream: int, n_heldout: int) -> tuple[list[tuple[str, Prompt]], list[tuple[str, Prompt]]]:
    """Per domain: every 4th prompt is held out (up to n_heldout), the stream takes n_stream of the rest; the stream
    is all of code, then all of docs."""
    stream, heldout = [], []
    for domain, suite in DOMAINS.items():
        prompts = load_suite(suite)
        heldout += [(domain, p) for p in prompts[::4][:n_heldout]]
        rest = [p for i, p in enumerate(prompts) if i % 4]
        stream += [(domain, p) for p in rest[:n_stream]]
    return stream, heldout


STARTED: list[subprocess.Popen] = []  # every server this run started: stopped at the end, whatever happens


def start(name: str, overrides: list[str], out: Path) -> Arm:
    port = free_port()
    cmd = [sys.executable, "-m", "draftsmith.serve.http", f"port={port}", f"model_name={MODEL}", *overrides]
    log = open(out / f"server-{name}.log", "w")  # noqa: SIM115 (the server's lifetime)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=out)
    STARTED.append(proc)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 600
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"draftsmith-serve {name} did not start; see {out / f'server-{name}.log'}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return Arm(name, url, proc)
        except httpx.TransportError:
            time.sleep(0.5)


def ask(arm: Arm, prompt: Prompt, max_tokens: int) -> dict:
    """One greedy chat request; what it made and what it cost, from the response's own fields."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt.turns[0]}], "max_tokens": max_tokens}
    body |= {"temperature": 0, "return_token_ids": True}
    begin = time.perf_counter()
    r = httpx.post(f"{arm.url}/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    took, reply = time.perf_counter() - begin, r.json()
    stats = reply["draftsmith"]
    ids = reply["choices"][0]["token_ids"]
    return {"id": prompt.id, "tokens": len(ids), "ids": ids, "latency_s": took} | {
        k: stats[k] for k in ("tau", "drafts", "accepted_tokens", "tokens_per_s", "target_forward_passes")
    }


def gauge(arm: Arm, name: str) -> float:
    """One unlabelled sample of the arm's /metrics; 0 where it has none."""
    for line in httpx.get(f"{arm.url}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def trainer_pid(ws: Path) -> int | None:
    try:
        return int((ws / "trainer.pid").read_text())
    except (OSError, ValueError):
        return None


def pause_trainer(ws: Path, paused: bool) -> None:
    pid = trainer_pid(ws)
    if pid is not None:
        try:
            os.killpg(pid, signal.SIGSTOP if paused else signal.SIGCONT)
        except ProcessLookupError:
            pass


def serve_round(arms: list[Arm], i: int, domain: str, prompt: Prompt, args, extra: dict) -> None:
    """Prompt i through every arm, the order rotating with i; outputs checked against plain decoding's."""
    records = {}
    for arm in arms[i % len(arms) :] + arms[: i % len(arms)]:
        records[arm.name] = ask(arm, prompt, args.max_tokens) | {"index": i, "domain": domain, **extra}
    plain = records["plain"]["ids"]
    for name, rec in records.items():
        rec["identical"] = rec.pop("ids") == plain
        next(a for a in arms if a.name == name).log.append(rec)
    if not all(r["identical"] for r in records.values()):
        print(f"OUTPUT DIFFERS from plain decoding on {prompt.id}", file=sys.stderr)


def run_stream(arms: list[Arm], stream: list, ws: Path, args) -> float:
    """The stream through every arm; the trainer paused in odd blocks. Returns the stream's wall seconds."""
    adapting = next(a for a in arms if a.name == "adapting")
    begin = time.perf_counter()
    for i, (domain, prompt) in enumerate(tqdm(stream, desc="stream", unit="req", dynamic_ncols=True)):
        paused = (i // args.block) % 2 == 1
        pause_trainer(ws, paused)
        serve_round(arms, i, domain, prompt, args, {"trainer": "paused" if paused else "running"})
        adapting.log[-1]["version"] = int(gauge(adapting, "draftsmith_adapt_head_version"))
        pause_trainer(ws, False)  # the idle time between requests is the trainer's either way
        time.sleep(args.gap)
    return time.perf_counter() - begin


def replay_cache(head: Path) -> str | None:
    """The feature cache the head was trained on (train=quick caches its features), found by its target and
    layers; None when there is none."""
    config = json.loads((head / "config.json").read_text())
    root = Path(os.environ.get("DRAFTSMITH_CACHE", Path.home() / ".cache" / "draftsmith")) / "features"
    for manifest in sorted(root.glob("*/manifest.json")):
        made = json.loads(manifest.read_text())
        if made["target"] == config["target"]["id"] and set(config["config"]["target_layers"]) <= set(made["layers"]):
            return str(manifest.parent)
    return None


def stream_phase(args, out: Path, ws: Path) -> tuple[list[Arm], float, str, float]:
    stream, _ = split(args.stream, args.heldout)
    head, replay = Path(args.head).resolve(), replay_cache(Path(args.head))
    spec = ["spec=eagle3", f"spec.drafter={head}", *args.spec]
    adapt = ["adapt=true", f"adaptation.dir={ws}", f"adaptation.replay={replay}", *args.adaptation]
    arms = [
        start("frozen", spec, out),
        start("adapting", spec + adapt, out),
        start("plain", ["spec=ar"], out),
    ]
    for arm in arms:  # warm-up: first-call costs, outside the measurement
        ask(arm, Prompt("warm-up", ["Hello!"], False, "warm-up"), 8)
    wall = run_stream(arms, stream, ws, args)
    cpu = gauge(arms[1], "draftsmith_adapt_trainer_cpu_seconds")
    stop(arms[1].proc)
    live = json.loads((ws / "live.json").read_text())["live"]
    return arms, wall, live, cpu


def heldout_phase(args, out: Path, ws: Path, live: str, frozen: Arm, plain: Arm) -> list[Arm]:
    _, heldout = split(args.stream, args.heldout)
    adapted = start("adapted", ["spec=eagle3", f"spec.drafter={ws / 'versions' / live}", *args.spec], out)
    ask(adapted, Prompt("warm-up", ["Hello!"], False, "warm-up"), 8)
    arms = [Arm("frozen", frozen.url, frozen.proc), adapted, Arm("plain", plain.url, plain.proc)]
    for i, (domain, prompt) in enumerate(tqdm(heldout, desc="held-out", unit="req", dynamic_ncols=True)):
        serve_round(arms, i, domain, prompt, args, {})
    stop(adapted.proc)
    return arms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", default="runs/main/eagle3/final", help="the drafter trained on ShareGPT (main job)")
    ap.add_argument("--out", default="runs/domain-shift")
    ap.add_argument("--stream", type=int, default=100, help="stream requests per domain")
    ap.add_argument("--heldout", type=int, default=30, help="held-out prompts per domain")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--gap", type=float, default=1.5, help="idle seconds after each stream request")
    ap.add_argument("--block", type=int, default=4, help="requests per trainer running / paused block")
    ap.add_argument("--window", type=int, default=25, help="requests per reported window")
    # a chain of 3: the quick head was trained for depth 1, so its deeper positions are where adapting pays most
    ap.add_argument("--spec", nargs="*", default=["spec.num_tokens=3", "spec.tree.topk=1"], help="every drafting arm")
    ap.add_argument("--adaptation", nargs="*", default=ADAPTATION, help="adaptation.* overrides, the adapting arm")
    args = ap.parse_args()
    out = Path(args.out).resolve()
    ws = out / "adapt-ws"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    try:
        arms, wall, live, cpu = stream_phase(args, out, ws)
        held = heldout_phase(args, out, ws, live, arms[0], arms[2])
    finally:
        for proc in STARTED:
            stop(proc)
    logs = {"stream": {a.name: a.log for a in arms}, "heldout": {a.name: a.log for a in held}}
    (out / "requests.json").write_text(json.dumps(logs) + "\n")
    meta = {"args": vars(args), "stream_wall_s": wall, "trainer_cpu_s": cpu, "final_version": live}
    journal = ws / "trainer.jsonl"
    rounds = journal.read_text().splitlines() if journal.is_file() else []
    meta["trainer_rounds"] = [json.loads(x) for x in rounds if x.strip()]
    report(logs, meta, out)


if __name__ == "__main__":
    main()
