"""Plain decoding vs one or more speculative methods on the same prompts: interleaved, repeated, after a
warm-up; records every answered turn, then aggregates and writes DIR/results.json, outputs.jsonl, per_prompt.jsonl.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from draftsmith.serve.build import SpecConfig, build_engine, encode_chat, encode_raw, load
from draftsmith.serve.engine import Engine
from draftsmith.serve.sampling import SamplingParams
from draftsmith.serve.target import TargetConfig
from draftsmith.train.log import WandbConfig

from .aggregate import Record, by_category, by_prompt, compared, lossless, method_summary, of, pool, speedup_per_repeat
from .distribution import distribution_check
from .methods import drafter_params, resolve_methods
from .prompts import Prompt, load_prompts
from .study import STUDIES, study_arms, study_cells
from .suites import SUITES, SuiteConfig, load_suite

Arm = tuple[str, bool]  # (method label or "ar", prefix cache on)


@dataclass
class EvalConfig:
    out: str
    prompts: str | None = None  # a prompts file (DESIGN.md format) ...
    suite: SuiteConfig | None = None  # ... or a packaged suite (hydra group `suite`)
    target: TargetConfig = field(default_factory=TargetConfig)
    spec: SpecConfig = field(default_factory=lambda: SpecConfig("ngram", 5))
    methods: dict[str, SpecConfig] = field(default_factory=dict)  # more methods, by label (hydra group `methods`)
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    prefix_cache: bool = True
    max_seq_len: int = 4096
    cuda_graphs: str = "auto"  # serve/graphs.py: auto | graphs | eager | off
    limit: int | None = None
    warmup: int = 1
    repeats: int = 1
    study: str | None = None  # prefix_x_spec: the 2x2 of prefix cache off/on x plain/first method
    wandb: WandbConfig = field(default_factory=WandbConfig)


def run_eval(cfg: EvalConfig) -> dict:
    """Everything a user can get wrong is checked before any prompt runs; nothing is written before the end."""
    check_settings(cfg)
    SamplingParams(cfg.temperature, cfg.top_p, cfg.top_k, cfg.seed)  # validates them
    methods = resolve_methods(cfg.spec, cfg.methods)
    prompts = pick_prompts(cfg)
    target = load(cfg.target)
    engines = {
        arm: build_engine(target, spec_of(arm, methods), arm[1], cfg.max_seq_len, cfg.cuda_graphs)
        for arm in arms(cfg, methods)
    }
    check_first_turns_fit(prompts, target.tokenizer, cfg, min(e.max_seq_len for e in engines.values()))
    warm_up(engines, prompts[0], target.tokenizer, cfg)
    records, partial = run_all(engines, prompts, target.tokenizer, cfg)
    results = summarize(cfg, target.target_id, engines[("ar", cfg.prefix_cache)], methods, records, partial)
    main = [r for r in records if r.prefix_cache == cfg.prefix_cache]
    write_outputs(Path(cfg.out), main, by_prompt(main, list(methods), cfg.temperature == 0), results)
    return results


def check_settings(cfg: EvalConfig) -> None:
    if cfg.repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {cfg.repeats}")
    if cfg.warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {cfg.warmup}")
    if cfg.study is not None and cfg.study not in STUDIES:
        raise ValueError(f"unknown study {cfg.study!r}; available: {', '.join(STUDIES)}")


def pick_prompts(cfg: EvalConfig) -> list[Prompt]:
    if bool(cfg.prompts) == bool(cfg.suite):
        raise ValueError(f"give exactly one of prompts=FILE.jsonl or suite=({', '.join(SUITES)})")
    if cfg.prompts:
        return load_prompts(cfg.prompts, cfg.limit)
    return load_suite(cfg.suite, cfg.limit)


def arms(cfg: EvalConfig, methods: dict[str, SpecConfig]) -> list[Arm]:
    """Plain decoding and each method with the configured cache; a study adds its cells with the cache flipped."""
    out = [("ar", cfg.prefix_cache)] + [(label, cfg.prefix_cache) for label in methods]
    if cfg.study:
        out += [a for a in study_arms(next(iter(methods))) if a not in out]
    return out


def spec_of(arm: Arm, methods: dict[str, SpecConfig]) -> SpecConfig:
    return SpecConfig("ar") if arm[0] == "ar" else methods[arm[0]]


def run_all(engines: dict[Arm, Engine], prompts: list[Prompt], tokenizer, cfg: EvalConfig) -> tuple[list, bool]:
    """Every prompt through every arm, arm order rotating per prompt so none always runs first. On Ctrl-C the
    prompts finished by every arm are kept and the run is marked partial."""
    order, records, done = list(engines), [], set()
    names = ", ".join(dict.fromkeys(a[0] for a in order if a[0] != "ar"))
    bar = tqdm(total=cfg.repeats * len(prompts), desc=f"eval ar vs {names}", unit="prompt")
    try:
        for rep in range(cfg.repeats):
            for engine in engines.values():  # each repeat starts cold, so repeats measure the same thing
                reset_prefix_cache(engine)
            for i, prompt in enumerate(prompts):
                k = (i + rep) % len(order)
                for arm in order[k:] + order[:k]:
                    records += answer(engines[arm], arm, prompt, tokenizer, cfg, rep, i)
                done.add((prompt.id, rep))
                bar.update()
    except KeyboardInterrupt:
        if not done:
            raise
        return [r for r in records if (r.id, r.repeat) in done], True
    finally:
        bar.close()
    return records, False


def seed_for(cfg: EvalConfig, arm: Arm, rep: int, i: int, turn: int) -> int:
    """Independent seeds per arm, repeat, prompt and turn: plain and spec samples must not be coupled, or the
    distribution check's exchangeability breaks."""
    return zlib.crc32(f"{cfg.seed}|{arm}|{rep}|{i}|{turn}".encode())


def answer(engine: Engine, arm: Arm, prompt: Prompt, tokenizer, cfg: EvalConfig, rep: int, i: int) -> list[Record]:
    """All turns of one prompt, each answer fed back as the assistant message (as MT-bench does)."""
    messages: list[dict] = []
    out = []
    for t, user in enumerate(prompt.turns):
        messages.append({"role": "user", "content": user})
        ids = encode_turn(tokenizer, prompt, messages)
        sp = SamplingParams(cfg.temperature, cfg.top_p, cfg.top_k, seed_for(cfg, arm, rep, i, t))
        g = engine.generate(ids, cfg.max_new_tokens, sp)
        text = tokenizer.decode(g.output_ids, skip_special_tokens=True)
        messages.append({"role": "assistant", "content": text})
        out.append(Record(prompt.id, prompt.category, t, rep, arm[0], arm[1], g.output_ids, text, g.metrics))
    return out


def encode_turn(tokenizer, prompt: Prompt, messages: list[dict]) -> list[int]:
    """The conversation so far through the chat template, or a raw prompt as is."""
    return encode_raw(tokenizer, prompt.turns[0]) if prompt.raw else encode_chat(tokenizer, messages)


def first_turn_ids(tokenizer, prompt: Prompt) -> list[int]:
    return encode_turn(tokenizer, prompt, [{"role": "user", "content": prompt.turns[0]}])


def check_first_turns_fit(prompts: list[Prompt], tokenizer, cfg: EvalConfig, room: int) -> None:
    """Refuse a too-long prompt before any generation runs; room: the engines' context (max_seq_len, capped by
    what the model allows)."""
    for p in prompts:
        ids = first_turn_ids(tokenizer, p)
        if len(ids) + cfg.max_new_tokens > room:
            raise ValueError(
                f"prompt {p.id!r} has {len(ids)} tokens; with max_new_tokens={cfg.max_new_tokens} it exceeds "
                f"max_seq_len={cfg.max_seq_len} (the engines allow {room}): shorten it, lower max_new_tokens or "
                "raise max_seq_len"
            )


def warm_up(engines: dict[Arm, Engine], prompt: Prompt, tokenizer, cfg: EvalConfig) -> None:
    ids = first_turn_ids(tokenizer, prompt)
    for engine in engines.values():
        for _ in range(cfg.warmup):
            engine.generate(ids, min(16, cfg.max_new_tokens), SamplingParams(cfg.temperature, seed=0))
        if engine.proposer:  # the warm-up's answer must not help the first prompt (suffix decoding's global tree)
            engine.proposer.forget()


def reset_prefix_cache(engine: Engine) -> None:
    if engine.prefix_cache is not None:  # warm-up and earlier repeats must not count as hits
        engine.prefix_cache.reset()


def method_result(label: str, spec: SpecConfig, main: list[Record], cfg: EvalConfig) -> dict:
    base, mine = of(main, "ar"), of(main, label)
    greedy = cfg.temperature == 0
    out = compared(label, mine, base)
    rates = out["acceptance_rate_per_position"]
    if out["drafts"]:  # depths never accepted still count: their rate is 0
        out["acceptance_rate_per_position"] = rates + [0.0] * (spec.num_tokens - len(rates))
    out["speedup_per_repeat"] = speedup_per_repeat(mine, base, cfg.repeats)
    # repeats are not alike where a drafter learns across requests (suffix decoding's global tree)
    out["tau_per_repeat"] = [pool(of(mine, label, repeat=i)).mean_acceptance_length for i in range(cfg.repeats)]
    out["lossless"] = lossless(base, mine, greedy)
    if not greedy:
        out["distribution_check"] = distribution_check(base, mine, seed=cfg.seed)
    out["drafter_params"] = drafter_params(spec)
    out["config"] = asdict(spec)
    return out


def summarize(
    cfg: EvalConfig, target_id: str, engine: Engine, methods: dict[str, SpecConfig], records: list, partial: bool
) -> dict:
    main = [r for r in records if r.prefix_cache == cfg.prefix_cache]
    base = pool(of(main, "ar"))
    rows = {label: method_result(label, spec, main, cfg) for label, spec in methods.items()}
    checks = [row["lossless"] for row in rows.values()]
    every = pool(main)
    results = {
        "target": target_id,
        "device": str(engine.model.device),
        "dtype": str(engine.model.dtype).removeprefix("torch."),
        "prompts": len({r.id for r in main}),
        "max_new_tokens": cfg.max_new_tokens,
        "temperature": cfg.temperature,
        "suite": cfg.suite.name if cfg.suite else None,
        "prompts_file": cfg.prompts,
        "repeats": cfg.repeats,
        "partial": partial,
        "baseline": method_summary("ar", base),
        "spec": rows[next(iter(rows))],  # the first method, as issue 2's schema has it
        "methods": rows,
        "lossless": {
            "checked": sum(c["checked"] for c in checks),
            "identical": sum(c["identical"] for c in checks),
            "note": checks[0]["note"],
        },
        "prefix_cache": {
            "enabled": cfg.prefix_cache,
            "queried_tokens": every.prefix_queried_tokens,
            "hit_tokens": every.prefix_hit_tokens,
        },
        "by_category": by_category(main, list(methods)),
        "config": {
            "spec": asdict(cfg.spec),
            "max_seq_len": cfg.max_seq_len,
            "cuda_graphs": cfg.cuda_graphs,
            "seed": cfg.seed,
            "warmup": cfg.warmup,
        },
        "environment": environment(engine),
    }
    if cfg.study:
        results["study"] = study_cells(records, next(iter(methods)), cfg.temperature == 0)
    return results


def environment(engine: Engine) -> dict:
    device = engine.model.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    return {
        "device": f"{device.type}: {name}",
        "dtype": str(engine.model.dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "commit": git_commit(),
    }


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> str:
    """The checkout's commit, `-dirty` when it has uncommitted changes; empty outside a git checkout."""
    try:
        run = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            timeout=5,
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return run.stdout.strip() if run.returncode == 0 else ""


def write_outputs(out: Path, records: list[Record], prompts: list[dict], results: dict) -> None:
    """outputs.jsonl, per_prompt.jsonl and (last) results.json, each written to a temp file and renamed."""
    out.mkdir(parents=True, exist_ok=True)
    keys = ("id", "turn", "method", "output_ids", "text", "repeat")
    atomic_write(out / "outputs.jsonl", "".join(json.dumps({k: getattr(r, k) for k in keys}) + "\n" for r in records))
    atomic_write(out / "per_prompt.jsonl", "".join(json.dumps(p) + "\n" for p in prompts))
    atomic_write(out / "results.json", json.dumps(results, indent=2) + "\n")


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
