#!/usr/bin/env python
"""Trained drafters against plain decoding on SmolLM2-135M: speedup, acceptance and what a draft costs.

Batch 1, greedy, MT-bench first turns; every method and plain decoding run interleaved prompt by
prompt after a warm-up (draftsmith.eval.timed_runs, through bench_engine.py). Per method: tokens/s, speedup, tau,
acceptance per position, identical outputs, and the drafter's time per verify step as a share of a plain target step.

    python benchmarks/bench_drafters.py --drafter eagle3=runs/quick_eagle3/final --drafter ngram
    python benchmarks/bench_drafters.py --drafter eagle3=DIR:topk=1,num_tokens=4     # a chain instead of the tree

A drafter is SPEC[=DIR][:key=value,...] with SPEC one of heads.kinds.specs() and keys num_tokens, topk,
total_tokens (EAGLE trees), choices (Medusa paths as 0|1|0.0 for [[0], [1], [0, 0]]), layers (layerskip),
ngram_tokens (an n-gram chain merged into the tree), suffix_tokens (the same with suffix decoding), ngram_policy
(merge | prefer, for either), draft_dtype (auto | float32 | bfloat16), draft_vocab (eagle, medusa, draft: logits
over the N most frequent training tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import bench_engine as be  # noqa: E402
import torch  # noqa: E402

from draftsmith.heads import kinds  # noqa: E402
from draftsmith.serve.build import make_proposer, resolve_shape  # noqa: E402
from draftsmith.serve.engine.tree import TreeConfig  # noqa: E402
from draftsmith.serve.models.target import (  # noqa: E402
    TargetConfig,
    load_target,
)
from draftsmith.serve.spec import SpecConfig  # noqa: E402

TREE_KEYS = ("topk", "total_tokens")


def parse_drafter(text: str) -> tuple[str, SpecConfig]:
    """'eagle3=DIR:topk=1,num_tokens=4' -> ('eagle3 k4 chain', SpecConfig)."""
    head, _, opts = text.partition(":")
    name, _, folder = head.partition("=")
    kv = dict(o.split("=", 1) for o in opts.split(",") if o)
    tree = TreeConfig(**{k: int(kv.pop(k)) if k in kv else None for k in TREE_KEYS})  # None: the drafter's
    text_keys = {k: kv.pop(k) for k in ("draft_dtype", "ngram_policy") if k in kv}
    choices = kv.pop("choices", None)
    if choices:
        text_keys["choices"] = [[int(r) for r in path.split(".")] for path in choices.split("|")]
    spec = SpecConfig(name=name, drafter=folder or None, tree=tree, **text_keys, **{k: int(v) for k, v in kv.items()})
    spec = resolve_shape(spec)  # unset keys: the shape the drafter folder was made for, else the kind's default
    tree, label = spec.tree, f"{name} k{spec.num_tokens}"
    if "topk" in kinds.by_spec(name).draft_keys:
        label += " chain" if tree.topk == 1 else f" tree{tree.topk}x{tree.total_tokens}"
    if choices:
        label += f" {choices}"
    if spec.draft_vocab:
        label += f" v{spec.draft_vocab}"
    for lookup, k in (("ngram", spec.ngram_tokens), ("suffix", spec.suffix_tokens)):
        if k:
            label += f" +{lookup}{k}" + (f" {spec.ngram_policy}" if spec.ngram_policy != "prefer" else "")
    if spec.draft_dtype != "auto":
        label += f" {spec.draft_dtype}"
    return label, spec


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", action="append", required=True, help="SPEC[=DIR][:key=value,...], repeatable")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--mtbench-ids", type=be.csv(int), default=[81, 91, 101, 111, 121, 131, 141, 151])
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--warmup", type=int, default=16)
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--out", default="runs/bench_drafters.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_start, began = os.getloadavg(), time.perf_counter()

    target = load_target(TargetConfig(dtype=args.dtype))
    tok, eos = target.tokenizer, ()  # EOS ignored: every method generates exactly max_new_tokens
    questions = be.mtbench_questions()
    prompts = [be.Prompt(f"mt{q}", be.chat_ids(tok, questions[q]["turns"][0])) for q in args.mtbench_ids]
    plain = be.TimedEngine(target.model, max_seq_len=args.max_seq_len)
    variants: list[be.Variant] = [("plain", lambda ids, n: be.run_engine(plain, ids, n, eos))]
    for text in args.drafter:
        label, spec = parse_drafter(text)
        if label in dict(variants):  # the same method on two drafters: name the run folder too
            label += f" ({Path(spec.drafter).parent.name})"
        engine = be.TimedEngine(target.model, make_proposer(spec, target), max_seq_len=args.max_seq_len)
        variants.append((label, lambda ids, n, e=engine: be.run_engine(e, ids, n, eos)))

    res = be.interleave("drafters vs plain", variants, prompts, args.repeats, args.max_new_tokens, args.warmup)
    summary = summarize(res, args.repeats)
    summary["env"] = {"torch": torch.__version__, "threads": torch.get_num_threads(), "loadavg_start": load_start}
    summary["env"]["loadavg_end"], summary["env"]["seconds"] = os.getloadavg(), time.perf_counter() - began
    summary["args"] = vars(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=1))
    print(report(summary, target.target_id, args, len(prompts)))


def summarize(res: be.Results, repeats: int) -> dict:
    stats = {name: be.throughput(runs) for name, runs in res.runs.items()}
    cost = {name: be.overhead(runs) for name, runs in res.runs.items()}
    target_step_ms = cost["plain"]["ms_per_step"]
    methods = {}
    for name, runs in res.runs.items():
        s, c = stats[name], cost[name]
        draft_ms = c["ms_per_step"] * c["proposer_pct"] / 100
        methods[name] = {
            **s,
            "speedup": s["tokens_per_s"] / stats["plain"]["tokens_per_s"],
            "ms_per_step": c["ms_per_step"],
            "draft_ms_per_step": draft_ms,
            "draft_share_of_target_step": draft_ms / target_step_ms if target_step_ms else 0.0,
            **be.identical(runs, res.runs["plain"]),
        }
    return {"prompts": [p.name for p in res.prompts], "repeats": repeats, "methods": methods}


def report(summary: dict, target_id: str, args, n_prompts: int) -> str:
    rows = []
    for name, m in summary["methods"].items():
        base = name == "plain"
        per_pos = " ".join(f"{a:.2f}" for a in m["acceptance_rate_per_position"])
        rows.append(
            [name, m["tokens_per_s"], m["speedup"], None if base else m["tau"], per_pos or "-", m["ms_per_step"]]
            + [None if base else m["draft_share_of_target_step"], "-" if base else be.same_str(m)]
        )
    title = (
        f"Drafters vs plain decoding: {target_id}, {args.dtype}, {n_prompts} MT-bench first turns, "
        f"{args.max_new_tokens} new tokens, median of {args.repeats}, {torch.get_num_threads()} threads"
    )
    headers = ["method", "tok/s", "speedup", "tau", "accepted per position", "ms/step", "draft/target", "identical"]
    env = summary["env"]
    tail = f"\nload average {be.fmt_load(env['loadavg_start'])} -> {be.fmt_load(env['loadavg_end'])}; "
    return be.table(title, headers, rows) + tail + f"{env['seconds']:.0f} s; JSON: {args.out}"


if __name__ == "__main__":
    main()
