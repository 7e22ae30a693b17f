#!/usr/bin/env python
"""draftsmith's EAGLE-3 recipe against speculators' trainer: the same answers, the same target states, the same
draft vocabulary and the same training wall clock, on this machine's CPU.

    bash scripts/speculators_venv.sh          # once: speculators 0.9 in a venv of its own
    python benchmarks/speculators_peer.py --head runs/main/eagle3/final --features ~/.cache/draftsmith/features/KEY \
        --out runs/peer [eval overrides, e.g. limit=16 max_new_tokens=64]

Stages, each kept in OUT and skipped once done, so a killed run resumes at the stage it was in:
1. data: the feature cache the head was trained on, written as speculators' offline dataset (OUT/data): an Arrow
   dataset of input_ids, loss_mask and seq_len; hidden_states/hs_{i}.safetensors with token_ids and hidden_states
   [n, 4, H] (the three layer inputs the head reads, then the target's last hidden state); and the head's draft
   vocabulary as d2t.npy / t2d.npy, so that both heads draft from the same tokens.
2. probe: speculators trains a few steps; its seconds per step are the median gap between steps past the first.
3. train: speculators trains budget / (seconds per step) steps, its LR schedule spanning them. The budget is the
   draftsmith head's own recorded training seconds (--seconds overrides). Its recipe is its own defaults (Muon,
   LR 1e-3 linear, 3 training-time-test steps weighted equally, KL to the target), with the batch set to about
   draftsmith's tokens per step, fp32 where the CPU lacks bf16, and every example trained on.
4. eval: one draftsmith-eval over MT-bench: plain decoding and both heads interleaved per prompt, once per draft
   shape (--shapes: the draftsmith head's own, depth 1 with its 3 best tokens, and a chain of 3, the shape
   speculators trains for). Then the paired ratio of the heads' τ over prompts, with its bootstrap interval, in each
   shape and with each head in its own ("own").
Writes OUT/peer.json and OUT/peer.md. A speculators stage that fails leaves draftsmith's results intact and says
which stage failed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from draftsmith.eval.paired_tau import OtherPrompts, method_records
from draftsmith.eval.paired_tau import paired_tau as shared_paired_tau
from draftsmith.files import write_file_atomic

VENV = os.path.expanduser("~/.cache/draftsmith/speculators-venv")
VENV_PYTHON = os.environ.get("SPECULATORS_PYTHON", os.path.join(VENV, "bin", "python"))
RUNNER = Path(__file__).with_name("speculators_cpu.py")
PROBE_STEPS = 12
VAL_COPIES = 4  # speculators' validation split: copies of this many examples
HEADS = ("draftsmith", "speculators")  # the eval's method names
OWN = {"draftsmith": "d1k3", "speculators": "chain3"}  # the shape each recipe trains its head for
SHAPES = {  # name -> the spec overrides of one eval
    "d1k3": ["num_tokens=1", "tree.topk=3", "tree.total_tokens=0"],
    "chain3": ["num_tokens=3", "tree.topk=1", "tree.total_tokens=0"],
}
ARROW_JOB = """
import json, sys
from datasets import Dataset
rows = [json.loads(line) for line in open(sys.argv[1])]
ds = Dataset.from_dict({k: [r[k] for r in rows] for k in ("input_ids", "loss_mask", "seq_len")})
ds.set_format(type="torch")
ds.save_to_disk(sys.argv[2])
"""


class StageFailed(RuntimeError):
    pass


# ---- 1. data


def check_pair(head: Path, features: Path) -> tuple[dict, dict]:
    config = json.loads((head / "config.json").read_text())
    manifest = json.loads((features / "manifest.json").read_text())
    if config["target"]["id"] != manifest["target"]:
        raise SystemExit(
            f"--head {head} was trained for {config['target']['id']}, --features {features} hold "
            f"{manifest['target']}'s states: give the feature cache the head was trained on"
        )
    layers = config["config"]["target_layers"]
    if layers != manifest["layers"]:
        raise SystemExit(f"--head reads target layers {layers}, --features stores {manifest['layers']}")
    return config, manifest


def norm_weight(target_dir: Path) -> torch.Tensor:
    with safe_open(str(target_dir / "model.safetensors"), "pt") as f:
        return f.get_tensor("model.norm.weight").float()


def write_data(head: Path, features: Path, manifest: dict, target_dir: Path, out: Path) -> None:
    """speculators' offline dataset from the cache. The cache stores the final hidden state after the target's
    norm, speculators applies that norm itself; stored is the state divided by the norm's weight: it has RMS 1,
    so RMSNorm gives back the state the cache holds.
    speculators holds out a validation split (its ratio must be below 1): copies of the first examples, appended,
    make that split, so that it trains on every example draftsmith trained on."""
    if (out / "state.json").is_file():
        return
    states = out / "hidden_states"
    states.mkdir(parents=True, exist_ok=True)
    weight = norm_weight(target_dir)
    rows: list[dict] = []
    for shard in manifest["shards"]:
        tensors = load_file(str(features / shard["file"]))
        offsets = tensors["offsets"].tolist()
        for a, b in zip(offsets, offsets[1:], strict=False):
            ids = tensors["input_ids"][a:b].long()
            aux = tensors["aux"][a:b].float().view(b - a, len(manifest["layers"]), -1)
            last = (tensors["hidden"][a:b].float() / weight).unsqueeze(1)
            hs = torch.cat([aux, last], dim=1).to(tensors["hidden"].dtype)
            write_hs(states / f"hs_{len(rows)}.safetensors", ids, hs)
            rows.append({"input_ids": ids.tolist(), "loss_mask": tensors["loss_mask"][a:b].tolist(), "seq_len": b - a})
        print(f"data: {len(rows)}/{manifest['examples']} examples written", flush=True)
    copies = min(VAL_COPIES, len(rows))
    for j in range(copies):
        shutil.copyfile(states / f"hs_{j}.safetensors", states / f"hs_{len(rows) + j}.safetensors")
    listing = out.parent / "rows.jsonl"
    listing.write_text("".join(json.dumps(r) + "\n" for r in rows + rows[:copies]))
    vocab = load_file(str(head / "model.safetensors"))
    np.save(out / "d2t.npy", vocab["d2t"].numpy())
    np.save(out / "t2d.npy", vocab["t2d"].numpy())
    (out / "examples.json").write_text(json.dumps({"train": len(rows), "validation_copies": copies}) + "\n")
    run([VENV_PYTHON, "-c", ARROW_JOB, str(listing), str(out)], out.parent / "logs" / "arrow.log", "data")
    listing.unlink()


def write_hs(path: Path, ids: torch.Tensor, hs: torch.Tensor) -> None:
    write_file_atomic(path, lambda tmp: save_file({"token_ids": ids, "hidden_states": hs}, str(tmp)))


def train_ratio(data: Path) -> float:
    """The ratio whose split index, int(rows * ratio), falls exactly before the validation copies."""
    counts = json.loads((data / "examples.json").read_text())
    rows = counts["train"] + counts["validation_copies"]
    return (counts["train"] + 0.5) / rows


# ---- 2. and 3. speculators training


def run(cmd: list[str], log: Path, stage: str) -> float:
    log.parent.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    with log.open("a") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        raise StageFailed(
            f"speculators stage '{stage}' failed (exit {done.returncode}); its log {log} ends:\n" + "\n".join(tail)
        )
    return time.perf_counter() - began


def train_args(data: Path, target_dir: Path, save: Path, steps: int, bf16: bool, epochs: int = 1) -> list[str]:
    """speculators' flags. Its trainer does not stop the epoch loop at --max-steps (each later epoch still runs a
    step), so the epochs are the fewest that hold the steps."""
    return [
        "train", "--speculator-type", "eagle3", "--verifier-name-or-path", str(target_dir),
        "--data-path", str(data), "--d2t-path", str(data / "d2t.npy"), "--t2d-path", str(data / "t2d.npy"),
        "--draft-vocab-size", str(len(np.load(data / "d2t.npy"))),
        "--total-seq-len", "2048", "--train-data-ratio", str(train_ratio(data)), "--on-missing", "raise",
        "--hidden-states-dtype", "bfloat16" if bf16 else "float32",
        "--loss-implementation", "eager", "--draft-attn-impl", "sdpa", "--num-workers", "0",
        "--epochs", str(epochs), "--max-steps", str(steps), "--scheduler-total-steps", str(steps),
        "--checkpoint-freq", "1", "--save-path", str(save), "--no-resume-from-checkpoint", "--seed", "0",
    ]  # fmt: skip


def seconds_per_step(steps_file: Path) -> float:
    ends = [float(x) for x in steps_file.read_text().split()]
    if len(ends) < 4:
        raise StageFailed(f"the probe recorded {len(ends)} steps in {steps_file}; too few to time")
    return statistics.median(np.diff(ends[2:]).tolist())


def steps_per_epoch(log: Path) -> int:
    """The length of the probe's first training epoch, from its progress bar (the validation bar comes later)."""
    counts = re.findall(r"Epoch 0\s.*?\d+/(\d+)", log.read_text(errors="replace"))
    if not counts:
        raise StageFailed(f"the probe's log {log} shows no epoch length")
    return int(counts[0])


def speculators_head(save: Path) -> Path:
    """The newest checkpoint folder speculators wrote (a config.json beside its weights)."""
    found = sorted(
        (p.parent for p in save.rglob("config.json") if any(p.parent.glob("*.safetensors"))),
        key=lambda p: p.stat().st_mtime,
    )
    if not found:
        raise StageFailed(f"speculators wrote no checkpoint under {save}")
    return found[-1]


def train_peer(data: Path, target_dir: Path, out: Path, budget: float, bf16: bool) -> dict:
    record = out / "train.json"
    if record.is_file():
        return json.loads(record.read_text())
    probe_steps = out / "probe.steps"
    probe_steps.unlink(missing_ok=True)
    probe = train_args(data, target_dir, out / "probe", PROBE_STEPS, bf16)
    run([VENV_PYTHON, str(RUNNER), str(probe_steps), *probe], out / "logs" / "probe.log", "probe")
    per_step = seconds_per_step(probe_steps)
    steps = max(1, round(budget / per_step))
    epochs = math.ceil(steps / steps_per_epoch(out / "logs" / "probe.log"))
    print(f"speculators: {per_step:.2f} s/step in the probe -> {steps} steps for {budget:.0f} s", flush=True)
    steps_file = out / "train.steps"
    steps_file.unlink(missing_ok=True)
    train = train_args(data, target_dir, out / "train", steps, bf16, epochs)
    wall = run([VENV_PYTHON, str(RUNNER), str(steps_file), *train], out / "logs" / "train.log", "train")
    ends = [float(x) for x in steps_file.read_text().split()]
    result = {
        "steps": steps,
        "probe_s_per_step": per_step,
        "wall_s": wall,
        "steps_s": ends[-1] - ends[0] if len(ends) > 1 else 0.0,
        "head": str(speculators_head(out / "train")),
    }
    record.write_text(json.dumps(result, indent=1) + "\n")
    return result


# ---- 4. eval


def evaluate(head: Path, peer: Path, shape: str, out: Path, extra: list[str]) -> Path:
    folder = out / f"eval-{shape}"
    if (folder / "results.json").is_file():
        return folder
    spec = SHAPES[shape]
    methods = []
    for name, drafter in zip(HEADS, (head, peer), strict=True):
        methods += [f"+spec@methods.{name}=eagle3", f"methods.{name}.drafter={drafter}"]
        methods += [f"methods.{name}.{s}" for s in spec]
    cmd = ["draftsmith-eval", "target=smollm2-135m", "spec=ar", *methods, "suite=mt_bench", "wandb.enabled=false"]
    subprocess.run([*cmd, *extra, f"out={folder}"], check=True)
    return folder


def head_records(folder: Path) -> dict[str, list]:
    """Each head's answered turns in one eval folder (its journal), by method name."""
    return method_records(folder, HEADS)


def paired_tau(records: dict[str, list]) -> dict:
    """draftsmith's and speculators' heads over the same resampled prompts: the ratio is draftsmith / speculators."""
    try:
        return shared_paired_tau(records)
    except OtherPrompts as e:
        raise SystemExit(f"{e} (delete the eval-* folders and rerun with the same eval overrides)") from e
    except ValueError as e:
        raise SystemExit(str(e)) from e


def markdown(report: dict) -> str:
    ours, peer = report["draftsmith"], report["speculators"]
    steps = ours["extra"]["stages"]["steps"]
    lines = [
        f"Training budget {report['budget_s']:.0f} s on the same {ours['extra']['examples']} examples: "
        f"draftsmith {steps['steps']} steps in {steps['seconds']:.0f} s, speculators {peer['steps']} steps "
        f"({peer['probe_s_per_step']:.2f} s/step in its probe) in {peer['steps_s']:.0f} s.",
        "",
        "| draft shape | head | τ [95%] | acceptance by position [95%] |",
        "|---|---|---|---|",
    ]
    for shape, r in report["shapes"].items():
        for name in HEADS:
            h = r[name]
            rates = ", ".join(
                f"{a:.3f} {fmt(iv)}"
                for a, iv in zip(h["acceptance_by_position"], h["acceptance_intervals"], strict=True)
            )
            lines.append(f"| {shape} | {name} | {h['tau']:.3f} {fmt(h['tau_interval'])} | {rates} |")
        lines.append(
            f"| {shape} | τ draftsmith / speculators, paired | {r['tau_ratio']:.3f} {fmt(r['tau_ratio_interval'])} | |"
        )
    return "\n".join(lines) + "\n"


def fmt(iv: list[float] | None) -> str:
    return f"[{iv[0]:.3f}, {iv[1]:.3f}]" if iv else "[-]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", type=Path, required=True, help="a draftsmith EAGLE-3 drafter folder")
    ap.add_argument("--features", type=Path, required=True, help="the feature cache it was trained on")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument(
        "--target-dir",
        type=Path,
        default=Path.home() / ".cache/draftsmith/targets/smollm2-135m",
        help="the target's HF folder (draftsmith writes it on first use)",
    )
    ap.add_argument("--seconds", type=float, help="speculators' training budget (default: the head's own)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--no-eval", action="store_true", help="stop after training (evaluate later, same command)")
    args, extra = ap.parse_known_args()
    if not Path(VENV_PYTHON).is_file():
        raise SystemExit(f"no speculators venv at {VENV_PYTHON}: run bash scripts/speculators_venv.sh first")
    config, manifest = check_pair(args.head, args.features)
    budget = args.seconds or config["recipe"]["extra"]["stages"]["steps"]["seconds"]
    args.out.mkdir(parents=True, exist_ok=True)
    bf16 = manifest["key"]["computed_in"] == "bfloat16"
    try:
        write_data(args.head, args.features, manifest, args.target_dir, args.out / "data")
        trained = train_peer(args.out / "data", args.target_dir, args.out, budget, bf16)
    except StageFailed as e:
        raise SystemExit(str(e)) from None
    if args.no_eval:
        return
    report = {"budget_s": budget, "draftsmith": config["recipe"], "speculators": trained, "shapes": {}}
    shapes = args.shapes.split(",")
    records = {
        shape: head_records(evaluate(args.head, Path(trained["head"]), shape, args.out, extra)) for shape in shapes
    }
    for shape in shapes:
        report["shapes"][shape] = paired_tau(records[shape])
    if {OWN["draftsmith"], OWN["speculators"]} <= set(shapes):  # each head in the shape it was trained for
        own = {name: records[OWN[name]][name] for name in HEADS}
        report["shapes"]["own"] = paired_tau(own)
    (args.out / "peer.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (args.out / "peer.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    sys.exit(main())
