"""What an eval writes to DIR/results.json, as types: the runner builds a RunResult, the report, compare, the
headline and the W&B log read its attributes. `dump` writes the JSON (field names and order as the types list
them) and `load_results` reads it back, refusing a file of another schema version.

A leaf module: it imports nothing of the eval package, so every part of it can import it.
"""

from __future__ import annotations

import json
import types
import typing
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any

# Bump it when results.json changes shape (a field added, renamed, moved or removed); a file of another version is
# refused by load_results with the fix: re-run the eval.
SCHEMA_VERSION = 3  # 2: verify rows per step and draft time per step in every summary; 3: steps and calibration

Interval = list[float] | None  # [low, high] of a 95% interval; None where there is none


@dataclass
class Summary:
    """One method's counters pooled over its requests (never means of means), with their 95% intervals."""

    method: str  # "ar" or a method label
    tokens_per_s: float
    ttft_ms: float
    tpot_ms: float
    total_ms: float
    new_tokens: int
    mean_acceptance_length: float  # tau = 1 + accepted / drafts
    acceptance_rate_per_position: list[float]
    draft_acceptance_rate: float
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    target_forward_passes: int
    mean_verify_rows: float  # rows per target pass: the pending token and the draft nodes verified
    verify_rows: list[int]  # [i]: target passes that verified i + 1 rows (spec.verify=cost cuts drafts)
    draft_ms_per_step: float  # time in the proposer (propose and accept) per target pass
    requests: int
    prefix_cache_hit_rate: float
    steps: dict[str, int]  # target passes by what they verified: plain, probe, whole (a draft), cut (part of one)
    # reliability tables of acceptance estimates (serve/engine/calibration.py), keyed "<drafter>/<depth>" for the
    # draft policy's, ".../settled" past a request's first 32 steps, ".../own" for the drafter's own probabilities
    calibration: dict[str, list[float]]
    # number name -> its interval (acceptance_rate_per_position: one per position; speedup where compared); empty
    # with fewer than two prompts
    intervals: dict[str, Any]

    def interval(self, key: str) -> Any:
        return self.intervals.get(key)


@dataclass
class Compared(Summary):
    """A method against plain decoding on the same turns."""

    speedup: float
    significant: bool | None  # the speedup's interval excludes 1.0; None without an interval


@dataclass
class Lossless:
    """Greedy outputs compared token for token with plain decoding's."""

    checked: int
    identical: int
    note: str


@dataclass
class DistributionCheck:
    """Sampling (temperature > 0): a permutation test of output-token histograms, plain vs the method.
    permutations, exact and mean_new_tokens are absent when there was nothing to test."""

    test: str
    units: int
    permutations: int | None = None
    exact: bool | None = None
    tv_distance: float | None = None
    p_value: float | None = None
    mean_new_tokens: dict[str, float] | None = None
    note: str = ""


@dataclass
class MethodResult(Compared):
    speedup_per_repeat: list[float]
    tau_per_repeat: list[float]
    lossless: Lossless
    distribution_check: DistributionCheck | None  # sampling only
    drafter_params: int | None  # None: drafts with the target's own weights (layerskip)
    config: dict[str, Any]  # the method's SpecConfig as it ran: its drafter and draft shape
    drafter_dtype: str | None = None  # the dtype its drafter ran in (spec.draft_dtype resolved); None: no drafter

    def draft_shape(self) -> str:
        """'num_tokens 3, tree topk 4 / 12 nodes' (the shape keys the method was run with)."""
        c = self.config
        parts = [f"num_tokens {c.get('num_tokens')}"]
        tree = c.get("tree") or {}
        if tree and (tree.get("topk", 1) != 1 or tree.get("total_tokens")):
            parts.append(f"tree topk {tree.get('topk')} / {tree.get('total_tokens') or 'all'} nodes")
        if c.get("choices"):
            parts.append(f"choices {len(c['choices'])}")
        return ", ".join(parts)


@dataclass
class CategoryResult:
    prompts: int
    baseline: Summary
    methods: dict[str, Compared]


@dataclass
class PrefixCacheUse:
    enabled: bool
    queried_tokens: int
    hit_tokens: int


@dataclass
class RepeatSpread:
    """How much plain decoding's time per token of the same prompt varied between repeats."""

    prompts: int
    median: float
    max: float


@dataclass
class Noise:
    repeat_spread: RepeatSpread | None  # None with one repeat
    noisy: bool
    threshold: float


@dataclass
class SkippedTurn:
    """A turn not answered, and why (one that would exceed the context, and the turns after it)."""

    id: str
    turn: int
    repeat: int
    method: str
    prefix_cache: bool
    reason: str


@dataclass
class Skipped:
    turns: int
    list: list[SkippedTurn]


@dataclass
class RunConfig:
    """Run settings results.json keeps beside the top-level ones."""

    spec: dict[str, Any]  # the first method's SpecConfig as given
    max_seq_len: int
    cuda_graphs: str
    seed: int
    warmup: int


@dataclass
class Environment:
    """The machine a result came from (eval/machine.py), and the load average around the run."""

    device: str
    cpu: str
    cpu_flags: list[str]
    gpu: str | None
    dtype: str
    torch: str
    python: str
    threads: int
    cpu_count: int | None
    commit: str
    load_before: list[float] | None = None
    load_after: list[float] | None = None
    forward: str | None = None  # the target's forward that ran (cost_profile.forward_path); absent in older files
    kernels: str | None = None  # the library of draftsmith's own kernels it ran on, None for torch's kernels
    panels: str | None = None  # DRAFTSMITH_PANELS where they ran: exact (the narrowest exact format) or fp32


@dataclass
class StudyCell:
    prefix_cache: bool
    speculation: str | None  # the method, None for plain decoding
    ttft_ms: float
    tpot_ms: float | None  # None: no token after the first
    total_ms: float
    tokens_per_s: float
    new_tokens: int
    requests: int
    prefix_cache_hit_rate: float
    intervals: dict[str, Interval]


@dataclass
class Effect:
    ratio: float | None  # None: undefined
    interval: Interval


@dataclass
class Control(Effect):
    """Plain TPOT with the cache over without it: should be 1.0."""

    noisy: bool
    undefined: str | None  # why the control is undefined, if it is


@dataclass
class Identical:
    checked: int
    identical: int


@dataclass
class StudyResult:
    """The prefix cache x speculation 2x2 (eval/study.py)."""

    study: str
    method: str
    cells: list[StudyCell]
    effects: dict[str, Effect]
    control: Control
    identical: Identical | None  # greedy only
    finding: str


@dataclass
class RunResult:
    """One eval: DIR/results.json."""

    schema_version: int
    target: str
    device: str
    dtype: str
    prompts: int
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    suite: str | None
    prompts_file: str | None
    repeats: int
    partial: bool  # interrupted: counts only the prompts every method finished
    baseline: Summary
    spec: MethodResult  # the first method's entry, kept at the top level
    methods: dict[str, MethodResult]
    lossless: Lossless
    prefix_cache: PrefixCacheUse
    by_category: dict[str, CategoryResult]
    noise: Noise
    skipped: Skipped
    config: RunConfig
    environment: Environment
    study: StudyResult | None
    prompts_sha256: str

    @property
    def source(self) -> str:
        """The suite's name, else the prompts file."""
        return self.suite or self.prompts_file or ""

    def settings(self) -> dict[str, Any]:
        """Every run-wide setting that changes speed or outputs, by name: runs differing in one are compared with a
        warning. A method's own settings (drafter, draft shape) are what a comparison compares."""
        return {
            "device": self.device,
            "dtype": self.dtype,
            "suite": self.source,
            "prompts": self.prompts,
            "prompts_sha256": self.prompts_sha256,
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.config.seed,
            "prefix_cache": self.prefix_cache.enabled,
            "cuda_graphs": self.config.cuda_graphs,
            "forward": self.environment.forward,  # what cuda_graphs=auto resolved to
            "own kernels": self.environment.kernels is not None,
            "panels": self.environment.panels,  # fp32 panels: other bytes, and fp32 drafters under auto
            "max_seq_len": self.config.max_seq_len,
            "warmup": self.config.warmup,
        }


# fields left out of the JSON when None (present otherwise)
OMIT_NONE: dict[type, tuple[str, ...]] = {
    DistributionCheck: ("permutations", "exact", "mean_new_tokens"),
    MethodResult: ("distribution_check", "drafter_dtype"),
    RunResult: ("study",),
    Environment: ("forward", "kernels", "panels"),  # absent in files written before they were recorded
}


def to_json(x: Any) -> Any:
    """A result (or any part of one) as plain JSON values, fields in their declared order."""
    if is_dataclass(x) and not isinstance(x, type):
        omit = OMIT_NONE.get(type(x), ())
        return {
            f.name: to_json(getattr(x, f.name))
            for f in fields(x)
            if not (f.name in omit and getattr(x, f.name) is None)
        }
    if isinstance(x, list | tuple):
        return [to_json(v) for v in x]
    if isinstance(x, dict):
        return {k: to_json(v) for k, v in x.items()}
    return x


def dump(results: RunResult) -> str:
    """results.json's text."""
    return json.dumps(to_json(results), indent=2) + "\n"


class ShapeError(ValueError):
    """A JSON value that does not have a result type's shape."""


def from_json(cls: type, value: Any, where: str = "") -> Any:
    """The JSON value as `cls` (a result dataclass, or a list/dict/optional of one); a key missing or unknown is a
    ShapeError naming where it is."""
    origin, args = typing.get_origin(cls), typing.get_args(cls)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return from_json(inner, value, where)
    if origin is list:
        if not isinstance(value, list):
            raise ShapeError(f"{where or 'the top level'} is not a list")
        return [from_json(args[0], v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ShapeError(f"{where or 'the top level'} is not an object")
        return {k: from_json(args[1], v, f"{where}.{k}" if where else k) for k, v in value.items()}
    if isinstance(cls, type) and is_dataclass(cls):
        if not isinstance(value, dict):
            raise ShapeError(f"{where or 'the top level'} is not an object")
        hints = typing.get_type_hints(cls)
        names = [f.name for f in fields(cls)]
        omit = OMIT_NONE.get(cls, ())
        missing = [n for n in names if n not in value and n not in omit]
        unknown = [k for k in value if k not in names]
        if missing or unknown:
            what = "; ".join(
                [f"missing {', '.join(missing)}"] * bool(missing) + [f"unknown {', '.join(unknown)}"] * bool(unknown)
            )
            raise ShapeError(f"{where or 'the top level'}: {what}")
        return cls(**{n: from_json(hints[n], value.get(n), f"{where}.{n}" if where else n) for n in names})
    return value


def load_results(path: str | Path) -> RunResult:
    """DIR/results.json (or the file itself) as a RunResult. A file of another schema version, or not a result at
    all, is a ValueError naming the file and the fix."""
    path = Path(path)
    path = path / "results.json" if path.is_dir() else path
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not a draftsmith-eval result ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a draftsmith-eval result (not a JSON object)")
    found = data.get("schema_version")
    if found != SCHEMA_VERSION:
        raise ValueError(
            f"{path} has results schema version {'none' if found is None else found}, this draftsmith reads version "
            f"{SCHEMA_VERSION}: re-run the eval (draftsmith-eval ... out={path.parent}) to write it again"
        )
    try:
        return from_json(RunResult, data)
    except ShapeError as e:
        raise ValueError(
            f"{path} is not a draftsmith-eval result of schema version {SCHEMA_VERSION} ({e}): re-run the eval"
        ) from e
