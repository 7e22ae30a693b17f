"""The vLLM end of regeneration (train/regenerate_vllm.py starts it): one vLLM engine over the target, answering
batches of chat-encoded prompts with token ids, so the chat template, turns and files stay on draftsmith's side.

It runs in vLLM's own Python (vLLM pins its own torch and transformers), as a script: it imports vLLM and the
standard library only, never draftsmith.

    python regenerate_vllm_worker.py JOB.json
    # JOB: {"model", "dtype", "max_model_len", "kv_cache_bytes", "engine_args", "seeded"}

Top-p on a CPU: vLLM sorts every row's whole vocabulary at each step; the worker keeps the top NUCLEUS_CANDIDATES
tokens of a row instead wherever they hold the nucleus, and runs vLLM's engine in its own process so that its sampler
takes that (where VLLM_ENABLE_V1_MULTIPROCESSING is set to 1 the engine's process keeps vLLM's own). It keeps vLLM's
tokens except at the nucleus's edge: where tokens tie there (a bf16 target's logits often do) the two keep different
ones of the tied, equally likely tokens, and where the edge falls within the rounding of the masses' sums they may
keep one token more or less; a seeded draw can then differ. DRAFTSMITH_VLLM_WHOLE_SORT=1 keeps vLLM's own
(benchmarks/bench_regen.py compares them).

Its first stdout line says it is ready (vLLM's version, the load time; one token generated); then each stdin line
is a batch {"prompts": [[ids]], "max_tokens": [n], "seeds": [s], "temperature", "top_p", "stop_token_ids"} and
each stdout line the reply {"outputs": [[ids]], "finish_reasons": ["stop" | "length"], "seconds"}. vLLM's own
logs go to stderr. End of input ends it.
"""

from __future__ import annotations

import json
import os
import sys
import time

# a row's top tokens top-p picks among (the rest of its vocabulary is sorted only where they fall short)
NUCLEUS_CANDIDATES = 1024


def make_llm(job: dict):
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")  # every core for the engine on a CPU
    from vllm.platforms import current_platform

    if current_platform.is_cpu() and os.environ.get("DRAFTSMITH_VLLM_WHOLE_SORT") != "1":
        # the engine in this process, where its sampler is patched (a spawned engine process imports vLLM afresh)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        nucleus_among_candidates()
    from vllm import LLM

    return LLM(
        job["model"],
        dtype=job["dtype"],
        seed=0,
        max_model_len=job["max_model_len"],
        kv_cache_memory_bytes=job["kv_cache_bytes"],
        generation_config="vllm",  # the sampling asked for, not defaults from the model's generation_config.json
        **engine_args(job),
    )


def nucleus_among_candidates() -> None:
    """vLLM's top-p on a CPU sorts each row's whole vocabulary at every step: for a 49k vocabulary and a few hundred
    rows in flight, several times the model's own forward. A token is in the nucleus where the mass of the tokens
    above it is under p, so a row whose top NUCLEUS_CANDIDATES tokens hold mass p has its nucleus among them, and is
    masked from a topk; a row whose nucleus reaches past them goes to vLLM's sort."""
    import torch
    from vllm.v1.sample.ops import topk_topp_sampler

    whole_sort = topk_topp_sampler.apply_top_k_top_p

    def apply(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
        if p is None or k is not None or logits.shape[-1] <= NUCLEUS_CANDIDATES:
            return whole_sort(logits, k, p)
        top = logits.softmax(dim=-1).topk(NUCLEUS_CANDIDATES, dim=-1)  # descending
        above = top.values.cumsum(dim=-1) - top.values
        keep = above < p.to(above.dtype).unsqueeze(1)
        keep[:, 0] = True  # the top token always
        kept = logits.gather(1, top.indices).masked_fill(~keep, float("-inf"))
        masked = torch.full_like(logits, float("-inf")).scatter_(1, top.indices, kept)
        short = keep[:, -1].nonzero().squeeze(1)  # every candidate kept: the nucleus may reach past them
        if short.numel():
            masked[short] = whole_sort(logits[short], None, p[short])
        return masked

    topk_topp_sampler.apply_top_k_top_p = apply


def engine_args(job: dict) -> dict:
    """The job's engine arguments, and what seeded sampling needs on a CPU: vLLM rewinds a request's generator after
    a partial (chunked) prefill step, which a CPU generator cannot do (it has no offset), so there every prefill
    runs whole unless the job says otherwise, and a step holds at least one whole prompt."""
    args = dict(job.get("engine_args", {}))
    if job.get("seeded"):
        from vllm.platforms import current_platform

        if current_platform.is_cpu() and args.setdefault("enable_chunked_prefill", False) is False:
            if "max_num_batched_tokens" in args:  # a whole prefill must fit one step
                args["max_num_batched_tokens"] = max(args["max_num_batched_tokens"], job["max_model_len"])
    return args


def answer(llm, batch: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [
        SamplingParams(
            temperature=batch["temperature"],
            top_p=batch["top_p"],
            seed=seed,
            max_tokens=n,
            stop_token_ids=batch["stop_token_ids"],
            detokenize=False,
        )
        for n, seed in zip(batch["max_tokens"], batch["seeds"], strict=True)
    ]
    began = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch["prompts"]], params, use_tqdm=False)
    return {
        "outputs": [list(o.outputs[0].token_ids) for o in outs],
        "finish_reasons": [o.outputs[0].finish_reason for o in outs],
        "seconds": time.perf_counter() - began,
    }


def warm_up(llm) -> None:
    """One token through the engine: a target vLLM loads but cannot run (a head size its CPU attention lacks)
    fails here, at start, where backend=auto still falls back to draftsmith's own decoder."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm.generate([TokensPrompt(prompt_token_ids=[0])], SamplingParams(max_tokens=1), use_tqdm=False)


def serve(job_file: str) -> None:
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM logs to stdout: that stream is kept for the replies alone
    with open(job_file) as f:
        job = json.load(f)
    began = time.perf_counter()
    llm = make_llm(job)
    warm_up(llm)
    import vllm

    ready = {"ready": True, "version": vllm.__version__, "load_s": time.perf_counter() - began}
    replies.write(json.dumps(ready) + "\n")
    for line in sys.stdin:
        replies.write(json.dumps(answer(llm, json.loads(line))) + "\n")


if __name__ == "__main__":
    serve(sys.argv[1])
