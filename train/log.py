"""Training metrics: one JSON line per log step in OUT/metrics.jsonl, and W&B (offline unless WANDB_MODE says)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from draftsmith.serve.shared.wandb_run import start_wandb

from .jsonl import complete_rows


class MetricsLog:
    """Main process only. On resume, lines past the resumed step are dropped, so the file reads as one run."""

    def __init__(self, out: Path, start_step: int, wandb_cfg, run_config: dict, name: str, tags: list[str], run_id):
        self.path = Path(out) / "metrics.jsonl"
        truncate_after(self.path, start_step)
        self.run = start_wandb(out, wandb_cfg, run_config, name, tags, run_id) if wandb_cfg.enabled else None

    @property
    def wandb_id(self) -> str | None:
        return self.run.id if self.run is not None else None

    def log(self, row: dict) -> None:
        with open(self.path, "a") as f:  # wall-clock time: acceptance per hour across resumed pieces
            f.write(json.dumps({**row, "time": round(time.time(), 1)}) + "\n")
        if self.run is not None:
            self.run.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])

    def summary(self, values: dict) -> None:
        if self.run is not None:
            self.run.summary.update(values)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()


def truncate_after(path: Path, step: int) -> None:
    """Keep the rows up to `step`; a torn last line (a kill mid-write) goes too."""
    if not path.is_file():
        return
    bad = "is not a metrics row (a JSON object with an integer step): delete that line, then resume again"
    rows, _ = complete_rows(path.read_bytes(), path, lambda row: isinstance(row.get("step", 0), int), bad)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows if row.get("step", 0) <= step))


@dataclass
class Window:
    """Sums since the last log line; losses are averaged over processes when it is written."""

    loss: float = 0.0
    logs: dict = field(default_factory=dict)
    micro: int = 0
    tokens: int = 0  # all processes
    masked: float = 0.0
    step_tokens: int = 0  # this process, since the last optimizer step
    grad_norm: float = 0.0
    started: float = field(default_factory=time.perf_counter)

    def add(self, loss: float, logs: dict, tokens: int, masked: float) -> None:
        self.loss, self.micro, self.masked, self.step_tokens = (
            self.loss + loss,
            self.micro + 1,
            self.masked + masked,
            self.step_tokens + tokens,
        )
        for k, v in logs.items():
            if k != "loss":
                self.logs[k] = self.logs.get(k, 0.0) + float(v)

    def end_step(self, acc) -> int:
        """Tokens of this optimizer step over all processes."""
        n = int(acc.reduce(torch.tensor(self.step_tokens, device=acc.device), "sum"))
        self.tokens, self.step_tokens = self.tokens + n, 0
        return n

    def flush(self, acc, step: int, epoch: float, lr: float) -> dict:
        keys = sorted(self.logs)
        means = torch.tensor([self.loss, *(self.logs[k] for k in keys)], device=acc.device) / max(1, self.micro)
        means = acc.reduce(means, "mean").tolist()
        masked = int(acc.reduce(torch.tensor(self.masked, device=acc.device), "sum"))
        elapsed = time.perf_counter() - self.started
        row = {
            "step": step,
            "epoch": round(epoch, 4),
            "loss": means[0],
            "lr": lr,
            "grad_norm": self.grad_norm,
            "tokens_per_s": self.tokens / elapsed if elapsed > 0 else 0.0,
            "tokens": self.tokens,
            "masked_tokens": masked,
            **dict(zip(keys, means[1:], strict=True)),
        }
        type(self).__init__(self)
        return row
