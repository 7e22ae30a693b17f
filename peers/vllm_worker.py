"""The vLLM end of the vLLM cross-checks: peers/vllm_client.py starts it, one process per job, in vLLM's own
Python (vLLM pins its own torch), as a script run by its path. It imports vLLM, what vLLM's environment holds (torch,
safetensors, the speculators package, arctic_inference) and the standard library only, never draftsmith.

    python vllm_worker.py --vllm-job JOB.json --vllm-out OUT.json     # the job's prompts, greedy: outputs, counters
    python vllm_worker.py --vllm-serve JOB.json                       # an engine kept up: a request per stdin line
    python vllm_worker.py --arctic-job JOB.json --vllm-out OUT.json   # arctic_inference's suffix drafts on streams
    python vllm_worker.py --speculators-check FOLDER                  # the speculators package reads an export
    python vllm_worker.py --dspark-load-check JOB.json                # vLLM's own code reads a DSpark export
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def make_llm(job: dict):
    """vLLM's engine for a job: fp32 and eager unless the job says `dtype` / `compiled` (vLLM's default
    torch.compile mode). Only vllm is imported here: this runs in vLLM's own environment."""
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")  # both cores for the engine
    from vllm import LLM

    return LLM(
        job["target"],
        dtype=job.get("dtype", "float32"),
        seed=0,
        enforce_eager=not job.get("compiled", False),  # eager by default: no torch.compile warm-up on a 2-core CPU
        max_model_len=job["max_model_len"],
        gpu_memory_utilization=float(os.environ.get("VLLM_MEMORY_FRACTION", "0.25")),  # CPU RAM on this backend
        kv_cache_memory_bytes=1 << 30,
        disable_log_stats=False,  # spec-decode counters come from the stats
        speculative_config=job["speculative_config"],
    )


def vllm_worker(job_file: Path, out_file: Path) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    job = json.loads(job_file.read_text())
    llm = make_llm(job)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]]
    sp = SamplingParams(temperature=0.0, max_tokens=job["max_new_tokens"])
    begin = time.perf_counter()
    if "passes" in job:  # one prompt at a time, as draftsmith's engine runs them: each sees every earlier answer
        passes = [vllm_pass(llm, prompts, sp) for _ in range(job["passes"])]
        result: dict[str, Any] = {"outputs": passes[-1][0], "per_pass": passes, "counters": passes[-1][1]}
    else:
        outs = llm.generate(prompts, sp)
        result = {"outputs": [list(o.outputs[0].token_ids) for o in outs], "counters": counters_of(llm)}
    result["seconds"] = time.perf_counter() - begin
    out_file.write_text(json.dumps(result))


def vllm_server(job_file: Path) -> None:
    """A persistent worker (vllm_client.VllmServer's other end): the job's engine, then one request per stdin line
    ({"ids": [...], "max_new_tokens": n}), one reply per stdout line: the greedy output, the seconds llm.generate
    took on that one prompt, and the growth of the spec-decode counters. The first line out says it is ready."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM logs to stdout: keep that stream for the replies alone
    begin = time.perf_counter()
    llm = make_llm(json.loads(job_file.read_text()))
    from vllm import SamplingParams, __version__
    from vllm.inputs import TokensPrompt

    ready = {"ready": True, "load_s": time.perf_counter() - begin, "vllm": __version__}
    replies.write(json.dumps(ready) + "\n")
    for line in sys.stdin:
        req = json.loads(line)
        sp = SamplingParams(temperature=0.0, max_tokens=req["max_new_tokens"])
        prompt = TokensPrompt(prompt_token_ids=req["ids"])
        if req.get("steps"):
            replies.write(json.dumps(stepped(llm, prompt, sp)) + "\n")
            continue
        before = counters_of(llm)
        begin = time.perf_counter()
        out = llm.generate([prompt], sp, use_tqdm=False)[0]
        seconds = time.perf_counter() - begin
        after = counters_of(llm)
        grown = {k: after.get(k, 0) - before.get(k, 0) for k in SPEC_COUNTERS}
        replies.write(json.dumps({"tokens": list(out.outputs[0].token_ids), "seconds": seconds, **grown}) + "\n")


def stepped(llm, prompt, sp) -> dict:
    """One request run step by step through vLLM's engine (what llm.generate does), reading the spec-decode
    counters after each step: {"tokens", "steps": [[accepted, drafted], ...] for every step after the prefill
    ([0, 0]: a step without a draft, as eval/cross_engine.recount takes them), "seconds" (the engine's steps
    alone, not the counter reads)}."""
    engine, seconds = llm.llm_engine, 0.0
    steps: list[list[int]] = []
    tokens: list[int] = []
    engine.add_request(f"r{time.monotonic_ns()}", prompt, sp)
    before = counters_of(llm)
    while engine.has_unfinished_requests():
        prefilled = bool(tokens)
        begin = time.perf_counter()
        outs = engine.step()
        seconds += time.perf_counter() - begin
        after = counters_of(llm)
        grown = {k: after.get(k, 0) - before.get(k, 0) for k in DRAFT_COUNTERS}
        before = after
        tokens = next((list(o.outputs[0].token_ids) for o in outs), tokens)  # cumulative: all tokens so far
        if prefilled:
            steps.append([int(grown[k]) for k in DRAFT_COUNTERS])
    return {"tokens": tokens, "steps": steps, "seconds": seconds}


DRAFT_COUNTERS = ("vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_draft_tokens")


def speculators_check(folder: Path) -> None:
    """In vLLM's environment, with `pip install --no-deps speculators==0.9.0`: its config class and model class
    read the folder. Its training-only imports (datasets, hs_connectors) are not installed: stubbed."""
    import types

    def stub(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return object

    for name in ("datasets", "hs_connectors"):
        sys.modules.setdefault(name, types.ModuleType(name)).__getattr__ = stub  # type: ignore[method-assign]
    import torch
    from safetensors.torch import load_file
    from speculators import SpeculatorModelConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    config = SpeculatorModelConfig.from_pretrained(str(folder))
    assert isinstance(config, Eagle3SpeculatorConfig), type(config)
    state = Eagle3DraftModel.from_pretrained(str(folder)).state_dict()
    tensors = load_file(str(folder / "model.safetensors"))
    unread = sorted(tensors.keys() - state.keys())
    differ = sorted(
        k for k in tensors.keys() & state.keys() if not torch.equal(state[k].to(tensors[k].dtype), tensors[k])
    )
    from_verifier = sorted(state.keys() - tensors.keys())
    if unread or differ:
        sys.exit(f"speculators package: tensors it does not read {unread}, loaded differently {differ}")
    print(
        f"speculators package: config.json is a valid {type(config).__name__}; Eagle3DraftModel loads all "
        f"{len(tensors)} tensors as written (from the verifier: {', '.join(from_verifier)})"
    )


def dspark_load_check(job_file: Path) -> None:
    """In vLLM's environment, where its engine refuses dspark (vLLM-cpu: Model Runner V1): its own config and
    model code read the export. SpeculativeConfig resolves the method, architecture, depth, mask token and target
    layers from config.json; Qwen3DSparkForCausalLM is built (the V1 runner check skipped: nothing runs a step),
    loads the safetensors with its load_weights (an unknown name fails), and its Markov embedding, bias,
    confidence, d2t and draft logits are compared with the same products from the file."""
    import torch
    from safetensors.torch import load_file
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    job = json.loads(job_file.read_text())
    target = ModelConfig(model=job["target"], dtype="float32", max_model_len=512)
    spec = SpeculativeConfig(
        method="dspark", model=job["model"], target_model_config=target, target_parallel_config=ParallelConfig()
    )
    read = dspark_config_read(spec)
    VllmConfig._validate_v1_model_runner = lambda self: None
    vllm_config = VllmConfig(model_config=target, speculative_config=spec)
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{job['port']}", 0, "gloo")
        initialize_model_parallel(1, 1)
        from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM

        model = Qwen3DSparkForCausalLM(vllm_config=vllm_config)
        w = load_file(str(Path(job["model"]) / "model.safetensors"))
        model.load_weights(w.items())
        process_weights_after_loading(model, spec.draft_model_config, torch.device("cpu"))
        errors = dspark_head_errors(model, w, spec.draft_model_config.hf_config, read["confidence_head_with_markov"])
    print(f"vLLM's own code reads the export: {read}; loads all {len(w)} tensors; max |diff| {errors}")


def dspark_config_read(spec) -> dict:
    """What vLLM's dspark path takes from the export's config.json (its own functions reading it)."""
    from vllm.model_executor.models.qwen3_dflash import dflash_has_any_non_causal
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config
    from vllm.v1.worker.gpu.spec_decode.utils import get_parallel_drafting_token_id

    hf = spec.draft_model_config.hf_config
    return {
        "method": spec.method,
        "architectures": spec.draft_model_config.architectures,
        "num_speculative_tokens (default)": spec.num_speculative_tokens,
        "mask token": get_parallel_drafting_token_id(hf),
        "target layers captured": list(get_eagle3_aux_layers_from_config(spec) or ()),
        "non-causal": dflash_has_any_non_causal(hf),
        "sample_from_anchor": getattr(hf, "sample_from_anchor", True),
        "confidence_head_with_markov": getattr(hf, "confidence_head_with_markov", False),
    }


def dspark_head_errors(model, w: dict, hf, with_markov: bool) -> dict[str, float]:
    """Max |diff| of vLLM's loaded Markov embedding and bias, confidence, d2t and draft logits against the same
    products of the file's tensors, on random previous tokens and hidden states."""
    import torch

    g = torch.Generator().manual_seed(0)
    prev = torch.randint(0, hf.vocab_size, (8,), generator=g)
    h = torch.randn(8, hf.hidden_size, generator=g)
    e, w1, w2 = model.markov_embed(prev), w["markov_head.markov_w1.weight"], w["markov_head.markov_w2.weight"]
    features = torch.cat([h, w1[prev]], -1) if with_markov else h
    conf = torch.sigmoid(features @ w["confidence_head.proj.weight"].T + w["confidence_head.proj.bias"])[:, 0]
    draft = torch.arange(w2.shape[0])
    errors = {
        "W1[prev]": (e - w1[prev]).abs().max().item(),
        "bias": (model.markov_bias(e) - w1[prev] @ w2.T).abs().max().item(),
        "confidence": (model.compute_confidence(h, e) - conf).abs().max().item(),
        "d2t": float(not torch.equal(model.map_draft_to_target(draft), draft + w.get("d2t", 0 * draft))),
    }
    if "lm_head.weight" in w:
        errors["logits"] = (model.compute_draft_logits(h) - h @ w["lm_head.weight"].T).abs().max().item()
    return errors


def counters_of(llm) -> dict:
    """vLLM's counters, and its accepted tokens per draft position (a list: PER_POSITION)."""
    metrics = llm.get_metrics()
    return {m.name: m.value for m in metrics if hasattr(m, "value")} | {
        m.name: list(m.values) for m in metrics if m.name == PER_POSITION
    }


PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def vllm_pass(llm, prompts: list, sp) -> tuple[list, dict, list]:
    """Outputs of one pass over the prompts, one request at a time, the counters (cumulative) after it, and each
    prompt's (accepted, drafted) per verification step (for eval/cross_engine.recount)."""
    runs = [stepped(llm, p, sp) for p in prompts]
    return [r["tokens"] for r in runs], counters_of(llm), [r["steps"] for r in runs]


def arctic_worker(job_file: Path, out_file: Path) -> None:
    """Drafts of arctic_inference's SuffixDecodingCache (as vLLM calls it) after each token of each stream."""
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    job = json.loads(job_file.read_text())
    cfg, depth = job["suffix"], job["suffix"]["max_tree_depth"]
    cache = SuffixDecodingCache(max_tree_depth=depth, max_cached_requests=cfg["max_cached_requests"])
    drafts = []
    for rid, (prompt, response) in enumerate(job["streams"]):
        cache.start_request(rid, prompt)
        seq = list(prompt)
        for t in response:
            cache.add_active_response(rid, [t])
            seq.append(t)
            d = cache.speculate(
                rid,
                seq[-depth:],
                max_spec_tokens=job["k"],
                max_spec_factor=cfg["max_spec_factor"],
                min_token_prob=cfg["min_token_prob"],
                use_tree_spec=cfg["tree"],
            )
            drafts.append([list(d.token_ids), list(d.parents), float(d.score)])
        cache.stop_request(rid)
    out_file.write_text(json.dumps(drafts))


def vllm_tau(counters: dict, before: dict | None = None) -> tuple[float, int]:
    """τ from the counters, or from their growth since `before`."""
    before = before or {}
    grown = {k: counters.get(k, 0) - before.get(k, 0) for k in SPEC_COUNTERS}
    drafts, accepted = grown["vllm:spec_decode_num_drafts"], grown["vllm:spec_decode_num_accepted_tokens"]
    return (1.0 + accepted / drafts if drafts else float("nan")), int(drafts)


SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens")  # vllm_tau's


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-job", help="a job file: run its prompts, write the result to --vllm-out")
    p.add_argument("--vllm-serve", help="a job file: keep its engine up, one request per stdin line")
    p.add_argument("--arctic-job", help="a job file: arctic_inference's drafts on its streams, to --vllm-out")
    p.add_argument("--vllm-out", help="where --vllm-job and --arctic-job write their result")
    p.add_argument("--speculators-check", help="an export folder in the speculators format")
    p.add_argument("--dspark-load-check", help="a job file naming a DSpark export and its target")
    return p.parse_args(argv)


def main(cli: argparse.Namespace) -> None:
    if cli.vllm_job:
        vllm_worker(Path(cli.vllm_job), Path(cli.vllm_out))
    elif cli.vllm_serve:
        vllm_server(Path(cli.vllm_serve))
    elif cli.dspark_load_check:
        dspark_load_check(Path(cli.dspark_load_check))
    elif cli.speculators_check:
        speculators_check(Path(cli.speculators_check))
    elif cli.arctic_job:
        arctic_worker(Path(cli.arctic_job), Path(cli.vllm_out))
    else:
        sys.exit("give one mode: --vllm-job, --vllm-serve, --arctic-job, --speculators-check or --dspark-load-check")


if __name__ == "__main__":  # vLLM spawns its engine process: everything runs under this guard
    main(parse_args())
