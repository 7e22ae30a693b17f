"""The vLLM end of the reload check (vllm_reload_versions.py starts it): one engine in vLLM's own Python, its
EAGLE-3 drafter's weights replaced version after version. It runs as a script by its path and imports vLLM, torch,
safetensors, the standard library and vllm_worker.py beside it (by name: that folder is first on its path), never
draftsmith. vLLM's worker process imports DrafterReload from this module by name (worker_extension_cls), with this
folder on its PYTHONPATH.

    python vllm_reload_worker.py --vllm-job JOB.json --vllm-out OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import vllm_worker as vw  # type: ignore[import-not-found]  # its sibling, found by name where it runs


class DrafterReload:
    """Mixed into vLLM's worker (worker_extension_cls); llm.collective_rpc("load_drafter", args=(folder,))."""

    model_runner: Any  # the worker's, which this class is mixed into
    vllm_config: Any

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


def make_llm(job: dict):
    """vLLM as vllm_worker starts it (fp32, eager, spec-decode stats on), plus the worker extension."""
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
        worker_extension_cls="vllm_reload_worker.DrafterReload",
    )


def vllm_job(job_file: Path, out_file: Path) -> None:
    """One engine, every version in turn: reload (not for the first, it was loaded at start), probe, generate."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    job = json.loads(job_file.read_text())
    begin = time.perf_counter()
    llm = make_llm(job)
    result: dict[str, Any] = {"start_s": time.perf_counter() - begin, "versions": []}
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
        before = vw.counters_of(llm)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        row["generate_s"] = time.perf_counter() - t0
        row["outputs"] = [list(o.outputs[0].token_ids) for o in outs]
        row["tau"], row["drafts"] = vw.vllm_tau(vw.counters_of(llm), before)
        print(f"[vLLM] version {i}: tau {row['tau']:.3f}, fc err {row['fc_err']:.2e}", flush=True)
        result["versions"].append(row)
    result["total_s"] = time.perf_counter() - begin
    out_file.write_text(json.dumps(result))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-job", required=True, help="a job file: the target, prompts and exports to load in turn")
    p.add_argument("--vllm-out", required=True, help="where the versions' results go")
    return p.parse_args(argv)


if __name__ == "__main__":  # vLLM spawns its engine process: everything runs under this guard
    cli = parse_args()
    vllm_job(Path(cli.vllm_job), Path(cli.vllm_out))
