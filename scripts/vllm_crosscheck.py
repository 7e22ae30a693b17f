"""Cross-check exported drafters in a real vLLM: same prompts, fp32, greedy, a chain of k drafted tokens.

For each drafter: export it (the first format of its kind that vLLM loads: eagle3 / eagle / medusa -> format=vllm,
draft_model -> format=hf), run vLLM with the
matching speculative_config and draftsmith's engine at the same k, and print: vLLM's mean acceptance length
(from llm.get_metrics(): 1 + vllm:spec_decode_num_accepted_tokens / vllm:spec_decode_num_drafts), draftsmith's,
and whether vLLM's outputs equal draftsmith's plain greedy outputs token for token.

vLLM lives in its own virtual environment (it pins its own torch): this script runs in draftsmith's Python and
starts `--vllm-python` on itself in worker mode (`--vllm-job`), one process per method.
One command: bash scripts/vllm_crosscheck.sh [--drafter eagle3=DIR ...] [--fresh] (creates the venv once).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

KINDS = ("eagle3", "eagle", "medusa", "draft_model")  # checked by default; their vLLM format comes from the registry
TRAINED = {kind: f"runs/quick_{kind}/final" for kind in KINDS}


# ---------------------------------------------------------------- vLLM worker (runs in the vLLM venv)


def vllm_worker(job_file: Path, out_file: Path) -> None:
    """Only vllm is imported here: this runs in vLLM's own environment."""
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")  # both cores for the engine
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    job = json.loads(job_file.read_text())
    llm = LLM(
        job["target"],
        dtype="float32",
        seed=0,
        enforce_eager=True,  # no torch.compile warm-up on a 2-core CPU
        max_model_len=job["max_model_len"],
        gpu_memory_utilization=float(os.environ.get("VLLM_MEMORY_FRACTION", "0.25")),  # CPU RAM on this backend
        kv_cache_memory_bytes=1 << 30,
        disable_log_stats=False,  # spec-decode counters come from the stats
        speculative_config=job["speculative_config"],
    )
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]]
    begin = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=job["max_new_tokens"]))
    seconds = time.perf_counter() - begin
    counters = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
    result = {"outputs": [list(o.outputs[0].token_ids) for o in outs], "counters": counters, "seconds": seconds}
    out_file.write_text(json.dumps(result))


# ---------------------------------------------------------------- draftsmith side


def chain_spec(kind: str, drafter: Path, k: int):
    """A chain of k whatever the kind: EAGLE trees of one child, Medusa's top-1 path (head d-1's best token at
    depth d); each kind reads the keys it drafts with."""
    from draftsmith.heads.kinds import get
    from draftsmith.serve.build import SpecConfig
    from draftsmith.serve.eagle import TreeConfig

    chain = [[0] * d for d in range(1, k + 1)]
    return SpecConfig(get(kind).spec, k, drafter=str(drafter), tree=TreeConfig(1, 0), choices=chain)


def vllm_format(kind: str) -> tuple[str, str]:
    """(the kind's first export format vLLM loads, vLLM's speculative method for it)."""
    from draftsmith.heads.kinds import get, resolve

    return next((name, resolve(ref).vllm) for name, ref in get(kind).formats.items() if resolve(ref).vllm)


def run_draftsmith(target, spec, prompts: list[list[int]], max_new: int, max_len: int) -> tuple[list, object]:
    from draftsmith.serve.build import build_engine
    from draftsmith.serve.metrics import Metrics
    from draftsmith.serve.sampling import SamplingParams

    engine = build_engine(target, spec, False, max_len)
    total, outputs = Metrics(requests=0), []
    for ids in prompts:
        g = engine.generate(ids, max_new, SamplingParams())
        outputs.append(g.output_ids)
        total.merge(g.metrics)
    return outputs, total


def fresh_drafters(target, folder: Path) -> dict[str, Path]:
    """Freshly initialised drafters of every kind for the target: tau near 1 (but for the draft model, a copy of
    the target), and the plumbing is real."""
    import torch

    from draftsmith.heads.draft_model import DraftModel, DraftModelConfig
    from draftsmith.heads.drafter import Recipe, save_drafter
    from draftsmith.heads.eagle import EagleConfig, EagleHead
    from draftsmith.heads.eagle3 import Eagle3Config, Eagle3Head
    from draftsmith.heads.medusa import MedusaConfig, MedusaHeads
    from draftsmith.serve.build import target_info

    torch.manual_seed(0)
    c = target.model.config
    heads = {
        "eagle3": (Eagle3Head(cfg := Eagle3Config.from_target(c), target.model), cfg),
        "eagle": (EagleHead(cfg := EagleConfig.from_target(c), target.model), cfg),
        "medusa": (MedusaHeads(cfg := MedusaConfig(c.hidden_size, c.vocab_size), target.model), cfg),
        # all the target's layers: a copy of the target, so tau must be k + 1 in both engines (counters checked)
        "draft_model": (DraftModel(cfg := DraftModelConfig(num_layers=0), target.model), cfg),
    }
    recipe = Recipe(data="none (freshly initialised, for the cross-check's plumbing)")
    return {k: save_drafter(h, cfg, k, target_info(target), recipe, folder / k) for k, (h, cfg) in heads.items()}


def prompts_for(target, n: int) -> list[list[int]]:
    """The first user turns of the first n MT-bench questions, chat-encoded (as draftsmith-eval's first turns)."""
    from draftsmith.eval.suites import mt_bench
    from draftsmith.serve.build import encode_chat

    return [encode_chat(target.tokenizer, [{"role": "user", "content": p.turns[0]}]) for p in mt_bench(n)]


def call_vllm(args, job: dict, work: Path, name: str) -> dict:
    job_file, out_file = work / f"job-{name}.json", work / f"vllm-{name}.json"
    job_file.write_text(json.dumps(job))
    out_file.unlink(missing_ok=True)
    log = work / f"vllm-{name}.log"
    cmd = [args.vllm_python, __file__, "--vllm-job", str(job_file), "--vllm-out", str(out_file)]
    print(f"[{name}] vLLM running (log: {log})", flush=True)
    with open(log, "w") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=os.environ | {"PYTHONPATH": ""})
    if done.returncode != 0 or not out_file.is_file():
        tail = "\n".join(log.read_text().splitlines()[-25:])
        raise RuntimeError(f"vLLM failed for {name} (exit {done.returncode}); last lines of {log}:\n{tail}")
    return json.loads(out_file.read_text())


def vllm_tau(counters: dict) -> tuple[float, int]:
    drafts = counters.get("vllm:spec_decode_num_drafts", 0)
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens", 0)
    return (1.0 + accepted / drafts if drafts else float("nan")), int(drafts)


def same(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x == y for x, y in zip(a, b, strict=True))


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def main(args) -> None:
    from draftsmith.serve.build import SpecConfig, load
    from draftsmith.serve.export import export
    from draftsmith.serve.target import TargetConfig

    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    tcfg = TargetConfig(name=args.target, dtype="float32", device="cpu")
    target = load(tcfg)
    drafters = dict(item.split("=", 1) for item in args.drafter)
    if args.fresh:
        drafters = {k: str(v) for k, v in fresh_drafters(target, work / "fresh").items()} | drafters
    drafters = {k: Path(v) for k, v in drafters.items() if k in args.kinds.split(",")}
    if not drafters:
        sys.exit(f"no drafters: pass --drafter KIND=DIR (kinds: {', '.join(KINDS)}) or --fresh")
    prompts = prompts_for(target, args.prompts)
    max_len = max(map(len, prompts)) + args.max_new_tokens + 16
    base_job = {"target": str(target_dir(tcfg)), "prompts": prompts, "max_new_tokens": args.max_new_tokens}
    base_job["max_model_len"] = max_len + args.k + 16
    print(f"{len(prompts)} MT-bench prompts, {args.max_new_tokens} new tokens, fp32 greedy, k={args.k}", flush=True)
    plain, _ = run_draftsmith(target, SpecConfig("ar"), prompts, args.max_new_tokens, max_len)
    rows = []
    if args.plain:
        v = call_vllm(args, base_job | {"speculative_config": None}, work, "plain")
        rows.append(("none (plain)", "-", "-", same(v["outputs"], plain), v["outputs"]))
    for kind, drafter in drafters.items():
        fmt, method = vllm_format(kind)
        out = work / "exports" / f"{kind}-{fmt}"
        export(drafter, fmt, out, tcfg, "fp32", overwrite=True)
        k = min(args.k, max_depth(kind, drafter))
        ours, m = run_draftsmith(target, chain_spec(kind, drafter, k), prompts, args.max_new_tokens, max_len)
        spec = {"method": method, "model": str(out), "num_speculative_tokens": k}
        v = call_vllm(args, base_job | {"speculative_config": spec}, work, kind)
        tau, drafts = vllm_tau(v["counters"])
        rows.append(
            (
                f"{kind} (k={k})",
                f"{tau:.3f} ({drafts} drafts)",
                f"{m.mean_acceptance_length:.3f} ({m.drafts} drafts)",
                same(v["outputs"], plain),
                v["outputs"],
            )
        )
        print(f"[{kind}] draftsmith engine == plain: {same(ours, plain)}/{len(prompts)}", flush=True)
    report(rows, plain, args, work)


def max_depth(kind: str, folder: Path) -> int:
    """The deepest draft the drafter's config allows (Medusa: its heads), else unbounded."""
    from draftsmith.heads.kinds import get

    cap = get(kind).depth_cap(json.loads((folder / "config.json").read_text())["config"])
    return cap if cap is not None else sys.maxsize


def target_dir(tcfg) -> Path:
    from draftsmith.serve.target import resolve_target

    return resolve_target(tcfg).resolve()


def report(rows: list, plain: list[list[int]], args, work: Path) -> None:
    n = len(plain)
    head = f"| method | vLLM tau | draftsmith tau | vLLM output == draftsmith plain greedy ({n} prompts) |"
    lines = [head, "|---|---|---|---|"]
    for name, vtau, dtau, ok, outs in rows:
        note = ""
        if ok < n:
            diffs = [first_difference(o, p) for o, p in zip(outs, plain, strict=True) if o != p]
            note = f" (first differences at tokens {diffs})"
        lines.append(f"| {name} | {vtau} | {dtau} | {ok}/{n}{note} |")
    table = "\n".join(lines)
    print("\n" + table)
    (work / "crosscheck.md").write_text(table + "\n")
    print(f"\n(table also in {work / 'crosscheck.md'})")


def parse_args(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", action="append", default=[], help="KIND=DIR (eagle3, eagle, medusa, draft_model)")
    p.add_argument("--trained", action="store_true", help=f"use the trained drafters that exist: {TRAINED}")
    p.add_argument("--fresh", action="store_true", help="add freshly initialised drafters for kinds not given")
    p.add_argument("--kinds", default=",".join(KINDS), help="which of the given drafters to check")
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--prompts", type=int, default=8, help="the first N MT-bench questions (first turn)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens (a chain)")
    p.add_argument("--plain", action=argparse.BooleanOptionalAction, default=True, help="also run vLLM plain")
    p.add_argument("--work", default="runs/vllm_crosscheck")
    p.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON", "/work/vllm-venv/bin/python"))
    p.add_argument("--vllm-job", help=argparse.SUPPRESS)
    p.add_argument("--vllm-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.trained:
        repo = Path(__file__).resolve().parent.parent
        found = [f"{k}={repo / d}" for k, d in TRAINED.items() if (repo / d / "model.safetensors").is_file()]
        args.drafter = found + args.drafter
    return args


if __name__ == "__main__":  # vLLM spawns its engine process: everything runs under this guard
    cli = parse_args()
    if cli.vllm_job:
        vllm_worker(Path(cli.vllm_job), Path(cli.vllm_out))
    else:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("WANDB_MODE", "offline")
        main(cli)
