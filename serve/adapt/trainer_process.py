"""The trainer beside the server: another process (`python -m draftsmith.train.adapt ADAPT_DIR`), in a session
of its own so it runs at the lowest CPU priority (it lowers itself on start: autogroup and nice 19).

Another process, not threads in the server: training would hold the GIL the handlers and the engine thread need,
and at the lowest priority the scheduler gives it the cycles serving leaves idle. A trainer that dies is logged;
the server serves on with the versions it has.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

from draftsmith.serve.adapt.versions import Workspace

log = logging.getLogger("draftsmith.serve.adapt")
TICKS = os.sysconf("SC_CLK_TCK")


class TrainerProcess:
    def __init__(self, ws: Workspace, settings: dict) -> None:
        ws.adapt_file.write_text(json.dumps(settings, indent=1, default=str) + "\n")
        self.logfile = (ws.root / "trainer.log").open("ab")
        cmd = [sys.executable, "-m", "draftsmith.train.adapt", str(ws.root)]
        self.proc = subprocess.Popen(cmd, stdout=self.logfile, stderr=subprocess.STDOUT, start_new_session=True)
        (ws.root / "trainer.pid").write_text(f"{self.proc.pid}\n")  # its process group too: a benchmark pauses it
        log.info("trainer started (pid %d), its log: %s", self.proc.pid, ws.root / "trainer.log")

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def cpu_seconds(self) -> float:
        """CPU time the trainer has used so far (user + system, its children included); 0 once it is gone."""
        return cpu_seconds(self.proc.pid) if self.alive else 0.0

    def stop(self, timeout: float = 15) -> None:
        if self.alive:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.logfile.close()


def cpu_seconds(pid: int) -> float:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return sum(int(f) for f in fields[11:15]) / TICKS  # utime stime cutime cstime
