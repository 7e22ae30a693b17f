"""Which CPU this is, from /proc/cpuinfo: eval results record it, and the engine's verify-cost profile is only
trusted on the CPU it was measured on."""

from __future__ import annotations

import platform


def cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                name, _, value = line.partition(":")
                info[name.strip()] = value.strip()
    except OSError:
        pass
    return info


def cpu_name() -> str:
    return cpuinfo().get("model name") or platform.processor() or platform.machine()
