"""The verify cost curve: seconds of one target forward over 1..R rows, measured once per machine, cached.

What a verify row costs depends on the CPU, its thread count, the target and its dtype, so the curve is measured
where the engine runs, through the engine's own forward (the static step when it uses one), at a representative
context length: after a warm-up pass, interleaved repeats of every row count, the fastest of each, made
non-decreasing. Another process only ever adds time to a forward, so the fastest repeat is the one it disturbed
least; a median of a few repeats follows a neighbour's bursts, and the policy's choices hinge on the small difference
between one row and two. The JSON file records a fingerprint of what it was measured on; a file whose fingerprint
differs, or that is not a whole curve, is measured again and rewritten, never trusted. A curve measured while other
processes shared the CPU serves the process that measured it, saying so, and is measured again by the next one.
Shared means: the load average past `busy` per CPU, or, on a CPU device, one of the process's threads waiting for a
CPU (runnable, not running: Linux's schedstat) more than `waited` of the timed repeats' wall time. The load average
lags a minute behind a process that just started or ended; the wait is the measurement's own, and a thread that sleeps
or spins at a barrier does not wait. Where torch runs more threads than the process may use, its threads wait for each
other, so only the load average counts.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass
from itertools import accumulate
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from draftsmith.cpu_kernels import native
from draftsmith.cpu_kernels.packed import panel_formats
from draftsmith.files import write_text_atomic
from draftsmith.runtime.llama import CPU_KERNELS
from draftsmith.serve.engine.tree import DraftTree
from draftsmith.serve.models.target import keyed_cache_path
from draftsmith.serve.shared.cpu import cpu_name

if TYPE_CHECKING:
    from draftsmith.serve.engine.engine import Engine

log = logging.getLogger("draftsmith.serve.cost_profile")

SCHEMA = 2  # bump when the file's shape or the way it is measured changes
MAX_ROWS = 64  # rows past this are extrapolated from the last step (CostCurve)
CONTEXT = 512  # the cached prefix a measured step attends to, at most
ABSENT = "is absent"
# curves measured while the CPU was shared, per file: kept for the process (each engine it builds uses them), measured
# again by the next process
BUSY_CURVES: dict[str, tuple[dict[str, Any], CostCurve]] = {}


@dataclass
class CostCurve:
    seconds: list[float]  # [r - 1]: one verify forward over r rows

    def __call__(self, rows: int) -> float:
        s = self.seconds
        if rows <= len(s):
            return s[rows - 1]
        step = s[-1] - s[-2] if len(s) > 1 else s[-1]
        return s[-1] + step * (rows - len(s))


@dataclass
class ProfileSettings:
    repeats: int = 5
    warmup: int = 1
    context: int = CONTEXT
    busy: float = 1.5  # a 1-minute load average past this many per usable CPU: others shared the CPU
    waited: float = 0.1  # on a CPU device, a thread waiting for a CPU past this share of the wall time: shared


def fingerprint(engine: Engine, target_id: str, rows: int, context: int) -> dict[str, Any]:
    """What a measured curve holds for: a file recording anything else is stale."""
    engine.model.stack()  # a model changed since it was loaded leaves the whole stack before its curve is filed
    return {
        "schema": SCHEMA,
        "target": target_id,
        "dtype": str(engine.model.weights_dtype).removeprefix("torch."),
        "device": str(engine.model.device),
        "forward": forward_path(engine),
        "torch": torch.__version__,
        "kernels": kernel_library(engine),
        "stacked": engine.model.stacked,  # steps in one call, or module by module on the kernels
        "panels": panel_formats(engine.model) if kernel_library(engine) else None,
        "threads": torch.get_num_threads(),
        "cpu": cpu_name(),
        "rows": rows,
        "context": context,
    }


def forward_path(engine: Engine) -> str:
    """Which of the target's forwards the engine runs: dynamic (eager), static (CUDA graphs) or compiled."""
    return "dynamic" if engine.static is None else "compiled" if engine.static.prefill else "static"


def kernel_library(engine: Engine) -> str | None:
    """The library of draftsmith's own kernels an eager engine on the cpu_kernels path runs on (new ones cost rows
    differently); None for other engines (the reference path, a compiled forward), whose curves a new library leaves
    alone."""
    return native.version() if engine.static is None and engine.model.path == CPU_KERNELS else None


def profile_path(cache_dir: str | None, print_: dict[str, Any]) -> Path:
    """One file per target, dtype, device, forward path, thread count, row count and context; the torch version, CPU
    model and kernel library are checked inside it (a new one makes the old file stale rather than leaving it
    behind)."""
    key = {k: print_[k] for k in ("target", "dtype", "device", "forward", "threads", "rows", "context")}
    key["own kernels"] = print_["kernels"] is not None  # on and off (DRAFTSMITH_KERNELS) keep a file each
    key["panels"] = "+".join(print_["panels"] or ())  # so do fp32 and narrower panels (DRAFTSMITH_PANELS)
    return keyed_cache_path(cache_dir, "verify_cost", print_["target"], key, ".json")


def verify_rows(engine: Engine) -> int:
    """R: the pending token plus the largest draft the engine's proposer makes, bounded."""
    tree = engine.proposer.max_tree_size if engine.proposer else 0
    return max(1, min(tree + 1, MAX_ROWS))


def load_or_measure(
    engine: Engine, target_id: str, cache_dir: str | None = None, settings: ProfileSettings | None = None
) -> CostCurve:
    settings = settings or ProfileSettings()
    rows = verify_rows(engine)
    context = max(0, min(settings.context, engine.max_seq_len - 1))
    expected = fingerprint(engine, target_id, rows, context)
    path = profile_path(cache_dir, expected)
    kept = BUSY_CURVES.get(str(path))
    if kept is not None and kept[0] == expected:
        return kept[1]
    curve, why = read_profile(path, expected)
    if curve is not None:
        return curve
    say = log.info if why == ABSENT else log.warning  # a file that cannot be trusted is worth a look
    say("verify cost profile %s %s: measuring %d row counts", path, why, rows)
    load = busy_load(settings.busy)
    seconds, waited = measure(engine, rows, context, settings)
    curve = CostCurve(seconds)
    # off a CPU the forward's time is the device's; past the usable CPUs torch's threads wait for each other
    unjudged = engine.model.device.type != "cpu" or torch.get_num_threads() > usable_cpus()
    busy = shared_cpu(load, None if unjudged else waited, settings.waited)
    record = {"fingerprint": expected, **asdict(curve)}
    if busy:
        log.warning(
            "verify cost profile %s measured while other processes shared the CPU (%s): this process uses it, the "
            "next one measures it again",
            path,
            busy,
        )
        record["busy"] = busy
        BUSY_CURVES[str(path)] = (expected, curve)  # not measured again by each engine this process builds
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(record, indent=1) + "\n")
    except OSError as e:  # a read-only cache costs a re-measure next time, not the engine
        log.warning("verify cost profile not saved (%s): this engine uses it from memory", e)
    return curve


def read_profile(path: Path, expected: dict[str, Any]) -> tuple[CostCurve | None, str]:
    """The cached curve, or None and why it cannot be used."""
    if not path.is_file():
        return None, ABSENT
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return None, f"is not JSON ({e})"
    if not isinstance(data, dict) or not {"fingerprint", "seconds"} <= data.keys():
        return None, "lacks its fingerprint or seconds"
    if data["fingerprint"] != expected:
        return None, f"is stale (measured for {data['fingerprint']})"
    if "busy" in data:
        return None, f"was measured on a busy machine ({data['busy']})"
    seconds = data["seconds"]
    if not valid_seconds(seconds, expected["rows"]):
        return None, "holds no valid curve (needs one positive, finite, non-decreasing time per row count)"
    return CostCurve([float(s) for s in seconds]), ""


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity, bounded by a cgroup v2 CPU quota (a container's --cpus)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        return max(1, min(cpus, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError, ZeroDivisionError):  # no cgroup v2 file, or "max": no quota
        return cpus


def busy_load(per_cpu: float) -> float | None:
    """The 1-minute load average when it is past per_cpu per usable CPU (others are sharing it), else None."""
    if not hasattr(os, "getloadavg"):
        return None
    load = os.getloadavg()[0]
    return round(load, 2) if load > per_cpu * usable_cpus() else None


def run_queue_waits() -> dict[str, int] | None:
    """Per thread of this process, the nanoseconds it has spent runnable but waiting for a CPU; None off Linux."""
    try:
        threads = list(Path("/proc/self/task").iterdir())
    except OSError:
        return None
    waits = {}
    for t in threads:
        try:
            waits[t.name] = int((t / "schedstat").read_text().split()[1])
        except (OSError, ValueError, IndexError):  # a thread that ended since the listing
            continue
    return waits or None


def longest_wait(before: dict[str, int] | None, after: dict[str, int] | None, wall_s: float) -> float | None:
    """The largest share of wall_s any one thread spent waiting for a CPU between the two readings."""
    if before is None or after is None:
        return None
    waits = [after[t] - before[t] for t in after.keys() & before.keys()]
    return max(waits, default=0) / 1e9 / max(wall_s, 1e-9)


def shared_cpu(load: float | None, waited: float | None, most: float) -> str:
    """Why a measurement shared the CPU with other processes, or "" where nothing says it did."""
    why = [f"load average {load:.2f} on {usable_cpus()} CPUs"] if load is not None else []
    if waited is not None and waited > most:
        why.append(f"a thread of it waited for a CPU {waited:.0%} of the time")
    return "; ".join(why)


def valid_seconds(seconds: Any, rows: int) -> bool:
    if not isinstance(seconds, list) or len(seconds) != rows:
        return False
    if not all(isinstance(s, int | float) and not isinstance(s, bool) for s in seconds):
        return False
    return all(math.isfinite(s) and s > 0 for s in seconds) and seconds == sorted(seconds)


def measure(engine: Engine, rows: int, context: int, settings: ProfileSettings) -> tuple[list[float], float | None]:
    """The fastest seconds per row count over interleaved repeats, after a warm-up (which holds a compiled forward's
    first trace); non-decreasing (more rows never cost less, whatever the noise said). With the longest share of the
    repeats' wall time a thread of this process waited for a CPU (None where unknown)."""
    for _ in range(settings.warmup):
        for r in range(1, rows + 1):
            time_forward(engine, r, context)
    times: list[list[float]] = [[] for _ in range(rows)]
    before, began = run_queue_waits(), time.perf_counter()
    for _ in range(settings.repeats):
        for r in range(1, rows + 1):
            times[r - 1].append(time_forward(engine, r, context))
    waited = longest_wait(before, run_queue_waits(), time.perf_counter() - began)
    return list(accumulate((min(t) for t in times), max)), waited


@torch.inference_mode()
def time_forward(engine: Engine, rows: int, context: int) -> float:
    """One verify forward of a chain of rows - 1 draft nodes after `context` cached tokens (their KV is scratch:
    the next request's prefill writes over it)."""
    device = engine.model.device
    tree = DraftTree.chain(torch.zeros(rows - 1, dtype=torch.long, device=device))
    inputs = torch.zeros(rows, dtype=torch.long, device=device)
    mask = tree.attention_mask(context) if rows > 1 else None
    engine.sync()
    begin = time.perf_counter()
    engine.forward(inputs, tree.positions(context), context, mask)
    engine.sync()
    return time.perf_counter() - begin
