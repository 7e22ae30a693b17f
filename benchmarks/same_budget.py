#!/usr/bin/env python
"""Drafter kinds trained for the same wall-clock budget, then evaluated side by side.

Each arm is `draftsmith-train` on the same data and recipe (train=quick: the same examples, batches, optimizer and
feature cache), only the head differs. A short probe run measures the arm's seconds per optimizer step on this
machine (its second logging window, past the first steps' warm-up); the arm then trains for --minutes of steps
(train.max_steps, so its LR schedule spans the budget), without the in-training evals. One `draftsmith-eval` then
runs every head against plain decoding on the same prompts, interleaved, with intervals (results.json, report.md).

    python benchmarks/same_budget.py --minutes 6 --out runs/same_budget
    python benchmarks/same_budget.py --minutes 25 --out runs/same_budget_quick suite=mt_bench repeats=2

Arguments after the options go to the eval (e.g. limit=24 max_new_tokens=96 target.dtype=float32). Finished
arms are reused and a killed one resumes (delete an arm's folder to retrain it). Writes OUT/budget.json: each
trained arm's steps, seconds per step and training wall-clock.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

# arm -> head overrides: eagle3 quick is today's main-job head (depth 1, its 3 best tokens side by side)
ARMS = {
    "eagle3_d1": ["head=eagle3"],
    "eagle3_k3": [
        "head=eagle3",
        "head.loss.ttt_steps=3",
        "head.draft.num_tokens=3",
        "head.draft.topk=1",
        "head.draft.total_tokens=0",
    ],
    "peagle_k4": ["head=peagle"],
    "dflash_b4": ["head=dflash"],
    "dspark_b4": ["head=dspark"],
    "dspark_b4_dpace": ["head=dspark", "head.loss.slot_weights=dpace"],
    "dspark_b4_ce": ["head=dspark", "head.loss.ce_weight=1.0", "head.loss.tv_weight=0.0"],
    "dspark_b4_r16": ["head=dspark", "head.args.markov_rank=16"],
    "dflash_b4_dpace": ["head=dflash", "head.loss.slot_weights=dpace"],
}
PROBE_STEPS, PROBE_WINDOW = 12, 6
QUIET = ["train.eval_every=1000000", "wandb.enabled=false"]  # the budget buys training steps only


def train(target: str, arm: list[str], out: Path, extra: list[str]) -> float:
    """Runs draftsmith-train; its wall-clock seconds."""
    began = time.perf_counter()
    subprocess.run(["draftsmith-train", target, *arm, "train=quick", *QUIET, *extra, f"out={out}"], check=True)
    return time.perf_counter() - began


def seconds_per_step(metrics: Path) -> float:
    """From the probe's last logging window (its first holds the warm-up): tokens / tokens_per_s over its steps."""
    row = [json.loads(line) for line in metrics.read_text().splitlines() if '"tokens_per_s"' in line][-1]
    return row["tokens"] / row["tokens_per_s"] / PROBE_WINDOW


def run_arm(name: str, target: str, minutes: float, out: Path) -> dict:
    folder = out / name
    record = folder / "budget.json"
    if record.is_file() and (folder / "final" / "model.safetensors").is_file():
        return json.loads(record.read_text())
    probe = out / "probes" / name
    if not (probe / "metrics.jsonl").is_file():
        train(target, ARMS[name], probe, [f"train.max_steps={PROBE_STEPS}", f"train.log_every={PROBE_WINDOW}"])
    per_step = seconds_per_step(probe / "metrics.jsonl")
    steps = max(1, round(minutes * 60 / per_step))
    print(f"== {name}: {per_step:.2f} s/step in the probe -> {steps} steps for {minutes} min", flush=True)
    again = ["resume=true"] if (folder / "checkpoints").is_dir() else []  # a killed arm continues
    wall = train(target, ARMS[name], folder, [f"train.max_steps={steps}", *again])
    result = {"arm": name, "head": ARMS[name], "steps": steps, "probe_s_per_step": per_step, "train_wall_s": wall}
    record.write_text(json.dumps(result, indent=1) + "\n")
    return result


def evaluate(arms: list[str], target: str, out: Path, extra: list[str]) -> None:
    """One eval: plain decoding and every arm's head, interleaved per prompt, each drafting its recorded shape."""
    methods = [f"+spec@methods.{a}={ARMS[a][0].split('=')[1]}" for a in arms]
    drafters = [f"methods.{a}.drafter={out / a / 'final'}" for a in arms]
    cmd = ["draftsmith-eval", target, "spec=ar", *methods, *drafters, "suite=mt_bench", "wandb.enabled=false"]
    subprocess.run([*cmd, *extra, f"out={out / 'eval'}"], check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, required=True, help="training wall-clock budget per arm")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--target", default="target=smollm2-135m")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    ap.add_argument("--no-eval", action="store_true", help="train the arms only (evaluate them later, together)")
    args, extra = ap.parse_known_args()
    arms = args.arms.split(",")
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        ap.error(f"unknown arms {unknown}; choose from {', '.join(ARMS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    budget = [run_arm(a, args.target, args.minutes, args.out) for a in arms]
    every = [json.loads(p.read_text()) for p in sorted(args.out.glob("*/budget.json"))]  # this run's and earlier
    (args.out / "budget.json").write_text(json.dumps({"minutes": args.minutes, "arms": every}, indent=1) + "\n")
    for b in budget:
        per_step, wall = b["probe_s_per_step"], b["train_wall_s"] / 60
        print(f"{b['arm']:10s} {b['steps']:5d} steps, {per_step:.2f} s/step, trained in {wall:.1f} min")
    if not args.no_eval:
        evaluate(arms, args.target, args.out, extra)


if __name__ == "__main__":
    main()
