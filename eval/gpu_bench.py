"""Engine costs on a GPU, on random-weight models of real shapes built on the machine (no weights travel).

Cases (shape, dtype): SmolLM2-135M in bf16 and fp32, a Llama-3.1-8B shape in bf16 (initialised on the GPU).
Per case, each measured side by side in one run, interleaved, with repeats (median, and min-max):
  decode:   plain decoding tokens/s, the engine (cuda_graphs = graphs | eager | off) vs HF `generate` on the
            same weights (HF's LlamaForCausalLM shares the engine's tensors)
  verify:   one target forward over k rows (k = 1..64) after a fixed prefix, relative to k = 1 (a decode step)
  drafters: each drafter's cost per step (propose + accept) as a share of a plain decode step's target
            forward: EAGLE-1, EAGLE-3, Medusa, a small draft model (random heads of the real shapes from
            heads/), n-gram
Random weights make acceptance meaningless: only costs are measured. `--device cpu` runs the same code on
the small shape in fp32 with fewer tokens (the rehearsal). JSON and Markdown go to --out (default $OUT, else
runs/gpu_check), rewritten after every section, so a run cut short keeps what it measured.

    python -m draftsmith.eval.gpu_bench               # CUDA (run times: docs/benchmarks.md, Figures behind
                                                      # design choices)
    python -m draftsmith.eval.gpu_bench --device cpu  # the rehearsal

scripts/gpu_check.sh runs it on the GPU machine after the CUDA tests.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from draftsmith.cpu_kernels.packed import pack_linears  # noqa: E402
from draftsmith.heads.draft_model import DraftModel, DraftModelConfig  # noqa: E402
from draftsmith.heads.drafter_folder import cast_own  # noqa: E402
from draftsmith.heads.eagle import EagleHead  # noqa: E402
from draftsmith.heads.eagle3 import Eagle3Config, Eagle3Head  # noqa: E402
from draftsmith.heads.head_base import EagleConfig  # noqa: E402
from draftsmith.heads.medusa import MedusaConfig, MedusaHeads  # noqa: E402
from draftsmith.runtime.llama import ModelConfig, Transformer  # noqa: E402
from draftsmith.serve.engine.engine import Engine  # noqa: E402
from draftsmith.serve.engine.graphs import StaticStep, resolve_mode  # noqa: E402
from draftsmith.serve.engine.sampling import SamplingParams  # noqa: E402
from draftsmith.serve.engine.tree import (
    TreeConfig,  # noqa: E402
    causal_mask,  # noqa: E402
)
from draftsmith.serve.models.target import DTYPES, SHORT_NAMES  # noqa: E402
from draftsmith.serve.proposers.base import Proposer  # noqa: E402
from draftsmith.serve.proposers.propose_draft_model import DraftChainConfig, DraftModelProposer  # noqa: E402
from draftsmith.serve.proposers.propose_eagle import EagleProposer  # noqa: E402
from draftsmith.serve.proposers.propose_medusa import MedusaProposer  # noqa: E402
from draftsmith.serve.proposers.propose_ngram import NgramConfig, NgramProposer  # noqa: E402

from .timed_runs import Prompt, Run, TimedEngine, interleave, run_engine, run_hf  # noqa: E402

RANDOM_NOTE = "random weights: acceptance (tau) is meaningless here; only costs are measured"
BENCH_DTYPES = ("float32", "bfloat16")
SECTIONS = ("decode", "verify", "drafters")
KS = (1, 2, 4, 8, 16, 32, 64)


@dataclass
class Shape:
    hf: dict  # an HF config.json as a real checkpoint has it
    draft: dict  # heads.draft_model.DraftModelConfig of "a small draft model" for this target
    new_tokens: int  # per request on CUDA (CPU: --cpu-new-tokens)


SHAPES = {
    "smollm2-135m": Shape(
        hf=dict(
            model_type="llama",
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            head_dim=64,
            rms_norm_eps=1e-5,
            max_position_embeddings=8192,
            rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
            tie_word_embeddings=True,
            bos_token_id=1,
            eos_token_id=2,
        ),
        draft=dict(num_layers=2),  # conf/head/draft_model.yaml: 2 of the target's layers
        new_tokens=128,
    ),
    "llama-3.1-8b": Shape(
        hf=dict(
            model_type="llama",
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            rms_norm_eps=1e-5,
            max_position_embeddings=131072,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            tie_word_embeddings=False,
            bos_token_id=128000,
            eos_token_id=[128001, 128008, 128009],
        ),
        # the Llama-3.2-1B shape, Llama-3.1-8B's usual draft model
        draft=dict(
            num_layers=16,
            hidden_size=2048,
            intermediate_size=8192,
            num_attention_heads=32,
            num_key_value_heads=8,
            init="scratch",
        ),
        new_tokens=64,
    ),
}
CUDA_CASES = ["smollm2-135m:bfloat16", "llama-3.1-8b:bfloat16", "smollm2-135m:float32"]
CPU_CASES = ["smollm2-135m:float32"]


# ----------------------------------------------------------------------------- models


def random_target(hf: dict, dtype: torch.dtype, device: str, seed: int = 0) -> Transformer:
    """The runner of config `hf` with random weights made on the device in `dtype` (an 8B model never
    exists in fp32 or on the CPU), finished as serve/loader.load_model finishes a loaded one."""
    cfg = ModelConfig.from_hf(hf)
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to(dtype=dtype).to_empty(device=device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    gen = torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():  # HF's Llama init: N(0, 0.02) matrices; norms near 1 (never zeros)
            if p.dim() > 1:
                p.normal_(0.0, 0.02, generator=gen)
            else:
                p.normal_(1.0, 0.02, generator=gen)
    model.rope_cache(cfg.max_position_embeddings)
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    if device == "cpu":
        pack_linears(model)
    model.choose_path()
    return model


def hf_twin(model: Transformer, hf: dict):
    """HF's LlamaForCausalLM over the same tensors (no copy), rope built by HF from the same config."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{k: v for k, v in hf.items() if k != "model_type"})
    with torch.device("meta"):
        twin = LlamaForCausalLM(cfg)
    twin.load_state_dict(model.state_dict(), strict=True, assign=True)
    with torch.device(model.device):  # its `device` argument is gone in later transformers
        twin.model.rotary_emb = type(twin.model.rotary_emb)(cfg)
    meta = [n for n, t in [*twin.named_parameters(), *twin.named_buffers()] if t.is_meta]
    if meta:
        raise RuntimeError(f"HF twin left on the meta device: {meta[:3]}")
    return twin.eval().requires_grad_(False)


def parity(model: Transformer, twin, ids: list[int]) -> dict:
    """Do the two compute the same function? Relative logit error and argmax agreement over a prompt."""
    x = torch.tensor(ids, device=model.device)
    with torch.inference_mode():
        ours = model(x, torch.arange(len(ids), device=x.device), model.new_cache(len(ids)), 0).logits
        ref = twin(x[None]).logits[0].float()
    rel = float((ours - ref).norm() / ref.norm())
    agree = float((ours.argmax(-1) == ref.argmax(-1)).float().mean())
    return {"rel_logit_error": rel, "argmax_agreement": agree, "tokens": len(ids)}


def on_device(build: Callable, target: Transformer):
    """A drafter module built on the target's device, its own weights cast to the target's dtype, frozen."""
    with torch.device(target.device):
        head = build()
    head = cast_own(head, target.dtype).eval().requires_grad_(False)
    if target.device.type == "cpu":
        pack_linears(head)
    return head


def medusa_heads(target: Transformer) -> MedusaHeads:
    c = target.config
    heads = MedusaHeads(MedusaConfig(c.hidden_size, c.vocab_size, num_heads=4, num_layers=1), target)
    with torch.no_grad():  # fresh ResBlocks are zeros (the identity): give them random weights to time
        for block in heads.blocks:
            for layer in cast(Iterable[nn.Linear], block.layers):
                layer.weight.normal_(0.0, 0.02)
                layer.bias.normal_(0.0, 0.02)
    return heads


def proposers(target: Transformer, shape: Shape) -> dict[str, Proposer]:
    """Each drafter kind with random weights of the real shapes, drafting as conf/spec/*.yaml sets it."""
    c = target.config
    eagle = on_device(lambda: EagleHead(EagleConfig.from_target(c), target), target)
    eagle3 = on_device(lambda: Eagle3Head(Eagle3Config.from_target(c), target), target)
    medusa = on_device(lambda: medusa_heads(target), target)
    draft = on_device(lambda: DraftModel(DraftModelConfig(**shape.draft), target), target)
    draft.choose_path()  # as serve/drafters.py finishes a loaded draft model
    return {
        "EAGLE-1 chain 4": EagleProposer(eagle, "eagle", 4, TreeConfig(topk=1)),
        "EAGLE-3 tree 5x4/12": EagleProposer(eagle3, "eagle3", 5, TreeConfig(topk=4, total_tokens=12)),
        "Medusa 4 heads": MedusaProposer(medusa, None, 4),
        f"draft model {draft.config.num_hidden_layers}L/{draft.config.hidden_size} chain 4": DraftModelProposer(
            draft, DraftChainConfig(4)
        ),
        "n-gram chain 4": NgramProposer(NgramConfig(num_tokens=4)),
    }


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[Prompt]:
    """Random token prompts, each a random segment said four times (so n-gram lookup finds matches)."""
    out = []
    for i in range(n):
        g = torch.Generator().manual_seed(seed + i)
        seg = torch.randint(0, vocab, (max(length // 4, 1),), generator=g).tolist()
        out.append(Prompt(f"p{i}", (seg * 4)[:length]))
    return out


# ----------------------------------------------------------------------------- timing


def run_plain(engine: Engine, ids: list[int], max_new: int) -> Run:
    """A request on an untimed engine (no extra syncs inside the step)."""
    g = engine.generate(ids, max_new, SamplingParams())
    return Run(g.output_ids, g.metrics.total_s, g.metrics.ttft_s, g.metrics)


def run_hf_timed(twin, ids: list[int], max_new: int, pad: int) -> Run:
    """HF generate, with its time to first token from a 1-token generate just before (HF reports none)."""
    first = run_hf(twin, ids, 1, pad).total_s
    run = run_hf(twin, ids, max_new, pad)
    run.ttft_s = first
    return run


def summary_stats(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def per_repeat_tps(runs: list[list[Run]]) -> list[float]:
    """Tokens/s of each repeat over all prompts (runs[prompt][repeat])."""
    repeats = len(runs[0])
    return [sum(len(p[r].tokens) for p in runs) / sum(p[r].total_s for p in runs) for r in range(repeats)]


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def timed_forward(engine: Engine, k: int, start: int) -> float:
    """Seconds of one engine forward over k new rows at slot `start` (a chain's mask), synced both ends."""
    dev = engine.model.device
    tokens = torch.randint(0, engine.model.config.vocab_size, (k,), device=dev)
    positions = torch.arange(start, start + k, device=dev)
    mask = causal_mask(start, k, dev)
    engine.sync()
    begin = time.perf_counter()
    engine.forward(tokens, positions, start, mask)
    engine.sync()
    return time.perf_counter() - begin


def prefilled(model: Transformer, mode: str, prefix: int, max_seq_len: int) -> Engine:
    engine = Engine(model, max_seq_len=max_seq_len, cuda_graphs=mode)
    ids = torch.randint(0, model.config.vocab_size, (prefix,), device=model.device)
    engine.forward(ids, torch.arange(prefix, device=model.device), 0, None, logit_rows=slice(-1, None))
    return engine


# ----------------------------------------------------------------------------- sections


def static_state(engine: Engine) -> str:
    """What the decode/verify step ran as: graphs (and the step sizes captured), eager (static shapes) or off.
    A failed capture falls back to eager with a warning: this shows it."""
    st = cast("StaticStep | None", engine.static)  # the modes run here (graphs, eager, off) make no CompiledStep
    if st is None:
        return "off"
    return f"graphs n={sorted(st.graphs)}" if st.mode == "graphs" else st.mode


def decode_summary(runs: list[list[Run]], base: list[list[Run]]) -> dict:
    return {
        "tokens_per_s": summary_stats(per_repeat_tps(runs)),
        "tpot_ms": statistics.median(1000 * (r.total_s - r.ttft_s) / (len(r.tokens) - 1) for p in runs for r in p),
        "ttft_ms": statistics.median(1000 * r.ttft_s for p in runs for r in p),
        "new_tokens": len(runs[0][0].tokens),
        "first_divergence_vs_off": [
            first_divergence(p[0].tokens, b[0].tokens) for p, b in zip(runs, base, strict=True)
        ],
    }


def decode_section(args, model, twin, plist: list[Prompt], new: int) -> dict:
    pad = model.config.eos_token_ids[0] if model.config.eos_token_ids else 0
    engines = {f"ours {m}": Engine(model, max_seq_len=args.max_seq_len, cuda_graphs=m) for m in args.modes}
    variants: list[tuple[str, Callable[..., Run]]] = [
        (name, lambda ids, n, e=e: run_plain(e, ids, n)) for name, e in engines.items()
    ]
    variants.append(("HF generate", lambda ids, n: run_hf_timed(twin, ids, n, pad)))
    res = interleave("decode", variants, plist, args.repeats, new, args.warmup)
    base = res.runs[f"ours {args.modes[-1]}"]
    out = {name: decode_summary(runs, base) for name, runs in res.runs.items()}
    hf = out["HF generate"]["tokens_per_s"]["median"]
    for name, v in out.items():
        v["x_vs_hf"] = v["tokens_per_s"]["median"] / hf
        v["step"] = static_state(engines[name]) if name in engines else f"HF {twin.config._attn_implementation}"
    return out


def verify_section(args, model) -> dict:
    """Per mode and k: median seconds of a k-row forward; rounds interleave modes and alternate the k order."""
    times: dict[str, dict[int, list[float]]] = {m: {k: [] for k in args.ks} for m in args.modes}
    with torch.inference_mode():
        engines = {m: prefilled(model, m, args.prefix, args.max_seq_len) for m in args.modes}
        for e in engines.values():  # capture (graphs) and warm every shape first
            for k in args.ks:
                timed_forward(e, k, args.prefix)
        for r in range(args.verify_rounds):
            for k in args.ks if r % 2 == 0 else args.ks[::-1]:
                for m in args.modes if r % 2 == 0 else args.modes[::-1]:
                    times[m][k] += [timed_forward(engines[m], k, args.prefix) for _ in range(args.verify_calls)]
        print(f"  verify: {args.verify_rounds} rounds x {args.verify_calls} calls per (mode, k)", flush=True)
    by_mode = {m: {str(k): timing(ts, statistics.median(times[m][1])) for k, ts in times[m].items()} for m in times}
    return {"prefix": args.prefix, "modes": by_mode, "ran_as": {m: static_state(e) for m, e in engines.items()}}


def timing(ts: list[float], one: float) -> dict:
    return {"ms": 1000 * statistics.median(ts), "min_ms": 1000 * min(ts), "x_decode_step": statistics.median(ts) / one}


def drafter_section(args, model, shape: Shape, plist: list[Prompt], new: int) -> dict:
    mode = resolve_mode("auto", model)  # graphs on a GPU, the compiled step on a CPU
    engines = {"plain (no drafter)": TimedEngine(model, max_seq_len=args.max_seq_len, cuda_graphs=mode)}
    for name, prop in proposers(model, shape).items():
        engines[name] = TimedEngine(model, proposer=prop, max_seq_len=args.max_seq_len, cuda_graphs=mode)
    variants: list[tuple[str, Callable[..., Run]]] = [
        (name, lambda ids, n, e=e: run_engine(e, ids, n, ())) for name, e in engines.items()
    ]
    res = interleave("drafters", variants, plist, args.repeats, new, args.warmup)
    flat = {name: [r for p in runs for r in p] for name, runs in res.runs.items()}
    step_target = statistics.median(r.target_s / r.steps for r in flat["plain (no drafter)"])
    out = {"mode": mode, "target_step_ms": 1000 * step_target}
    for name, runs in flat.items():
        draft = statistics.median(r.proposer_s / r.steps for r in runs)
        verify = statistics.median(r.target_s / r.steps for r in runs)
        step = statistics.median(r.step_s / r.steps for r in runs)
        used = engines[name].proposer
        out[name] = {
            "tree_size": used.max_tree_size if used else 0,
            "draft_ms": 1000 * draft,
            "draft_share_of_target_step": draft / step_target,
            "verify_ms": 1000 * verify,
            "verify_x_target_step": verify / step_target,
            "step_ms": 1000 * step,
            "overhead_ms": 1000 * (step - draft - verify),
            "steps": sum(r.steps for r in runs),
            "tau_meaningless": statistics.median(r.metrics.mean_acceptance_length for r in runs),
            "step": static_state(engines[name]),
        }
    return out


# ----------------------------------------------------------------------------- report


def cell(x) -> str:
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 10 else f"{x:.1f}"
    return "-" if x is None else str(x)


def md_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    return "\n".join(lines + ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows])


def decode_md(decode: dict) -> list[str]:
    rows = [
        [v, d["tokens_per_s"]["median"], f"{d['tokens_per_s']['min']:.1f}-{d['tokens_per_s']['max']:.1f}"]
        + [d["tpot_ms"], d["ttft_ms"], d["x_vs_hf"], d["first_divergence_vs_off"], d["step"]]
        for v, d in decode.items()
    ]
    heads = ["variant", "tok/s", "range", "TPOT ms", "TTFT ms", "x HF", "1st diff vs off", "ran as"]
    return ["\nPlain decoding, batch 1, greedy (tok/s: median over repeats, range min-max):\n", md_table(heads, rows)]


def verify_md(verify: dict) -> list[str]:
    by_mode = verify["modes"]
    modes, fast = list(by_mode), next(iter(by_mode))
    rows = [
        [int(k)]
        + [by_mode[m][k][f] for m in modes for f in ("ms", "x_decode_step")]
        + [by_mode["off"][k]["ms"] / by_mode[fast][k]["ms"]]
        for k in by_mode[fast]
    ]
    heads = ["k rows"] + [f"{m} {f}" for m in modes for f in ("ms", "x k=1")] + [f"off / {fast}"]
    ran = ", ".join(f"{m}: {how}" for m, how in verify["ran_as"].items())
    title = (
        f"\nOne target forward over k rows after {verify['prefix']} cached tokens (verifying k-1 drafts), median ms; "
        f"x k=1 within each mode (ran as {ran}):\n"
    )
    return [title, md_table(heads, rows)]


def drafters_md(d: dict) -> list[str]:
    rows = [
        [n, v["tree_size"], v["draft_ms"], v["draft_share_of_target_step"], v["verify_ms"]]
        + [v["verify_x_target_step"], v["overhead_ms"], v["step"]]
        for n, v in d.items()
        if isinstance(v, dict)
    ]
    heads = ["drafter", "tree", "draft ms", "draft / target step", "verify ms", "verify / target step", "other ms"]
    heads += ["ran as"]
    title = (
        f"\nDraft cost per step (propose + accept; median per step), cuda_graphs={d['mode']}, target step "
        f"{d['target_step_ms']:.3f} ms; {RANDOM_NOTE}:\n"
    )
    return [title, md_table(heads, rows)]


def case_markdown(name: str, case: dict) -> str:
    out = [f"\n### {name}\n", f"build {case.get('build_s', 0):.1f} s; HF twin parity: {case.get('parity')}"]
    for section, md in (("decode", decode_md), ("verify", verify_md), ("drafters", drafters_md)):
        if section in case:
            out += md(case[section])
    out += [f"\n{s}: skipped ({why})" for s, why in case.get("skipped", {}).items()]
    out += [f"\n**{s}: failed** ({why})" for s, why in case.get("errors", {}).items()]
    return "\n".join(out)


def write(out_dir: Path, summary: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_bench.json").write_text(json.dumps(summary, indent=1, default=str))
    env = summary["env"]
    head = [
        "## draftsmith gpu_bench",
        f"\n{env['device_name']}, torch {env['torch']} (CUDA {env['cuda']}), transformers {env['transformers']}, "
        f"Python {env['python']}. **{RANDOM_NOTE}.** Elapsed {summary['elapsed_s']:.0f} s.",
    ]
    body = [case_markdown(n, c) for n, c in summary["cases"].items()]
    (out_dir / "gpu_bench.md").write_text("\n".join(head + body) + "\n")


# ----------------------------------------------------------------------------- main


def csv(kind):
    return lambda s: [kind(x) for x in s.split(",") if x]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--out", default=os.environ.get("OUT") or "runs/gpu_check", help="folder for JSON + Markdown")
    p.add_argument("--cases", type=csv(str), default=None, help="shape:dtype list (default per device)")
    p.add_argument("--sections", type=csv(str), default=list(SECTIONS), help=f"subset of {','.join(SECTIONS)}")
    p.add_argument("--prompts", type=int, default=None, help="prompts per case (default: cuda 2, cpu 1)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default: cuda 128, cpu 32)")
    p.add_argument("--new-tokens", type=int, default=None, help="new tokens per request (default: per shape; cpu 12)")
    p.add_argument("--repeats", type=int, default=None, help="interleaved repeats (default: cuda 3, cpu 2)")
    p.add_argument("--warmup", type=int, default=8, help="new tokens of each variant's warm-up request")
    p.add_argument("--ks", type=csv(int), default=list(KS), help="verify rows")
    p.add_argument("--prefix", type=int, default=None, help="cached tokens before the verify rows (cuda 256, cpu 32)")
    p.add_argument("--verify-rounds", type=int, default=None, help="interleaved rounds (cuda 5, cpu 2)")
    p.add_argument("--verify-calls", type=int, default=None, help="calls per (mode, k) per round (cuda 10, cpu 1)")
    p.add_argument("--max-seq-len", type=int, default=512, help="engine KV slots (static steps attend over all)")
    p.add_argument("--budget-s", type=float, default=None, help="skip later sections past this (cuda 270, cpu 900)")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    defaults = dict(
        prompts=(2, 1),
        prompt_len=(128, 32),
        repeats=(3, 2),
        prefix=(256, 32),
        verify_rounds=(5, 2),
        verify_calls=(10, 1),
        budget_s=(270, 900),
        cases=(CUDA_CASES, CPU_CASES),
    )
    for k, (gpu, cpu) in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, gpu if cuda else cpu)
    args.modes = ["graphs", "eager", "off"] if cuda else ["eager", "off"]
    bad = [s for s in args.sections if s not in SECTIONS]
    if bad:
        p.error(f"unknown sections {bad}; choose from {','.join(SECTIONS)}")
    for c in args.cases:
        shape, _, dtype = c.partition(":")
        if shape not in SHAPES or dtype not in BENCH_DTYPES:
            p.error(f"bad case {c!r}: use SHAPE:DTYPE with SHAPE in {', '.join(SHAPES)}, DTYPE float32 or bfloat16")
    if 1 not in args.ks:
        p.error("--ks must include 1: every k is reported relative to a 1-row decode step")
    if args.prefix + max(args.ks) > args.max_seq_len:
        p.error(f"--prefix {args.prefix} + {max(args.ks)} verify rows exceed --max-seq-len {args.max_seq_len}")
    if cuda and not torch.cuda.is_available():
        p.error("no CUDA device: run with --device cpu")
    return args


def bench_environment(args) -> dict:
    import transformers

    cuda = args.device == "cuda"
    return {
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if cuda else (platform.processor() or platform.machine()),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "note": RANDOM_NOTE,
    }


def case_key(name: str) -> str:
    """'smollm2-135m:bfloat16' -> 'smollm2-135m bf16'."""
    shape, _, dtype = name.partition(":")
    return f"{shape} {SHORT_NAMES[dtype]}"


def run_case(args, name: str, summary: dict, out_dir: Path, start: float) -> None:
    shape_name, _, dtype_name = name.partition(":")
    shape, dtype, key = SHAPES[shape_name], DTYPES[dtype_name], case_key(name)
    case: dict[str, Any] = {"skipped": {}}
    summary["cases"][key] = case
    new = args.new_tokens or (shape.new_tokens if args.device == "cuda" else 12)
    t = time.perf_counter()
    print(f"\n== {key}: building random weights on {args.device}", flush=True)
    model = random_target(shape.hf, dtype, args.device)
    twin = hf_twin(model, shape.hf)
    plist = prompts(args.prompts, args.prompt_len, shape.hf["vocab_size"])
    case["parity"] = parity(model, twin, plist[0].ids[:32])
    case["build_s"] = time.perf_counter() - t
    print(f"  built in {case['build_s']:.1f} s; parity vs HF {case['parity']}", flush=True)
    sections = {
        "decode": lambda: decode_section(args, model, twin, plist, new),
        "verify": lambda: verify_section(args, model),
        "drafters": lambda: drafter_section(args, model, shape, plist, new),
    }
    for s in args.sections:
        if time.perf_counter() - start > args.budget_s:
            case["skipped"][s] = f"past the {args.budget_s:.0f} s budget"
            continue
        t = time.perf_counter()
        try:  # one device call per session: a failing section must not cost the others their numbers
            case[s] = sections[s]()
        except Exception as e:
            traceback.print_exc()
            case.setdefault("errors", {})[s] = f"{type(e).__name__}: {e}"
        case[f"{s}_s"] = time.perf_counter() - t
        print(f"  {s}: {case[f'{s}_s']:.1f} s", flush=True)
        summary["elapsed_s"] = time.perf_counter() - start
        write(out_dir, summary)
    if args.device == "cuda":
        case["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    import transformers

    transformers.logging.set_verbosity_error()
    start, out_dir = time.perf_counter(), Path(args.out)
    summary: dict[str, Any] = {"env": bench_environment(args), "args": vars(args), "cases": {}, "elapsed_s": 0.0}
    print(f"gpu_bench on {summary['env']['device_name']}: {RANDOM_NOTE}", flush=True)
    for name in args.cases:
        if time.perf_counter() - start > args.budget_s:
            summary["cases"][case_key(name)] = {"skipped": {"all": f"past the {args.budget_s:.0f} s budget"}}
            continue
        try:
            run_case(args, name, summary, out_dir, start)
        except Exception as e:  # e.g. out of memory building a shape: the next case may still fit
            traceback.print_exc()
            case = summary["cases"].setdefault(case_key(name), {})
            case.setdefault("errors", {})["case"] = f"{type(e).__name__}: {e}"
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    summary["elapsed_s"] = time.perf_counter() - start
    write(out_dir, summary)
    print((out_dir / "gpu_bench.md").read_text())
    print(f"JSON and Markdown: {out_dir}", file=sys.stderr)
    failed = [f"{c} {s}" for c, case in summary["cases"].items() for s in case.get("errors", {})]
    if failed:
        sys.exit(f"gpu_bench: failed: {', '.join(failed)} (tracebacks above; errors in the JSON)")


if __name__ == "__main__":
    main()
