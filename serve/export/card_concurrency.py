"""The export card's section on draft length under concurrency in vLLM: the recommendation of a measured sweep
(serve/export/vllm_sweep.py), against the K the card's command asks for at every load; or that none was measured."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from draftsmith.serve.export.draft_lengths import RULE, SCHEDULE_KEY, Choice, Point, speculative_options, verdict
from draftsmith.serve.export.vllm_sweep import SWEEP_COMMAND, Sweep

TITLE = "## Draft length under concurrency (vLLM)"
SCHEDULE_NOTE = (
    "vLLM 0.32 has no option that turns speculation off above a batch size; it takes a batch-size schedule, "
    f"`{SCHEDULE_KEY}`: inclusive ranges of requests in one step, each with its K (K = 0 drafts nothing, though "
    "the head still runs one forward per step), the last range carried on to `--max-num-seqs`. A batch size "
    "between two measured levels takes the larger level's K"
)


def sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def speedup_text(speedup: float | None, interval: list[float] | None) -> str:
    if speedup is None:
        return "-"
    return f"{speedup:.2f}x" + (f" [{interval[0]:.2f}, {interval[1]:.2f}]" if interval else "")


def row(c: Choice, default: Point | None) -> str:
    chosen = "off" if c.k == 0 else f"K={c.k}"
    fixed = speedup_text(default.speedup, default.interval) if default else "not measured"
    return f"| {c.concurrency} | {chosen} | {speedup_text(c.speedup, c.interval)} | {fixed} |"


def choices_table(sweep: Sweep, card_k: int | None) -> str:
    defaults = {p.concurrency: p for p in sweep.points if p.k == card_k}
    header = f"| concurrent requests | recommended | its speedup | K={card_k} (the command above) |\n"
    header += "|---|---|---|---|\n"
    return header + "\n".join(row(c, defaults.get(c.concurrency)) for c in sweep.choices())


def serve_text(sweep: Sweep, command: Callable[[tuple], str]) -> str:
    choices = sweep.choices()
    options = speculative_options(choices)
    if options is None:
        return "\n"
    why = f"{SCHEDULE_NOTE}:" if SCHEDULE_KEY in options else "One K at every level measured:"
    return f"{why}\n\n```bash\n{command(tuple(options.items()))}\n```\n"


def concurrency_section(sweep: Sweep | None, card_k: int | None, out: Path, command: Callable[[tuple], str]) -> str:
    """command(options): the card's vLLM command with these --speculative-config keys added or replaced."""
    if sweep is None:
        return (
            f"{TITLE}\n\nNo concurrency sweep was measured for this export: the commands above draft {card_k} "
            "token(s) at every load, and with many requests in flight speculation can cost throughput. "
            f"`{SWEEP_COMMAND.replace('EXPORT', str(out))}` measures each K against plain vLLM per level of "
            "concurrency; re-export with `vllm_sweep=RUN/results.json` to recommend from it here.\n"
        )
    return (
        f"{TITLE}\n\nMeasured by `draftsmith-peers concurrency` with {sweep.origin()} (`{sweep.source}`; the export at "
        f"`{sweep.model}` served as `{sweep.method}`): throughput against plain vLLM, 95% intervals over rounds. "
        f"Recommended per level: {RULE}.\n\n{choices_table(sweep, card_k)}\n\n"
        f"{sentence(verdict(sweep.choices()))}. {serve_text(sweep, command)}"
    )
