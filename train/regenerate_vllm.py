"""vLLM as the regeneration backend: a worker process in vLLM's own Python (train/regenerate_vllm_worker.py) holding one
engine over the target, fed batches of chat-encoded prompts over JSON lines.

vLLM pins its own torch and transformers, so it usually lives in a virtual environment of its own:
scripts/setup.sh makes one at ~/.cache/draftsmith/vllm-venv ($VLLM_VENV moves it). The Python that runs the worker
is, first found: data.regenerate.vllm_python, $DRAFTSMITH_VLLM_PYTHON, $VLLM_VENV/bin/python, <cache root>/vllm-venv
(a cache moved by target.cache_dir or $DRAFTSMITH_CACHE), ~/.cache/draftsmith/vllm-venv, this Python.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from draftsmith.files import DEFAULT_CACHE
from draftsmith.serve.models.target import cache_root

WORKER = Path(__file__).with_name("regenerate_vllm_worker.py")
VENV_PYTHON = Path("vllm-venv") / "bin" / "python"
EXCEPTION = re.compile(r"\b\w+(Error|Exception): ")
START_TIMEOUT_S = 1800  # a vLLM that has not started in half an hour is hung (a start takes a small part of it)
INSTALL_HINT = (
    "install it with `bash scripts/setup.sh` (a venv at ~/.cache/draftsmith/vllm-venv), or set "
    "data.regenerate.vllm_python"
)
KV_CACHE_BYTES = 2 << 30  # CPU memory for vLLM's KV cache: 256 chats of 512 tokens of SmolLM2-135M need ~3/4 GiB


class VllmUnavailable(RuntimeError):
    """vLLM is not installed where we look, or its engine did not start."""


def first_error(lines: list[str]) -> str:
    """The log line that names the failure: the first exception that is not vLLM's engine reporting its own death
    (the root cause comes first), else the last line."""
    said = [line.strip() for line in lines if line.strip()]
    errors = [line for line in said if EXCEPTION.search(line) and "EngineDeadError" not in line]
    return (errors[:1] or said[-1:] or ["(the log is empty)"])[0][-400:]


def has_vllm(python: str) -> bool:
    """Whether `python` can import vllm (located, not imported: importing vLLM takes seconds)."""
    check = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        return subprocess.run([python, "-c", check], env=worker_env(), capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def vllm_pythons(setting: str | None, cache_dir: str | None) -> list[str]:
    moved = os.environ.get("VLLM_VENV")  # where scripts/vllm_venv.sh was told to put it
    venvs = [cache_root(cache_dir) / VENV_PYTHON, Path(DEFAULT_CACHE).expanduser() / VENV_PYTHON]
    venvs = ([Path(moved) / "bin" / "python"] if moved else []) + venvs
    found = [setting, os.environ.get("DRAFTSMITH_VLLM_PYTHON"), *map(str, venvs), sys.executable]
    return [p for p in dict.fromkeys(found) if p]


def find_vllm_python(setting: str | None, cache_dir: str | None) -> str:
    candidates = vllm_pythons(setting, cache_dir)
    if setting and not has_vllm(setting):
        raise VllmUnavailable(f"data.regenerate.vllm_python={setting} cannot import vllm; {INSTALL_HINT}")
    for python in candidates:
        if Path(python).exists() and has_vllm(python):
            return python
    raise VllmUnavailable(f"no Python with vLLM found (looked at {', '.join(candidates)}); {INSTALL_HINT}")


def worker_env() -> dict:
    # vLLM's Python must not import draftsmith's packages through our PYTHONPATH; both cores go to its engine
    return os.environ | {"PYTHONPATH": "", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


@dataclass
class VllmJob:
    """What the worker's engine is built from."""

    model: str  # the target's HF folder
    dtype: str  # float32 | bfloat16 | float16
    max_model_len: int
    engine_args: dict  # more vLLM LLM(...) arguments: tensor_parallel_size, data_parallel_size, ...
    seeded: bool = False  # answers are sampled from per-request seeds (the worker keeps prefills whole on a CPU)

    def as_json(self) -> dict:
        args = dict(self.engine_args)
        return {
            "model": self.model,
            "dtype": self.dtype,
            "max_model_len": self.max_model_len,
            "kv_cache_bytes": int(args.pop("kv_cache_memory_bytes", KV_CACHE_BYTES)),
            "engine_args": args,
            "seeded": self.seeded,
        }


class VllmWorker:
    """The parent's end of train/regenerate_vllm_worker.py: started once, one batch of prompts per call."""

    def __init__(self, python: str, job: VllmJob, log: Path) -> None:
        self.job, self.log = job, log
        log.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(job.as_json(), f)
        self.job_file = Path(f.name)
        with open(log, "w") as out:  # the child holds its own copy of the file
            self.proc = subprocess.Popen(
                [python, str(WORKER), str(self.job_file)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=out,
                env=worker_env(),
                text=True,
                start_new_session=True,  # its engine processes join its group, so close() can end them all
            )
        ready = self.read("start", START_TIMEOUT_S)
        self.version, self.load_s = ready["version"], ready["load_s"]

    def generate(self, batch: dict) -> dict:
        assert self.proc.stdin is not None, "opened with PIPE"
        self.proc.stdin.write(json.dumps(batch) + "\n")
        self.proc.stdin.flush()
        return self.read("answer")

    def read(self, doing: str, timeout: float | None = None) -> dict:
        assert self.proc.stdout is not None, "opened with PIPE"
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            self.close(grace_s=0)  # a hung worker reads no more input: nothing to wait for
            raise VllmUnavailable(f"vLLM's worker did not {doing} within {timeout:.0f} s (its log: {self.log})")
        line = self.proc.stdout.readline()
        if not line:  # end of its output: it exited
            self.close()
            code = self.proc.returncode
            how = f"killed by signal {-code}" if code < 0 else f"exit {code}"
            cause = first_error(self.log.read_text(errors="replace").splitlines())
            raise VllmUnavailable(f"vLLM's worker failed to {doing} ({how}): {cause} (whole log: {self.log})")
        return json.loads(line)

    def close(self, grace_s: float = 60) -> None:
        """End the worker (its loop ends at end of input; it has grace_s to shut its engine down), then whatever of
        its engine is left."""
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)  # engine processes outlive a killed worker otherwise
            except ProcessLookupError:
                break
            time.sleep(2)
        self.proc.wait()
        self.job_file.unlink(missing_ok=True)

    def __enter__(self) -> VllmWorker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
