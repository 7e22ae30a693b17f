"""An eval as one W&B run (same project as training, offline unless WANDB_MODE says): summary, tables, plots."""

from __future__ import annotations

from pathlib import Path

from draftsmith.serve.shared.wandb_run import WandbConfig, start_wandb

from .results import RunResult, StudyResult


def headline(r: RunResult) -> dict[str, float]:
    """Flat summary keys, e.g. speedup/ngram, tau/eagle3, tokens_per_s/ar."""
    b = r.baseline
    out = {"tokens_per_s/ar": b.tokens_per_s, "ttft_ms/ar": b.ttft_ms, "tpot_ms/ar": b.tpot_ms}
    for label, m in r.methods.items():
        out |= {
            f"speedup/{label}": m.speedup,
            f"tau/{label}": m.mean_acceptance_length,
            f"tokens_per_s/{label}": m.tokens_per_s,
            f"draft_acceptance_rate/{label}": m.draft_acceptance_rate,
            f"ttft_ms/{label}": m.ttft_ms,
            f"tpot_ms/{label}": m.tpot_ms,
        }
        for key in ("speedup", "mean_acceptance_length"):  # the 95% interval's ends, for error bars in W&B
            iv = m.interval(key)
            name = "tau" if key == "mean_acceptance_length" else key
            out |= {f"{name}_low/{label}": iv[0], f"{name}_high/{label}": iv[1]} if iv else {}
    out |= {"lossless/identical": r.lossless.identical, "lossless/checked": r.lossless.checked}
    for c in r.study.cells if r.study else []:
        cell = f"{'cache' if c.prefix_cache else 'nocache'}_{c.speculation or 'plain'}"
        out |= {f"study/{cell}/{k}": getattr(c, k) for k in ("ttft_ms", "tpot_ms", "total_ms")}
    return out


# list[str | int]: wandb.Table's columns parameter (a list, so invariant)
CATEGORY_COLUMNS: list[str | int] = [
    "category",
    "method",
    "prompts",
    "tokens_per_s",
    "speedup",
    "tau",
    "draft_acceptance_rate",
]
STUDY_COLUMNS: list[str | int] = ["prefix_cache", "speculation", "ttft_ms", "tpot_ms", "total_ms"]


def category_rows(r: RunResult) -> list[list]:
    return [
        [cat, label, row.prompts, m.tokens_per_s, m.speedup, m.mean_acceptance_length, m.draft_acceptance_rate]
        for cat, row in r.by_category.items()
        for label, m in row.methods.items()
    ]


def study_rows(study: StudyResult) -> list[list]:
    return [[c.prefix_cache, c.speculation or "plain", c.ttft_ms, c.tpot_ms, c.total_ms] for c in study.cells]


def log_eval(cfg: WandbConfig, out: Path, results: RunResult, run_config: dict) -> str | None:
    """Log one finished eval; returns the W&B run id (None when wandb.enabled=false)."""
    if not cfg.enabled:
        return None
    import wandb

    labels = list(results.methods)
    if results.suite:
        source = results.suite
    else:
        assert results.prompts_file is not None, "a run reads a suite or a prompts file"
        source = Path(results.prompts_file).stem
    run = start_wandb(out, cfg, run_config, f"eval-{'+'.join(labels)}-{source}", ["eval", source, *labels], None)
    run.summary.update(headline(results))
    logged: dict[str, wandb.Table | wandb.Image] = {
        "by_category": wandb.Table(columns=CATEGORY_COLUMNS, data=category_rows(results))
    }
    if results.study:
        logged["study"] = wandb.Table(columns=STUDY_COLUMNS, data=study_rows(results.study))
        run.summary["study/finding"] = results.study.finding
        run.summary["study/control_noisy"] = results.study.control.noisy
    logged |= {f"plots/{p.stem}": wandb.Image(str(p)) for p in sorted(Path(out).glob("*.png"))}
    run.log(logged)
    run.finish()
    return run.id
