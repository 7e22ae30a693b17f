"""Plain decoding vs one speculative method on the same prompts, interleaved, with a lossless check."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from draftsmith.serve.build import SpecConfig, build_engine, encode_chat, encode_raw, load
from draftsmith.serve.engine import Engine
from draftsmith.serve.metrics import Metrics
from draftsmith.serve.sampling import SamplingParams
from draftsmith.serve.target import TargetConfig

from .prompts import Prompt, load_prompts
from .suites import mt_bench

SUITES = {"mt_bench": mt_bench}


@dataclass
class EvalConfig:
    out: str
    prompts: str | None = None  # a prompts file (DESIGN.md format) ...
    suite: str | None = None  # ... or a packaged suite: mt_bench
    target: TargetConfig = field(default_factory=TargetConfig)
    spec: SpecConfig = field(default_factory=lambda: SpecConfig("ngram", 5))
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    prefix_cache: bool = True
    max_seq_len: int = 4096
    limit: int | None = None
    warmup: int = 1


@dataclass
class Turn:
    id: str
    turn: int
    method: str
    output_ids: list[int]
    text: str


def run_eval(cfg: EvalConfig) -> dict:
    sampling = SamplingParams(cfg.temperature, cfg.top_p, cfg.top_k, cfg.seed)
    if cfg.spec.name == "ar":
        raise ValueError("eval compares a method against plain decoding (ar): pick spec=ngram|draft|layerskip")
    prompts = pick_prompts(cfg)
    target = load(cfg.target)
    check_first_turns_fit(prompts, target.tokenizer, cfg)
    engines = {
        "ar": build_engine(target, SpecConfig("ar"), cfg.prefix_cache, cfg.max_seq_len),
        cfg.spec.name: build_engine(target, cfg.spec, cfg.prefix_cache, cfg.max_seq_len),
    }
    warm_up(engines, prompts[0], target.tokenizer, cfg)
    totals = {name: Metrics(requests=0) for name in engines}
    turns: list[Turn] = []
    for i, prompt in enumerate(tqdm(prompts, desc=f"eval ar vs {cfg.spec.name}", unit="prompt")):
        order = list(engines) if i % 2 == 0 else list(reversed(engines))  # neither side always goes first
        for name in order:
            turns += answer(engines[name], name, prompt, target.tokenizer, cfg, sampling, totals[name], seed=i)
    results = summarize(cfg, target.target_id, engines, totals, turns)
    write_outputs(Path(cfg.out), turns, results)
    return results


def pick_prompts(cfg: EvalConfig) -> list[Prompt]:
    if bool(cfg.prompts) == bool(cfg.suite):
        raise ValueError(f"give exactly one of prompts=FILE.jsonl or suite=({', '.join(SUITES)})")
    if cfg.prompts:
        return load_prompts(cfg.prompts, cfg.limit)
    if cfg.suite not in SUITES:
        raise ValueError(f"unknown suite {cfg.suite!r}; available: {', '.join(SUITES)}")
    return SUITES[cfg.suite](cfg.limit)


def answer(
    engine: Engine,
    method: str,
    prompt: Prompt,
    tokenizer,
    cfg: EvalConfig,
    sp: SamplingParams,
    total: Metrics,
    seed: int,
) -> list[Turn]:
    """All turns of one prompt, each answer fed back as the assistant message (as MT-bench does)."""
    messages: list[dict] = []
    out = []
    for t, user in enumerate(prompt.turns):
        messages.append({"role": "user", "content": user})
        ids = encode_turn(tokenizer, prompt, messages)
        g = engine.generate(ids, cfg.max_new_tokens, SamplingParams(sp.temperature, sp.top_p, sp.top_k, seed * 100 + t))
        text = tokenizer.decode(g.output_ids, skip_special_tokens=True)
        messages.append({"role": "assistant", "content": text})
        total.merge(g.metrics)
        out.append(Turn(prompt.id, t, method, g.output_ids, text))
    return out


def encode_turn(tokenizer, prompt: Prompt, messages: list[dict]) -> list[int]:
    """The conversation so far through the chat template, or a raw prompt as is."""
    return encode_raw(tokenizer, prompt.turns[0]) if prompt.raw else encode_chat(tokenizer, messages)


def first_turn_ids(tokenizer, prompt: Prompt) -> list[int]:
    return encode_turn(tokenizer, prompt, [{"role": "user", "content": prompt.turns[0]}])


def check_first_turns_fit(prompts: list[Prompt], tokenizer, cfg: EvalConfig) -> None:
    """Refuse a too-long prompt before any generation runs."""
    for p in prompts:
        ids = first_turn_ids(tokenizer, p)
        if len(ids) + cfg.max_new_tokens > cfg.max_seq_len:
            raise ValueError(
                f"prompt {p.id!r} has {len(ids)} tokens; with max_new_tokens={cfg.max_new_tokens} it exceeds "
                f"max_seq_len={cfg.max_seq_len}: shorten it, lower max_new_tokens or raise max_seq_len"
            )


def warm_up(engines: dict[str, Engine], prompt: Prompt, tokenizer, cfg: EvalConfig) -> None:
    ids = first_turn_ids(tokenizer, prompt)
    for engine in engines.values():
        for _ in range(cfg.warmup):
            engine.generate(ids, min(16, cfg.max_new_tokens), SamplingParams(cfg.temperature, seed=0))
        if engine.prefix_cache is not None:  # warm-up entries must not count as hits later
            engine.prefix_cache.reset()


def method_summary(name: str, m: Metrics) -> dict:
    return {
        "method": name,
        "tokens_per_s": m.tokens_per_s,
        "ttft_ms": 1000 * m.mean_ttft_s,
        "tpot_ms": 1000 * m.tpot_s,
        "new_tokens": m.new_tokens,
        "mean_acceptance_length": m.mean_acceptance_length,
        "acceptance_rate_per_position": m.acceptance_rate_per_position,
        "draft_acceptance_rate": m.draft_acceptance_rate,
        "drafts": m.drafts,
        "draft_tokens": m.draft_tokens,
        "accepted_tokens": m.accepted_tokens,
        "target_forward_passes": m.target_forward_passes,
        "requests": m.requests,
    }


def summarize(
    cfg: EvalConfig, target_id: str, engines: dict[str, Engine], totals: dict[str, Metrics], turns: list[Turn]
) -> dict:
    base, spec = totals["ar"], totals[cfg.spec.name]
    model = engines["ar"].model
    by_key = {(t.id, t.turn, t.method): t.output_ids for t in turns}
    pairs = [(by_key[(i, n, "ar")], ids) for (i, n, m), ids in by_key.items() if m == cfg.spec.name]
    greedy = cfg.temperature == 0
    spec_summary = method_summary(cfg.spec.name, spec)
    spec_summary["speedup"] = spec.tokens_per_s / base.tokens_per_s if base.tokens_per_s else 0.0
    queried = sum(e.prefix_cache.queried_tokens for e in engines.values() if e.prefix_cache is not None)
    hit = sum(e.prefix_cache.hit_tokens for e in engines.values() if e.prefix_cache is not None)
    return {
        "target": target_id,
        "device": str(model.device),
        "dtype": str(model.dtype).removeprefix("torch."),
        "prompts": len({t.id for t in turns}),
        "max_new_tokens": cfg.max_new_tokens,
        "temperature": cfg.temperature,
        "baseline": method_summary("ar", base),
        "spec": spec_summary,
        "lossless": {
            "checked": len(pairs) if greedy else 0,
            "identical": sum(a == b for a, b in pairs) if greedy else 0,
            "note": "greedy: token-for-token vs plain decoding" if greedy else "sampling: equality not expected",
        },
        "prefix_cache": {"enabled": cfg.prefix_cache, "queried_tokens": queried, "hit_tokens": hit},
        "config": {"spec": asdict(cfg.spec), "max_seq_len": cfg.max_seq_len, "seed": cfg.seed},
        "environment": environment(),
    }


def environment() -> dict:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            timeout=5,
        ).stdout.strip()
    except OSError:
        commit = ""
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "commit": commit,
    }


def write_outputs(out: Path, turns: list[Turn], results: dict) -> None:
    """outputs.jsonl and results.json, each written to a temp file and renamed into place."""
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "outputs.jsonl", "".join(json.dumps(asdict(t)) + "\n" for t in turns))
    atomic_write(out / "results.json", json.dumps(results, indent=2) + "\n")


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
