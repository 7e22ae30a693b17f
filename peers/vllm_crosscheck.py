"""Cross-check exported drafters in a real vLLM: same prompts, fp32, greedy, a chain of k drafted tokens.

For each drafter: export it (the first format of its kind that vLLM loads: eagle3 / eagle / medusa -> format=vllm,
draft_model -> format=hf), run vLLM with the
matching speculative_config and draftsmith's engine at the same k, and print: vLLM's mean acceptance length
(from llm.get_metrics(): 1 + vllm:spec_decode_num_accepted_tokens / vllm:spec_decode_num_drafts), draftsmith's,
and whether vLLM's outputs equal draftsmith's plain greedy outputs token for token. An eagle3 drafter also goes
out as format=speculators: the speculators package (in vLLM's environment) reads it first, then vLLM serves it
both ways its model card gives, against draftsmith's engine on the export read back (spec.drafter=OUT).

--suffix adds suffix decoding (vLLM's `method: suffix`, ArcticInference's trees; draftsmith's spec=suffix): the
prompts run one at a time, `--passes` times over, in one engine each, so the global tree holds the earlier answers
as it would in a server; τ is printed per pass. It also feeds the same token streams (the prompts and draftsmith's
plain answers) to arctic_inference's SuffixDecodingCache and to draftsmith's SuffixProposer and counts the steps
where both draft the same tokens: that separates the algorithm from the engines.

vLLM lives in its own virtual environment (it pins its own torch): this check runs in draftsmith's Python and
starts `--vllm-python` on vllm_worker.py beside it (`--vllm-job`, `--arctic-job`), one process per method.
One command: bash scripts/vllm_crosscheck.sh [--drafter eagle3=DIR ...] [--fresh] [--suffix] (creates the venv once;
it runs `draftsmith-peers vllm`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .vllm_client import VllmRefused, call_vllm, default_vllm_python, in_vllm_env
from .vllm_worker import PER_POSITION, vllm_tau

if TYPE_CHECKING:
    from draftsmith.serve.engine.metrics import Metrics
    from draftsmith.serve.models.target import LoadedTarget, TargetConfig

KINDS = ("eagle3", "eagle", "medusa", "draft_model")  # checked by default; their vLLM format comes from the registry
TRAINED = {kind: f"runs/quick_{kind}/final" for kind in KINDS}


def chain_spec(kind: str, drafter: Path, k: int):
    """A chain of k whatever the kind: EAGLE trees of one child, Medusa's top-1 path (head d-1's best token at
    depth d); each kind reads the keys it drafts with."""
    from draftsmith.heads.kinds import get
    from draftsmith.serve.engine.tree import TreeConfig
    from draftsmith.serve.spec import SpecConfig

    chain = [[0] * d for d in range(1, k + 1)]
    return SpecConfig(get(kind).name, k, drafter=str(drafter), tree=TreeConfig(1, 0), choices=chain)


def vllm_format(kind: str, name: str | None = None) -> tuple[str, str, dict]:
    """(the kind's format `name`, else its first export format vLLM loads; vLLM's speculative method for it; its
    further options)."""
    from draftsmith.heads.kinds import get, resolve

    formats = {n: resolve(ref) for n, ref in get(kind).formats.items()}
    name = name or next(n for n, f in formats.items() if f.vllm)
    return name, formats[name].vllm, dict(formats[name].vllm_options)


def vllm_depth(kind: str, drafter: Path, tcfg, k: int) -> int:
    """k, unless the kind's vLLM format fixes the depth its command asks for (DSpark: the whole block, since vLLM's
    block is num_speculative_tokens slots); then that, in both engines."""
    from draftsmith.heads.kinds import get, resolve
    from draftsmith.serve.export.base import read_source

    f = resolve(get(kind).formats[vllm_format(kind)[0]])
    if f.vllm_depth is None:
        return k
    depth = f.vllm_depth(read_source(drafter, tcfg))
    if depth != k:
        print(f"[{kind}] k={depth}: its vLLM block is num_speculative_tokens slots, the head's whole block", flush=True)
    return depth


def export_for_vllm(kind: str, drafter: Path, folder: Path, tcfg, k: int) -> dict:
    """The drafter exported (fp32) under folder in the first format of its kind that vLLM loads, and vLLM's
    speculative_config serving it as a chain of k."""
    from draftsmith.serve.export.pipeline import export

    fmt, method, options = vllm_format(kind)
    out = folder / f"{kind}-{fmt}"
    export(drafter, fmt, out, tcfg, "fp32", overwrite=True)
    return {"method": method, "model": str(out), "num_speculative_tokens": k} | options


def run_draftsmith(target, spec, prompts: list[list[int]], max_new: int, max_len: int) -> tuple[list, Metrics]:
    from draftsmith.serve.build import build_engine

    return generate_all(build_engine(target, spec, False, max_len), prompts, max_new)


def generate_all(engine, prompts: list[list[int]], max_new: int) -> tuple[list, Metrics]:
    """Greedy outputs of the prompts, one at a time, and the engine's metrics over all of them."""
    from draftsmith.serve.engine.metrics import Metrics
    from draftsmith.serve.engine.sampling import SamplingParams

    total, outputs = Metrics(requests=0), []
    for ids in prompts:
        g = engine.generate(ids, max_new, SamplingParams())
        outputs.append(g.output_ids)
        total.merge(g.metrics)
    return outputs, total


FRESH = ("eagle3", "eagle", "medusa", "draft_model", "dflash", "peagle", "dspark")  # --kinds picks among them


def fresh_drafters(target, folder: Path) -> dict[str, Path]:
    """Freshly initialised drafters of these kinds for the target, built as training builds them at the default
    sizes: tau near 1 (but for the draft model, a copy of the target), and the plumbing is real."""
    import torch

    from draftsmith.heads.drafter_folder import Recipe, save_drafter
    from draftsmith.serve.drafters import target_info
    from draftsmith.train.head import HeadConfig, build_head

    torch.manual_seed(0)
    # the draft model gets all the target's layers: a copy of the target, so tau must be k + 1 in both engines
    sizes = {"draft_model": HeadConfig(num_layers=0)}
    recipe = Recipe(data="none (freshly initialised, for the cross-check's plumbing)")
    out = {}
    for kind in FRESH:
        head, config = build_head(kind, target, sizes.get(kind, HeadConfig()))
        out[kind] = save_drafter(head, config, kind, target_info(target), recipe, folder / kind)
    return out


def prompts_for(target, n: int) -> list[list[int]]:
    """The first user turns of the first n MT-bench questions, chat-encoded (as draftsmith-eval's first turns)."""
    from draftsmith.eval.suites import mt_bench
    from draftsmith.serve.models.target import encode_chat

    return [encode_chat(target.tokenizer, [{"role": "user", "content": p.turns[0]}]) for p in mt_bench(n)]


def recounted(steps: list, outputs: list[list[int]]) -> str:
    """vLLM's steps counted as draftsmith's engine counts them (eval/cross_engine.py): τ and drafts."""
    from draftsmith.eval.cross_engine import Arm, Record, recount

    records = [
        Record(str(i), recount(s, len(out), 0.0, 0.0), out)
        for i, (s, out) in enumerate(zip(steps, outputs, strict=True))
    ]
    total = Arm("vLLM", "", "", records).pooled()
    return f"{total.mean_acceptance_length:.3f} ({total.drafts} drafts)"


def same(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x == y for x, y in zip(a, b, strict=True))


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def main(args) -> None:
    from draftsmith.heads.kinds import get
    from draftsmith.serve.models.target import TargetConfig, load_target
    from draftsmith.serve.spec import SpecConfig

    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    tcfg = TargetConfig(name=args.target, dtype="float32", device="cpu")
    target = load_target(tcfg)
    drafters = dict(item.split("=", 1) for item in args.drafter)
    if args.fresh:
        drafters = {k: str(v) for k, v in fresh_drafters(target, work / "fresh").items()} | drafters
    drafters = {k: Path(v) for k, v in drafters.items() if k in args.kinds.split(",")}
    if not drafters and not args.suffix and not args.speculators_folder:
        sys.exit(f"no drafters: pass --drafter KIND=DIR (kinds: {', '.join(KINDS)}), --fresh or --suffix")
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
    run = Runner(args, target, tcfg, prompts, plain, base_job, work, max_len)
    for kind, drafter in drafters.items():
        k = vllm_depth(kind, drafter, tcfg, min(args.k, max_depth(kind, drafter)))
        spec = export_for_vllm(kind, drafter, work / "exports", tcfg, k)
        rows.append(run.row(f"{kind} (k={k})", kind, chain_spec(kind, drafter, k), {"speculative_config": spec}))
        if args.speculators and "speculators" in get(kind).formats:
            rows += speculators_rows(run, kind, drafter)
    for i, folder in enumerate(args.speculators_folder):  # made elsewhere: read as they are
        rows += folder_rows(run, "eagle3", Path(folder), f"speculators folder {i + 1}")
    if args.suffix:
        rows += suffix_rows(run)
    report(rows, plain, args, work)


@dataclass
class Runner:
    """One row of the table: draftsmith's engine and vLLM on the same prompts."""

    args: argparse.Namespace
    target: LoadedTarget
    tcfg: TargetConfig
    prompts: list[list[int]]
    plain: list[list[int]]
    base_job: dict
    work: Path
    max_len: int

    def row(self, label: str, name: str, spec, job: dict) -> tuple:
        ours, m = run_draftsmith(self.target, spec, self.prompts, self.args.max_new_tokens, self.max_len)
        print(f"[{name}] draftsmith engine == plain: {same(ours, self.plain)}/{len(self.prompts)}", flush=True)
        mine = f"{m.mean_acceptance_length:.3f} ({m.drafts} drafts){by_position(m.acceptance_rate_per_position)}"
        try:
            v = call_vllm(self.args, self.base_job | {"passes": 1} | job, self.work, name)  # one prompt at a time
        except VllmRefused as e:  # the rest of the table still runs
            print(f"[{name}] {e}", flush=True)
            if job["speculative_config"]["method"] == "dspark":
                folder = job["speculative_config"]["model"]
                print(f"[{name}] {load_check(self.args, self.base_job['target'], folder, self.work)}", flush=True)
            return label, f"not run: {e}", mine, None, []
        tau, drafts = vllm_tau(v["counters"])
        theirs = [a / drafts for a in v["counters"].get(PER_POSITION, [])] if drafts else []
        return (
            label,
            f"{tau:.3f} ({drafts} drafts){by_position(theirs)}; recounted "
            f"{recounted(v['per_pass'][0][2], v['outputs'])}",
            mine,
            same(v["outputs"], self.plain),
            v["outputs"],
        )


def by_position(rates: list[float]) -> str:
    """Acceptance by draft position (accepted at depth i / drafts), as both engines count it."""
    return f", by position {' '.join(f'{r:.3f}' for r in rates)}" if rates else ""


def speculators_rows(run: Runner, kind: str, drafter: Path) -> list[tuple]:
    """format=speculators, checked by the speculators package itself, then served both ways the model card
    gives, against draftsmith's engine on the export read back (spec.drafter=OUT)."""
    from draftsmith.serve.export.pipeline import export

    out = export(drafter, "speculators", run.work / "exports" / f"{kind}-speculators", run.tcfg, "fp32", overwrite=True)
    return folder_rows(run, kind, out, f"{kind}-spec")


def folder_rows(run: Runner, kind: str, folder: Path, name: str) -> list[tuple]:
    """A folder in the speculators format (an export, or what speculators' own trainer saved): checked by the
    speculators package, then served by vLLM both ways the model card gives (the folder alone: vLLM reads the
    target and the method from it, at its speculative_tokens; the target with the method spelled out), against
    draftsmith's engine reading the same folder (spec.drafter=FOLDER)."""
    _, method, _ = vllm_format(kind, "speculators")
    print(speculators_package_check(run.args, folder, run.work), flush=True)
    config = json.loads((folder / "config.json").read_text())
    k_folder = config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    k = run.args.k
    spec = {"method": method, "model": str(folder), "num_speculative_tokens": k}
    return [
        run.row(f"{name}, target + method (k={k})", name, chain_spec(kind, folder, k), {"speculative_config": spec}),
        run.row(
            f"{name}, the folder alone (k={k_folder})",
            f"{name}-alone",
            chain_spec(kind, folder, k_folder),
            {"target": str(folder), "speculative_config": None, "max_model_len": run.max_len + k_folder + 16},
        ),
    ]


def load_check(args, target: str, folder: str, work: Path) -> str:
    """dspark_load_check in vLLM's environment: its last line, or why it failed."""
    from .processes import free_port

    job_file, log = work / "job-dspark-load.json", work / "dspark-load-check.log"
    job_file.write_text(json.dumps({"target": target, "model": folder, "port": free_port()}))
    code = in_vllm_env(args, ["--dspark-load-check", str(job_file)], log)
    last = (log.read_text().strip().splitlines() or [""])[-1]
    return last if code == 0 else f"vLLM's loader check failed (exit {code}; log: {log}): {last}"


def speculators_package_check(args, folder: Path, work: Path) -> str:
    """The speculators package (0.9.0, in vLLM's environment) reads the export: its config class validates
    config.json and Eagle3DraftModel.from_pretrained loads every tensor into the parameter of that name."""
    log = work / "speculators-check.log"
    code = in_vllm_env(args, ["--speculators-check", str(folder)], log)
    last = log.read_text().strip().splitlines()[-1:] or [""]
    if code != 0:
        raise RuntimeError(f"the speculators package refuses {folder} (log: {log}): {last[0]}")
    return last[0]


def suffix_rows(run: Runner) -> list[tuple]:
    """Suffix decoding in both engines, pass by pass (the global tree keeps every earlier answer), and the
    draft-for-draft comparison of the two implementations on the same token streams."""
    from draftsmith.serve.build import build_engine
    from draftsmith.serve.spec import SpecConfig

    args, prompts, plain = run.args, run.prompts, run.plain
    spec = SpecConfig("suffix", args.suffix_k)
    engine = build_engine(run.target, spec, False, run.max_len)
    vspec = {"method": "suffix", "num_speculative_tokens": args.suffix_k}
    v = call_vllm(args, run.base_job | {"speculative_config": vspec, "passes": args.passes}, run.work, "suffix")
    rows: list[tuple] = []
    before: dict = {}
    for i, (outs, counters, steps) in enumerate(v["per_pass"], 1):
        ours, total = generate_all(engine, prompts, args.max_new_tokens)
        tau, drafts = vllm_tau(counters, before)
        before = counters
        mine = f"{total.mean_acceptance_length:.3f} ({total.drafts} drafts)"
        name = f"suffix (k={args.suffix_k}) pass {i}"
        theirs = f"{tau:.3f} ({drafts} drafts); recounted {recounted(steps, outs)}"
        rows.append((name, theirs, mine, same(outs, plain), outs))
        print(f"[suffix pass {i}] draftsmith engine == plain: {same(ours, plain)}/{len(prompts)}", flush=True)
    print(draft_agreement(args, spec, prompts, plain, run.work), flush=True)
    return rows


def draft_agreement(args, spec, prompts: list[list[int]], plain: list[list[int]], work: Path) -> str:
    """Both implementations fed the same streams (each prompt and its plain answer, `passes` times over), one
    token at a time: how often their drafts are the same tokens, and the same score."""
    from dataclasses import asdict

    from draftsmith.serve.proposers.propose_suffix import SuffixProposer

    streams = [[p, o] for p, o in zip(prompts, plain, strict=True)] * args.passes
    job = {"streams": streams, "k": spec.num_tokens, "suffix": asdict(spec.suffix)}
    theirs = call_vllm(args, job, work, "arctic-drafts", mode="--arctic-job")
    proposer, ours = SuffixProposer(spec.suffix, spec.num_tokens), []
    for prompt, answer in streams:
        proposer.start(prompt)
        for t in answer:
            proposer.learn([t])
            d = proposer.speculate()
            ours.append([d.tokens, d.parents, d.score])
    tokens = sum(a[:2] == b[:2] for a, b in zip(ours, theirs, strict=True))
    scores = sum(abs(a[2] - b[2]) < 1e-4 for a, b in zip(ours, theirs, strict=True))
    return (
        f"[suffix] drafts on the same streams vs arctic_inference {arctic_version(args)}: same tokens at "
        f"{tokens}/{len(ours)} steps, same score at {scores}/{len(ours)}"
    )


def arctic_version(args) -> str:
    code = "import importlib.metadata as m; print(m.version('arctic-inference'))"
    run = subprocess.run([args.vllm_python, "-c", code], capture_output=True, text=True)
    return run.stdout.strip() or "?"


def max_depth(kind: str, folder: Path) -> int:
    """The deepest draft the drafter's config allows (Medusa: its heads), else unbounded."""
    from draftsmith.heads.kinds import get

    cap = get(kind).depth_cap(json.loads((folder / "config.json").read_text())["config"])
    return cap if cap is not None else sys.maxsize


def target_dir(tcfg) -> Path:
    from draftsmith.serve.models.target import resolve_target

    return resolve_target(tcfg).resolve()


def report(rows: list, plain: list[list[int]], args, work: Path) -> None:
    n = len(plain)
    head = f"| method | vLLM tau | draftsmith tau | vLLM output == draftsmith plain greedy ({n} prompts) |"
    lines = [head, "|---|---|---|---|"]
    for name, vtau, dtau, ok, outs in rows:
        note = ""
        if ok is None:  # vLLM did not run it
            lines.append(f"| {name} | {vtau} | {dtau} | - |")
            continue
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
    p.add_argument(
        "--speculators",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="kinds with format=speculators (eagle3): also that format (the speculators package, then vLLM two ways)",
    )
    p.add_argument(
        "--speculators-folder",
        action="append",
        default=[],
        help="an EAGLE-3 folder in the speculators format made elsewhere (e.g. by speculators' trainer): run as it is",
    )
    p.add_argument("--suffix", action="store_true", help="also check suffix decoding (needs arctic-inference)")
    p.add_argument("--suffix-k", type=int, default=24, help="suffix: num_speculative_tokens (vLLM's default: 24)")
    p.add_argument("--passes", type=int, default=2, help="suffix: passes over the prompts in one engine")
    p.add_argument("--work", default="runs/vllm_crosscheck")
    p.add_argument("--vllm-python", default=default_vllm_python())
    args = p.parse_args(argv)
    if args.trained:
        repo = Path(__file__).resolve().parent.parent
        found = [f"{k}={repo / d}" for k, d in TRAINED.items() if (repo / d / "model.safetensors").is_file()]
        args.drafter = found + args.drafter
    return args


def cli(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("WANDB_MODE", "offline")
    main(args)


if __name__ == "__main__":
    cli()
