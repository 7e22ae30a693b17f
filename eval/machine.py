"""Which machine a result came from: the same fp32 decode runs at very different speeds on two 2-core EPYCs
(docs/benchmarks.md), so a figure is only comparable with figures from the same CPU model, instruction sets, threads
and load."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import torch

from draftsmith.serve.shared.cpu import cpu_name, cpuinfo

from .results import Environment

SPEED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")  # CPU features that change matmul speed
SAME_MACHINE = ("cpu", "cpu_flags", "gpu", "threads")  # what must match for two results to be compared


def environment(device: torch.device, dtype: torch.dtype) -> Environment:
    """This machine (the load averages are the runner's to add)."""
    return Environment(
        device=f"{device.type}: {torch.cuda.get_device_name(device) if device.type == 'cuda' else cpu_name()}",
        cpu=cpu_name(),
        cpu_flags=cpu_flags(),
        gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        dtype=str(dtype).removeprefix("torch."),
        torch=torch.__version__,
        python=platform.python_version(),
        threads=torch.get_num_threads(),
        cpu_count=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),  # usable
        commit=git_commit(),
    )


def cpu_flags() -> list[str]:
    flags = set(cpuinfo().get("flags", "").split())
    return [f for f in SPEED_FLAGS if f in flags]


def load_average() -> list[float] | None:
    """1, 5 and 15 minute load averages: above the core count, something else competed for the CPU."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def git_commit() -> str:
    """The checkout's commit, `-dirty` when it has uncommitted changes; empty outside a git checkout."""
    try:
        run = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            timeout=5,
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return run.stdout.strip() if run.returncode == 0 else ""


def machine_key(env: Environment) -> tuple:
    return tuple(str(getattr(env, k)) for k in SAME_MACHINE)


def describe(env: Environment) -> str:
    """'AMD EPYC (avx2, avx512f, avx512_bf16), 2 threads' or with the GPU."""
    flags = ", ".join(env.cpu_flags) or "no AVX2"
    gpu = f", GPU {env.gpu}" if env.gpu else ""
    return f"{env.cpu} ({flags}){gpu}, {env.threads} threads"
