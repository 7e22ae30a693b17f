#!/usr/bin/env python
"""Shuffled against length-grouped batches (train.group_by_length): training steps of a recipe interleaved in one
process, one batch from each order in turn, on the same head; real tokens a second of each and their ratio, with a
95% bootstrap interval over blocks of steps.

The recipe's data and features are made (or found cached) as draftsmith-train makes them; the head's weights move
with every step, so the two orders train one head together and neither is a finished run: this times steps, it
does not judge the heads (docs/benchmarks.md, Three more arms at the quick point).

  python benchmarks/bench_batching.py [--steps 100] [--block 10] [OVERRIDES ...]   (hydra overrides of draftsmith-train;
      default: target=smollm2-135m head=eagle3 train=quick data.regenerate.fidelity=0)
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["WANDB_MODE"] = "disabled"

import numpy as np  # noqa: E402
from hydra import compose, initialize_config_module  # noqa: E402

from draftsmith.eval.cross_engine import fmt  # noqa: E402
from draftsmith.eval.stats import RESAMPLES, interval  # noqa: E402
from draftsmith.serve.shared.cli import typed  # noqa: E402
from draftsmith.train import trainer  # noqa: E402
from draftsmith.train.config import RunConfig  # noqa: E402

DEFAULT = ["target=smollm2-135m", "head=eagle3", "train=quick", "data.regenerate.fidelity=0"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=100, help="steps of each order")
    p.add_argument("--block", type=int, default=10, help="steps per resampled block")
    p.add_argument("overrides", nargs="*", default=DEFAULT)
    args = p.parse_args()
    if args.steps < 2 * args.block or args.steps % args.block:
        p.error(f"--steps {args.steps} must be a multiple of --block {args.block}, two blocks or more")
    with tempfile.TemporaryDirectory() as out, initialize_config_module("draftsmith.conf", version_base=None):
        cfg = compose("train", overrides=[f"out={out}", *args.overrides, "train.eval_every=0", "wandb.enabled=false"])
        loop = trainer.setup(typed(cfg, RunConfig))
        if args.steps + 5 > loop.plan.steps_per_epoch * loop.plan.grad_accum:
            raise SystemExit(f"--steps {args.steps} needs more batches than an epoch's {loop.plan.steps_per_epoch}")
        loop.model.train()
        orders = {"shuffled": iter(loop.loader(0, 0))}
        loop.cfg.train.group_by_length = True
        orders["grouped"] = iter(loop.loader(0, 0))
        for _ in range(5):  # warm-up
            loop.micro_step(next(orders["shuffled"]))
        seconds = {name: np.zeros(args.steps) for name in orders}
        real = {name: np.zeros(args.steps) for name in orders}
        padded = dict.fromkeys(orders, 0)
        for i in range(args.steps):
            for name in sorted(orders, reverse=i % 2 == 1):  # which goes first alternates
                batch = next(orders[name])
                begin = time.perf_counter()
                loop.micro_step(batch)
                seconds[name][i] = time.perf_counter() - begin
                real[name][i], padded[name] = int(batch["lengths"].sum()), padded[name] + batch["input_ids"].numel()
    blocks = args.steps // args.block
    rng = np.random.default_rng(0)
    picks = rng.integers(0, blocks, size=(RESAMPLES, blocks))

    def rate(name: str) -> np.ndarray:
        per_block = [x.reshape(blocks, -1).sum(1) for x in (real[name], seconds[name])]
        return per_block[0][picks].sum(1) / per_block[1][picks].sum(1)

    pace = {name: real[name].sum() / seconds[name].sum() for name in orders}
    for name in orders:
        padding, rate_text = padded[name] / real[name].sum(), fmt(pace[name], interval(rate(name)), 0)
        print(f"{name:9s} {rate_text:>20s} real tokens/s  padded {padding:.2f}x the real")
    ratio = fmt(pace["grouped"] / pace["shuffled"], interval(rate("grouped") / rate("shuffled")))
    print(f"grouped / shuffled: {ratio} (paired over blocks)")


if __name__ == "__main__":
    main()
