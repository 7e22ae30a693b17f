"""The vLLM end of regeneration (train/regenerate_vllm.py starts it): one vLLM engine over the target, answering
batches of chat-encoded prompts with token ids, so the chat template, turns and files stay on draftsmith's side.

It runs in vLLM's own Python (vLLM pins its own torch and transformers), as a script: it imports vLLM and the
standard library only, never draftsmith.

    python regenerate_vllm_worker.py JOB.json
    # JOB: {"model", "dtype", "max_model_len", "kv_cache_bytes", "engine_args", "seeded"}

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


def make_llm(job: dict):
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")  # every core for the engine on a CPU
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
