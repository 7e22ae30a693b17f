"""draftsmith-eval: plain decoding vs one or more methods on a suite or prompts file -> results, report, W&B; or,
with replay=LOG, the report of a draftsmith-replay log (or two, compared)."""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from draftsmith.serve.export.vllm_sweep import SweepError, read_sweep
from draftsmith.serve.shared.cli import typed_or_exit

from .methods import check_drafters
from .replay_report import headline, write_replay_report
from .report import busy, number, plain_share, speedup_cell, write_report
from .results import RunResult
from .runner import EvalConfig, run_eval
from .wandb_log import log_eval


def evaluate(cfg: EvalConfig) -> RunResult:
    """The whole eval: run, DIR/results.json + report.md + PNGs, then W&B. Returns the results."""
    results = run_eval(cfg)
    write_report(cfg.out, results)
    log_eval(cfg.wandb, Path(cfg.out), results, asdict(cfg))
    return results


def replay_report(cfg: EvalConfig) -> None:
    paths = [cfg.replay] if isinstance(cfg.replay, str) else [str(p) for p in cfg.replay]
    try:
        result = write_replay_report(paths, cfg.replay_labels, cfg.window, cfg.out)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"draftsmith-eval: {e}")
    print(headline(result))
    print(f"  report: {cfg.out}/report.md, results: {cfg.out}/replay_results.json")


def print_headline(r: RunResult) -> None:
    b = r.baseline
    lines = [
        f"{r.target} on {r.device} ({r.dtype}), {r.prompts} prompts"
        + (f" x {r.repeats} repeats" if r.repeats > 1 else "")
        + f", {r.max_new_tokens} new tokens; [95% intervals over prompts]"
        + ("  [PARTIAL]" if r.partial else ""),
        f"  {'ar':<13} {b.tokens_per_s:6.1f} tok/s  TPOT {number(b, 'tpot_ms', '{:.1f}')} ms  TTFT {b.ttft_ms:.0f} ms",
    ]
    for label, m in r.methods.items():
        lines.append(
            f"  {label:<13} {m.tokens_per_s:6.1f} tok/s  TPOT {m.tpot_ms:5.1f} ms  speedup {speedup_cell(m)}"
            f"  tau {number(m, 'mean_acceptance_length')}  rows/step {m.mean_verify_rows:.2f}" + plain_share(m)
        )
    lossless, cache = r.lossless, r.prefix_cache
    check = f"lossless: {lossless.identical}/{lossless.checked} identical"
    if r.temperature > 0:
        checks = []
        for label, m in r.methods.items():
            assert m.distribution_check is not None, "sampled runs check the distribution"
            checks.append(f"{label} p={m.distribution_check.p_value}")
        check = "distribution check: " + ", ".join(checks)
    lines.append(f"  {check}; prefix cache hit {cache.hit_tokens}/{cache.queried_tokens} tokens")
    lines += noise_lines(r)
    if r.study:
        lines.append(f"  prefix cache x {r.study.method}: {r.study.finding}")
    print("\n".join(lines))


def noise_lines(r: RunResult) -> list[str]:
    out = []
    if r.noise.noisy:
        assert r.noise.repeat_spread is not None, "noise is judged from repeats"
        out.append(
            f"  NOISY: plain decoding of the same prompt varied {r.noise.repeat_spread.median:.0%} between repeats"
        )
    if warning := busy(r):
        out.append(f"  {warning}")
    if r.skipped.turns:
        out.append(f"  {r.skipped.turns} turn(s) skipped (beyond the context): see the report")
    return out


def sweep_line(path: str | None) -> str:
    """The vLLM recommendation of a draft-length sweep, read before the run so that a bad file ends it first."""
    if path is None:
        return ""
    try:
        return "  " + read_sweep(path).line()
    except SweepError as e:
        sys.exit(f"draftsmith-eval: vllm_sweep: {e}")


@hydra.main(config_path="../conf", config_name="eval", version_base=None)
def _main(cfg: DictConfig) -> None:
    config = typed_or_exit(cfg, EvalConfig, "draftsmith-eval", check_drafters)
    sweep = sweep_line(config.vllm_sweep)
    if config.replay is not None:
        replay_report(config)
        if sweep:
            print(sweep)
        return
    hc = HydraConfig.get()
    if hc.mode == RunMode.MULTIRUN:  # each sweep job in out/<job number>, grouped together in W&B
        config.out = hc.runtime.output_dir
        config.wandb.group = config.wandb.group or Path(hc.sweep.dir).name
    results = evaluate(config)
    print_headline(results)
    if sweep:
        print(sweep)
    print(f"  report: {config.out}/report.md, results: {config.out}/results.json")
    if results.partial:
        sys.exit(130)  # interrupted: the partial report is written, the caller still learns it stopped early


def main() -> None:
    _main()


if __name__ == "__main__":
    main()
