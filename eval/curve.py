"""draftsmith-curve: one training recipe at several data sizes, each head evaluated alike, so the curve says what
more data buys (τ against answer tokens and against CPU-hours, and a fit that extrapolates it).

    draftsmith-curve out=CURVE sizes=[150,300,600,1200]                    # conversations per point
    draftsmith-curve out=CURVE "train_args=['data.regenerate.temperature=0.7']"  # another recipe or data arm

Each point is draftsmith-train (a process of its own, resumed from its checkpoints when a run stopped part-way)
then draftsmith-eval on every suite (resumed from its records), under OUT/points/c<size>/. A point whose head and
evals are finished is read back, not run again, so a large point can run in pieces over several sessions; the
report (OUT/curve.json, curve.md, curve.png) is rewritten after every point. The settings are kept in
OUT/curve.json: a rerun with others is refused, naming both.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .curve_report import Point, SuitePoint, write_curve
from .journal import unfinished
from .results import load_results

SUITES = ("mt_bench", "humaneval", "sharegpt")


@dataclass
class CurveConfig:
    """conf/curve.yaml."""

    out: str
    target: str = "smollm2-135m"  # the target group (target=), or target.path=DIR via target_args
    target_args: list[str] = field(default_factory=list)  # overrides every command gets, e.g. [target.dtype=float32]
    head: str = "eagle3"
    recipe: str = "quick"  # train=
    sizes: list[int] = field(
        default_factory=lambda: [300, 600, 1200]
    )  # conversations per point (data.max_conversations)
    train_args: list[str] = field(default_factory=list)  # more draftsmith-train overrides, the same at every point
    suites: list[str] = field(default_factory=lambda: list(SUITES))
    limit: int = 16  # prompts per suite
    max_new_tokens: int = 64
    eval_args: list[str] = field(default_factory=list)  # more draftsmith-eval overrides, the same at every point
    predict: list[float] = field(default_factory=lambda: [10.0, 100.0])  # the fit at these multiples of the largest

    def __post_init__(self) -> None:
        if not self.sizes or any(n < 1 for n in self.sizes) or len(set(self.sizes)) != len(self.sizes):
            raise ValueError(f"sizes must be distinct conversation counts >= 1, got {list(self.sizes)}")
        self.sizes = sorted(self.sizes)
        unknown = sorted(set(self.suites) - set(SUITES))
        if unknown or not self.suites:
            raise ValueError(f"suites must be some of {', '.join(SUITES)}, got {list(self.suites)}")
        for key in ("train_args", "target_args", "eval_args"):
            bad = [a for a in getattr(self, key) if "=" not in a]
            if bad:
                raise ValueError(f"{key} holds {bad[0]!r}: each entry is one override, key=value")
            keys = [a.split("=")[0].lstrip("+~") for a in getattr(self, key)]
            twice = sorted({k for k in keys if keys.count(k) > 1})
            if twice:
                raise ValueError(f"{key} sets {twice[0]} twice: keep one")
        taken = [
            a for a in self.train_args if a.split("=")[0].lstrip("+") in ("out", "resume", "data.max_conversations")
        ]
        if taken:
            raise ValueError(f"train_args sets {taken[0]!r}, which the curve sets per point: drop it")

    def settings(self) -> dict:
        """What makes the points comparable: a rerun with other settings is refused (overrides in any order)."""
        keep = ("target", "head", "recipe", "suites", "limit", "max_new_tokens")
        overrides = {k: sorted(getattr(self, k)) for k in ("target_args", "train_args", "eval_args")}
        return {k: v for k, v in asdict(self).items() if k in keep} | overrides


def python_m(module: str, args: list[str]) -> list[str]:
    return [sys.executable, "-m", module, *args]


def run_logged(cmd: list[str], log: Path) -> float:
    """Run a command, its output appended to `log` and echoed; its wall seconds. A failure names the log."""
    began = time.perf_counter()
    with open(log, "a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=os.environ | {"PYTHONUNBUFFERED": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[2]} failed (exit {proc.returncode}): see {log}")
    return time.perf_counter() - began


def train_point(cfg: CurveConfig, size: int, folder: Path) -> dict:
    """The point's head (trained, resumed or already there) and the recipe its folder records."""
    head = folder / "head"
    if not head_config(folder).is_file():
        args = [f"target={cfg.target}", *cfg.target_args, f"head={cfg.head}", f"train={cfg.recipe}", *cfg.train_args]
        args += [f"data.max_conversations={size}", f"out={head}", "wandb.enabled=false"]
        args += ["resume=true"] if (head / "checkpoints").is_dir() else []
        run_logged(python_m("draftsmith.train", args), folder / "train.log")
    return head_recipe(folder)


def eval_point(cfg: CurveConfig, suite: str, head: Path, out: Path) -> Path:
    if (out / "results.json").is_file() and not unfinished(out):
        return out
    args = [f"target={cfg.target}", *cfg.target_args, f"spec={cfg.head}", f"spec.drafter={head}", f"suite={suite}"]
    args += [f"limit={cfg.limit}", f"max_new_tokens={cfg.max_new_tokens}", f"out={out}", "wandb.enabled=false"]
    args += [*cfg.eval_args, *(["resume=true"] if unfinished(out) else [])]
    run_logged(python_m("draftsmith.eval", args), out.parent / "eval.log")
    return out


def suite_point(out: Path) -> SuitePoint:
    r = load_results(out)
    m = next(iter(r.methods.values()))
    return SuitePoint(
        tau=m.mean_acceptance_length,
        tau_interval=m.interval("mean_acceptance_length"),
        acceptance=m.acceptance_rate_per_position,
        acceptance_intervals=m.interval("acceptance_rate_per_position") or [],
        speedup=m.speedup,
        speedup_interval=m.interval("speedup"),
        prompts=r.prompts,
        identical=f"{r.lossless.identical}/{r.lossless.checked}",
    )


def check_trained_alike(recipes: dict[int, dict]) -> None:
    """Every point's head trained with the same settings (train/trainer.py head_settings, recorded in its folder):
    a recipe default that changed between two runs of a curve would otherwise bend its line unseen. A head
    folder from before the record existed counts as its own setting."""
    seen = {size: r.get("extra", {}).get("training") for size, r in recipes.items()}
    if not seen:
        return
    first = min(seen)
    other = next((size for size in sorted(seen) if seen[size] != seen[first]), None)
    if other is None:
        return
    a, b = seen[first], seen[other]
    if a is None or b is None:
        old = first if a is None else other
        raise ValueError(
            f"the head of point {old} records no training settings (made before they were recorded), unlike the "
            f"others: delete points/c{old} to retrain it, or pick another out"
        )
    keys = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    unset = "unset (its default)"  # a setting a fingerprint leaves out at its default (train/checkpoint.py)
    raise ValueError(
        f"the heads of points {first} and {other} were trained with other settings ({', '.join(keys)}: "
        f"{ {k: a.get(k, unset) for k in keys} } against { {k: b.get(k, unset) for k in keys} }): their tau would "
        f"not lie on one curve; delete points/c{other} (or the older points) to retrain it, or pick another out"
    )


def point_of(size: int, recipe: dict, suites: dict[str, SuitePoint]) -> Point:
    extra = recipe.get("extra", {})
    examples, answers, stages = extra.get("examples", 0), extra.get("answer_tokens", 0), extra.get("stages", {})
    return Point(size, examples, answers, recipe.get("tokens", 0), stages, suites)


def check_settings(out: Path, settings: dict) -> None:
    path = out / "curve.json"
    if not path.is_file():
        return
    before = json.loads(path.read_text()).get("settings", {})
    differ = sorted(k for k in settings if before.get(k) != settings[k])
    if differ:
        was, now = {k: before.get(k) for k in differ}, {k: settings[k] for k in differ}
        raise ValueError(
            f"{out} holds a curve made with {was}, but this run asks for {now}: its points would not compare; "
            "pick another out, or rerun with the recorded settings"
        )


def run_curve(cfg: CurveConfig) -> Path:
    out = Path(cfg.out)
    check_settings(out, cfg.settings())
    out.mkdir(parents=True, exist_ok=True)
    points = {size: point for size in finished_sizes(out, cfg) if (point := read_point(cfg, size, out))}
    recipes = {size: head_recipe(point_folder(out, size)) for size in points}
    check_trained_alike(recipes)  # points an earlier run finished, before training another
    began = time.perf_counter()
    for i, size in enumerate(cfg.sizes):
        folder = point_folder(out, size)
        folder.mkdir(parents=True, exist_ok=True)
        eta = eta_text(began, cfg.sizes[:i], cfg.sizes[i:])
        print(f"[curve {i + 1}/{len(cfg.sizes)}] {size} conversations -> {folder}{eta}", flush=True)
        recipe = recipes[size] = train_point(cfg, size, folder)
        check_trained_alike(recipes)
        evals = {s: eval_point(cfg, s, folder / "head" / "final", folder / f"eval-{s}") for s in cfg.suites}
        points[size] = point_of(size, recipe, {s: suite_point(e) for s, e in evals.items()})
        write_curve(out, [points[n] for n in sorted(points)], cfg.settings(), cfg.predict, os.cpu_count() or 1)
    print(f"curve: {out}/curve.md, {out}/curve.png, {out}/curve.json")
    return out


def finished_sizes(out: Path, cfg: CurveConfig) -> list[int]:
    """Sizes an earlier run of this curve made that this one does not ask for: reported with the rest if finished."""
    found = [int(p.name[1:]) for p in (out / "points").glob("c*") if p.name[1:].isdigit()]
    return sorted(set(found) - set(cfg.sizes))


def read_point(cfg: CurveConfig, size: int, out: Path) -> Point | None:
    """A point whose head and every eval are finished, read back; None otherwise."""
    folder = point_folder(out, size)
    evals = [folder / f"eval-{s}" for s in cfg.suites]
    finished = all((e / "results.json").is_file() and not unfinished(e) for e in evals)
    if not head_config(folder).is_file() or not finished:
        return None
    return point_of(size, head_recipe(folder), {s: suite_point(e) for s, e in zip(cfg.suites, evals, strict=True)})


def point_folder(out: Path, size: int) -> Path:
    return out / "points" / f"c{size}"


def head_config(folder: Path) -> Path:
    """The point's trained head's config (written last: the head is done where it is)."""
    return folder / "head" / "final" / "config.json"


def head_recipe(folder: Path) -> dict:
    return json.loads(head_config(folder).read_text())["recipe"]


def eta_text(began: float, done: list[int], left: list[int]) -> str:
    """Time left, at the pace of the points run in this call (conversations per second; training is linear in
    them): empty before the first."""
    if not done:
        return ""
    per_conv = (time.perf_counter() - began) / sum(done)
    return f" (about {per_conv * sum(left) / 60:.0f} min left)"


def main() -> None:
    import hydra
    from omegaconf import DictConfig

    from draftsmith.serve.shared.cli import typed_or_exit

    @hydra.main(config_path="../conf", config_name="curve", version_base=None)
    def _main(cfg: DictConfig) -> None:
        try:
            run_curve(typed_or_exit(cfg, CurveConfig, "draftsmith-curve"))
        except (ValueError, RuntimeError) as e:
            sys.exit(f"draftsmith-curve: {e}")

    _main()


if __name__ == "__main__":
    main()
