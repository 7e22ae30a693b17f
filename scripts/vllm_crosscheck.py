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

vLLM lives in its own virtual environment (it pins its own torch): this script runs in draftsmith's Python and
starts `--vllm-python` on itself in worker mode (`--vllm-job`, `--arctic-job`), one process per method.
One command: bash scripts/vllm_crosscheck.sh [--drafter eagle3=DIR ...] [--fresh] [--suffix] (creates the venv once).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


def default_vllm_python() -> str:
    """$VLLM_PYTHON, else the venv scripts/vllm_venv.sh makes (~/.cache/draftsmith/vllm-venv). Computed without
    draftsmith: this script also runs in vLLM's Python."""
    venv = os.path.expanduser("~/.cache/draftsmith/vllm-venv")
    return os.environ.get("VLLM_PYTHON", os.path.join(venv, "bin", "python"))


KINDS = ("eagle3", "eagle", "medusa", "draft_model")  # checked by default; their vLLM format comes from the registry
TRAINED = {kind: f"runs/quick_{kind}/final" for kind in KINDS}


# ---------------------------------------------------------------- vLLM worker (runs in the vLLM venv)


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
        result = {"outputs": passes[-1][0], "per_pass": passes, "counters": passes[-1][1]}
    else:
        outs = llm.generate(prompts, sp)
        result = {"outputs": [list(o.outputs[0].token_ids) for o in outs], "counters": counters_of(llm)}
    result["seconds"] = time.perf_counter() - begin
    out_file.write_text(json.dumps(result))


def vllm_server(job_file: Path) -> None:
    """A persistent worker (bench_engine.py's peer section): the job's engine, then one request per stdin line
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
    engine, steps, seconds, tokens = llm.llm_engine, [], 0.0, []
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
        sys.modules.setdefault(name, types.ModuleType(name)).__getattr__ = stub  # type: ignore[attr-defined]
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
    VllmConfig._validate_v1_model_runner = lambda self: None  # type: ignore[method-assign]
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


# ---------------------------------------------------------------- draftsmith side


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


def run_draftsmith(target, spec, prompts: list[list[int]], max_new: int, max_len: int) -> tuple[list, object]:
    from draftsmith.serve.build import build_engine

    return generate_all(build_engine(target, spec, False, max_len), prompts, max_new)


def generate_all(engine, prompts: list[list[int]], max_new: int) -> tuple[list, object]:
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


def call_vllm(args, job: dict, work: Path, name: str, mode: str = "--vllm-job") -> dict:
    job_file, out_file = work / f"job-{name}.json", work / f"vllm-{name}.json"
    job_file.write_text(json.dumps(job))
    out_file.unlink(missing_ok=True)
    log = work / f"vllm-{name}.log"
    print(f"[{name}] vLLM running (log: {log})", flush=True)
    code = in_vllm_env(args, [mode, str(job_file), "--vllm-out", str(out_file)], log)
    if code != 0 or not out_file.is_file():
        reason = refusal(log)
        if reason:
            raise VllmRefused(f"{reason} (log: {log})")
        tail = "\n".join(log.read_text().splitlines()[-25:])
        raise RuntimeError(f"vLLM failed for {name} (exit {code}); last lines of {log}:\n{tail}")
    return json.loads(out_file.read_text())


def refusal(log: Path) -> str | None:
    """Why vLLM refused its configuration (VllmConfig's validation, before anything runs), from its log."""
    lines = log.read_text().splitlines() if log.is_file() else []
    refused = next((line for line in reversed(lines) if "Value error, " in line), None)
    if refused is None:
        return None
    return f"vLLM refuses the configuration: {refused.split('Value error, ', 1)[1].split(' [type=', 1)[0]}"


class VllmRefused(RuntimeError):
    """vLLM refused the speculative config before running anything (e.g. a method its CPU build cannot run)."""


def in_vllm_env(args, argv: list[str], log: Path) -> int:
    """Run this script with argv in vLLM's Python, its output to log."""
    with open(log, "w") as f:
        cmd = vllm_command(args.vllm_python, argv)
        return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=vllm_env()).returncode


def vllm_command(python: str, argv: list[str]) -> list[str]:
    return [python, __file__, *argv]


def vllm_env() -> dict:
    """vLLM's Python must not see draftsmith's PYTHONPATH. Its AOT compile cache is off unless asked for: vLLM-cpu
    0.32 fails to load an entry another worker saved for the same model (`'function' object has no attribute
    'finalize_loading'`), recompiles, and dies of a stack overflow; the inductor cache still serves warm starts."""
    return os.environ | {"PYTHONPATH": "", "VLLM_USE_AOT_COMPILE": os.environ.get("VLLM_USE_AOT_COMPILE", "0")}


SPIN_S = 1.5  # vLLM's worker busy-polls its shm queue (SpinCondition, busy_loop_s=1) for a second after each step


class VllmServer:
    """The parent's end of vllm_server: a vLLM engine kept alive in its own environment, one prompt a request.
    Each call returns only once vLLM's worker has gone idle (SPIN_S): a process timed right after it (another
    engine, interleaved) does not share the CPU with its spin."""

    def __init__(self, python: str, job: dict, work: Path, name: str, env: dict | None = None) -> None:
        work.mkdir(parents=True, exist_ok=True)
        job_file, self.log = work / f"job-{name}.json", work / f"vllm-{name}.log"
        job_file.write_text(json.dumps(job))
        with open(self.log, "w") as log:  # the child holds its own copy of the file
            self.proc = subprocess.Popen(
                vllm_command(python, ["--vllm-serve", str(job_file)]),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=vllm_env() | (env or {}),
                text=True,
            )
        ready = self.read()
        self.load_s, self.version = ready["load_s"], ready["vllm"]  # load_s: torch.compile included when compiled
        time.sleep(SPIN_S)

    def generate(self, ids: list[int], max_new: int, steps: bool = False) -> dict:
        """{"tokens", "seconds" (llm.generate alone), and the spec-decode counters' growth}; steps=True: what
        each verification step accepted instead (vllm_server's `stepped`)."""
        self.proc.stdin.write(json.dumps({"ids": ids, "max_new_tokens": max_new, "steps": steps}) + "\n")
        self.proc.stdin.flush()
        reply = self.read()
        time.sleep(SPIN_S)
        return reply

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            tail = "\n".join(self.log.read_text().splitlines()[-25:])
            raise RuntimeError(f"the vLLM worker exited ({code}); last lines of {self.log}:\n{tail}")
        return json.loads(line)

    def close(self) -> None:
        with contextlib.suppress(BrokenPipeError):  # a worker already gone leaves its unsent request unflushable
            self.proc.stdin.close()  # the worker's loop ends at end of input
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def vllm_tau(counters: dict, before: dict | None = None) -> tuple[float, int]:
    """τ from the counters, or from their growth since `before`."""
    before = before or {}
    grown = {k: counters.get(k, 0) - before.get(k, 0) for k in SPEC_COUNTERS}
    drafts, accepted = grown["vllm:spec_decode_num_drafts"], grown["vllm:spec_decode_num_accepted_tokens"]
    return (1.0 + accepted / drafts if drafts else float("nan")), int(drafts)


SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens")  # vllm_tau's


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
    target: object
    tcfg: object
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
    from bench_serve import free_port

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
    rows, before = [], {}
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
    p.add_argument("--vllm-job", help=argparse.SUPPRESS)
    p.add_argument("--vllm-serve", help=argparse.SUPPRESS)
    p.add_argument("--arctic-job", help=argparse.SUPPRESS)
    p.add_argument("--vllm-out", help=argparse.SUPPRESS)
    p.add_argument("--speculators-check", help=argparse.SUPPRESS)
    p.add_argument("--dspark-load-check", help=argparse.SUPPRESS)
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
    elif cli.vllm_serve:
        vllm_server(Path(cli.vllm_serve))
    elif cli.dspark_load_check:
        dspark_load_check(Path(cli.dspark_load_check))
    elif cli.speculators_check:
        speculators_check(Path(cli.speculators_check))
    elif cli.arctic_job:
        arctic_worker(Path(cli.arctic_job), Path(cli.vllm_out))
    else:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("WANDB_MODE", "offline")
        main(cli)
