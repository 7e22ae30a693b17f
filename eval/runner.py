"""Plain decoding vs one or more speculative methods on the same prompts: interleaved, repeated, after a
warm-up; appends every finished prompt to DIR/records.jsonl (eval/journal.py), then aggregates and writes
DIR/results.json, outputs.jsonl, per_prompt.jsonl.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from draftsmith.cpu_kernels import panels
from draftsmith.files import write_text_atomic
from draftsmith.serve.build import build_engine, resolve_shape
from draftsmith.serve.drafters import drafter_dtype
from draftsmith.serve.engine.cost_profile import forward_path, kernel_library
from draftsmith.serve.engine.engine import Engine
from draftsmith.serve.engine.sampling import SamplingParams
from draftsmith.serve.models.target import LoadedTarget, TargetConfig, encode_chat, encode_raw, load_target
from draftsmith.serve.shared.wandb_run import WandbConfig
from draftsmith.serve.spec import SpecConfig

from .aggregate import (
    Record,
    by_category,
    by_prompt,
    compared,
    lossless,
    of,
    pool,
    repeat_spread,
    speedup_per_repeat,
    summary,
)
from .distribution import distribution_check
from .journal import Journal, Skip, Unit
from .machine import environment, load_average
from .methods import drafter_identity, drafter_params, resolve_methods
from .prompts import Prompt, load_prompts, prompts_hash
from .results import (
    SCHEMA_VERSION,
    Lossless,
    MethodResult,
    Noise,
    PrefixCacheUse,
    RunConfig,
    RunResult,
    Skipped,
    dump,
)
from .stats import Bootstrap
from .study import STUDIES, study_arms, study_cells
from .suites import SUITES, SuiteConfig, load_suite

Arm = tuple[str, bool]  # (method label or "ar", prefix cache on)


@dataclass
class EvalConfig:
    out: str
    prompts: str | None = None  # a prompts file (docs/design.md format) ...
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
    cuda_graphs: str = "auto"  # serve/engine/graphs.py: auto | compile | graphs | eager | off
    limit: int | None = None
    warmup: int = 1
    repeats: int = 1
    study: str | None = None  # prefix_x_spec: the 2x2 of prefix cache off/on x plain/first method
    resume: bool = False  # continue the run in `out` from its records.jsonl (same settings)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    # read draftsmith-replay logs instead of running prompts: a path, or [a, b] to compare (eval/replay_report.py)
    replay: Any = None
    replay_labels: list[str] | None = None  # one per log; default: the files' names
    window: int = 25  # requests per window of a replay log
    vllm_sweep: str | None = None  # a draft-length sweep's results.json: its vLLM recommendation is printed too


NOISY_SPREAD = 0.10  # plain decoding's time per token of the same prompt varying more than this between repeats


def run_eval(cfg: EvalConfig) -> RunResult:
    """Everything a user can get wrong is checked before any prompt runs; each finished prompt is on disk."""
    check_settings(cfg)
    SamplingParams(cfg.temperature, cfg.top_p, cfg.top_k, cfg.seed)  # validates them
    # the shape each method drafts: its own settings, else its drafter folder's, else its kind's default
    methods = {label: resolve_shape(m) for label, m in resolve_methods(cfg.spec, cfg.methods).items()}
    prompts = pick_prompts(cfg)
    target = load_target(cfg.target)
    engines = {
        arm: build_engine(
            target, spec_of(arm, methods), arm[1], cfg.max_seq_len, cfg.cuda_graphs, cache_dir=cfg.target.cache_dir
        )
        for arm in arms(cfg, methods)
    }
    check_first_turns_fit(prompts, target.tokenizer, cfg, min(e.max_seq_len for e in engines.values()))
    run_settings = settings(cfg, target, prompts, methods)
    journal = Journal(Path(cfg.out), run_settings, cfg.resume)
    load_before = load_average()
    warm_up(engines, prompts[0], target.tokenizer, cfg)
    partial = run_all(engines, prompts, target.tokenizer, cfg, journal)
    records = [r for u in journal.units for r in u.records]
    skipped = [s for u in journal.units for s in u.skipped]
    engine = engines[("ar", cfg.prefix_cache)]
    results = summarize(cfg, target.target_id, engine, methods, records, skipped, partial, run_settings)
    results.environment = replace(results.environment, load_before=load_before, load_after=load_average())
    main = [r for r in records if r.prefix_cache == cfg.prefix_cache]
    write_outputs(Path(cfg.out), main, by_prompt(main, list(methods), cfg.temperature == 0), results)
    return results


def settings(cfg: EvalConfig, target: LoadedTarget, prompts: list[Prompt], methods: dict[str, SpecConfig]) -> dict:
    """What the records depend on: a resume must match it. Paths alone are not enough: the prompts' content and
    each drafter folder's fingerprint are in it too (an edited file, a drafter retrained in place), and what the
    settings resolved to on this machine: each drafter's dtype (spec.draft_dtype=auto) and the panel setting."""
    skip = ("out", "resume", "wandb", "replay", "replay_labels", "window")
    keep = {k: v for k, v in asdict(cfg).items() if k not in skip}
    drafters = {label: drafter_identity(m.drafter) for label, m in methods.items() if m.drafter}
    dtypes = {label: str(drafter_dtype(m, target)).removeprefix("torch.") for label, m in methods.items() if m.drafter}
    identity = {
        "target_id": target.target_id,
        "prompts_sha256": prompts_hash(prompts),
        "drafters": drafters,
        "drafter_dtypes": dtypes,
        "panels": panels.setting() if panels.available() else None,
    }
    return json.loads(json.dumps({**keep, **identity}, default=str))


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
    assert cfg.suite is not None, "one of the two, checked above"
    return load_suite(cfg.suite, cfg.limit)


def arms(cfg: EvalConfig, methods: dict[str, SpecConfig]) -> list[Arm]:
    """Plain decoding and each method with the configured cache; a study adds its cells with the cache flipped."""
    out = [("ar", cfg.prefix_cache)] + [(label, cfg.prefix_cache) for label in methods]
    if cfg.study:
        out += [a for a in study_arms(next(iter(methods))) if a not in out]
    return out


def spec_of(arm: Arm, methods: dict[str, SpecConfig]) -> SpecConfig:
    return SpecConfig("ar") if arm[0] == "ar" else methods[arm[0]]


def run_all(engines: dict[Arm, Engine], prompts: list[Prompt], tokenizer, cfg: EvalConfig, journal: Journal) -> bool:
    """Every prompt through every arm, arm order rotating per prompt so none always runs first; each prompt is
    appended to the journal once every arm has answered it. A resume skips the repeats the journal holds whole and
    answers a partly done repeat's finished prompts again without recording them: the engines' state (prefix
    cache, suffix decoding's global tree) is then what an uninterrupted run had. Returns True when Ctrl-C cut the
    run short (what finished is kept)."""
    order, done = list(engines), journal.done()
    names = ", ".join(dict.fromkeys(a[0] for a in order if a[0] != "ar"))
    bar = tqdm(total=cfg.repeats * len(prompts), initial=len(done), desc=f"eval ar vs {names}", unit="prompt")
    try:
        for rep in range(cfg.repeats):
            if all((p.id, rep) in done for p in prompts):
                continue
            for engine in engines.values():  # each repeat starts cold, so repeats measure the same thing
                engine.forget()  # no hit, drafting or estimate from the warm-up or earlier repeats
            for i, prompt in enumerate(prompts):
                k = (i + rep) % len(order)
                answers = [answer(engines[arm], arm, prompt, tokenizer, cfg, rep, i) for arm in order[k:] + order[:k]]
                if (prompt.id, rep) in done:
                    continue
                journal.append(
                    Unit(prompt.id, rep, [r for a in answers for r in a[0]], [s for a in answers for s in a[1]])
                )
                bar.update()
    except KeyboardInterrupt:
        if not journal.units:
            raise
        return True
    finally:
        bar.close()
    return False


def seed_for(cfg: EvalConfig, arm: Arm, rep: int, i: int, turn: int) -> int:
    """Independent seeds per arm, repeat, prompt and turn: plain and spec samples must not be coupled, or the
    distribution check's exchangeability breaks."""
    return zlib.crc32(f"{cfg.seed}|{arm}|{rep}|{i}|{turn}".encode())


def answer(
    engine: Engine, arm: Arm, prompt: Prompt, tokenizer, cfg: EvalConfig, rep: int, i: int
) -> tuple[list[Record], list[Skip]]:
    """All turns of one prompt, each answer fed back as the assistant message (as MT-bench does). A turn that
    would exceed the context is skipped with its reason, and so are the turns after it."""
    messages: list[dict] = []
    out: list[Record] = []
    for t, user in enumerate(prompt.turns):
        messages.append({"role": "user", "content": user})
        ids = encode_turn(tokenizer, prompt, messages)
        try:
            engine.check_fits(len(ids), cfg.max_new_tokens)
        except ValueError as e:
            later = [
                Skip(prompt.id, u, rep, arm[0], arm[1], f"turn {u + 1}: follows turn {t + 1}, which was skipped")
                for u in range(t + 1, len(prompt.turns))
            ]
            return out, [Skip(prompt.id, t, rep, arm[0], arm[1], f"turn {t + 1}: {e}"), *later]
        sp = SamplingParams(cfg.temperature, cfg.top_p, cfg.top_k, seed_for(cfg, arm, rep, i, t))
        g = engine.generate(ids, cfg.max_new_tokens, sp)
        text = tokenizer.decode(g.output_ids, skip_special_tokens=True)
        messages.append({"role": "assistant", "content": text})
        out.append(Record(prompt.id, prompt.category, t, rep, arm[0], arm[1], g.output_ids, text, g.metrics))
    return out, []


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


def method_result(label: str, spec: SpecConfig, main: list[Record], cfg: EvalConfig, dtype: str | None) -> MethodResult:
    """dtype: the dtype its drafter ran in (settings' drafter_dtypes), None without one."""
    base, mine = of(main, "ar"), of(main, label)
    greedy = cfg.temperature == 0
    depth = spec.num_tokens or 0  # plain decoding (ar) has no draft shape
    out = compared(label, mine, base, cfg.seed, positions=depth)
    rates = out.acceptance_rate_per_position
    if out.drafts:  # depths never accepted still count: their rate is 0
        out.acceptance_rate_per_position = rates + [0.0] * (depth - len(rates))
    return MethodResult(
        **vars(out),
        speedup_per_repeat=speedup_per_repeat(mine, base, cfg.repeats),
        # each repeat starts cold, so these differ only where drafting depends on sampling or timing
        tau_per_repeat=[pool(of(mine, label, repeat=i)).mean_acceptance_length for i in range(cfg.repeats)],
        lossless=lossless(base, mine, greedy),
        distribution_check=None if greedy else distribution_check(base, mine, seed=cfg.seed),
        drafter_params=drafter_params(spec),
        config=asdict(spec),
        drafter_dtype=dtype,
    )


def summarize(
    cfg: EvalConfig,
    target_id: str,
    engine: Engine,
    methods: dict[str, SpecConfig],
    records: list[Record],
    skipped: list[Skip],
    partial: bool,
    run_settings: dict,
) -> RunResult:
    main = [r for r in records if r.prefix_cache == cfg.prefix_cache]
    base = of(main, "ar")
    dtypes = run_settings["drafter_dtypes"]
    rows = {label: method_result(label, spec, main, cfg, dtypes.get(label)) for label, spec in methods.items()}
    kernels = kernel_library(engine)
    checks = [row.lossless for row in rows.values()]
    every = [r.metrics for r in main]
    return RunResult(
        schema_version=SCHEMA_VERSION,
        target=target_id,
        device=str(engine.model.device),
        dtype=str(engine.model.weights_dtype).removeprefix("torch."),
        prompts=len({r.id for r in main}),
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        suite=cfg.suite.name if cfg.suite else None,
        prompts_file=cfg.prompts,
        repeats=cfg.repeats,
        partial=partial,
        baseline=summary("ar", base, Bootstrap.over([r.id for r in base], cfg.seed)),
        spec=rows[next(iter(rows))],  # the first method's entry, kept at the top level
        methods=rows,
        lossless=Lossless(
            checked=sum(c.checked for c in checks),
            identical=sum(c.identical for c in checks),
            note=checks[0].note,
        ),
        prefix_cache=PrefixCacheUse(
            enabled=cfg.prefix_cache,
            queried_tokens=sum(m.prefix_queried_tokens for m in every),
            hit_tokens=sum(m.prefix_hit_tokens for m in every),
        ),
        by_category=by_category(main, list(methods), cfg.seed),
        noise=noise(base),
        skipped=Skipped(turns=len(skipped), list=list(skipped)),
        config=RunConfig(
            spec=asdict(cfg.spec),
            max_seq_len=cfg.max_seq_len,
            cuda_graphs=cfg.cuda_graphs,
            seed=cfg.seed,
            warmup=cfg.warmup,
        ),
        environment=replace(
            environment(engine.model.device, engine.model.weights_dtype),
            forward=forward_path(engine),
            kernels=kernels,
            panels=run_settings["panels"] if kernels else None,
        ),
        study=study_cells(records, next(iter(methods)), cfg.temperature == 0, cfg.seed) if cfg.study else None,
        prompts_sha256=run_settings["prompts_sha256"],
    )


def noise(base: list[Record]) -> Noise:
    """The control every eval carries: how much plain decoding of the same prompt varied between repeats."""
    spread = repeat_spread(base)
    return Noise(
        repeat_spread=spread, noisy=spread is not None and spread.median > NOISY_SPREAD, threshold=NOISY_SPREAD
    )


def write_outputs(out: Path, records: list[Record], prompts: list[dict], results: RunResult) -> None:
    """outputs.jsonl, per_prompt.jsonl and (last) results.json, each written to a temp file and renamed."""
    out.mkdir(parents=True, exist_ok=True)
    keys = ("id", "turn", "method", "output_ids", "text", "repeat")
    lines = (json.dumps({k: getattr(r, k) for k in keys}) + "\n" for r in records)
    write_text_atomic(out / "outputs.jsonl", "".join(lines))
    write_text_atomic(out / "per_prompt.jsonl", "".join(json.dumps(p) + "\n" for p in prompts))
    write_text_atomic(out / "results.json", dump(results))
