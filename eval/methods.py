"""Which methods an eval runs: `spec` plus the `methods` group, each under a label; and a drafter's size."""

from __future__ import annotations

from dataclasses import asdict
from math import prod
from pathlib import Path

from safetensors import safe_open

from draftsmith.serve.build import LOOKUPS, SpecConfig


def resolve_methods(spec: SpecConfig, methods: dict[str, SpecConfig]) -> dict[str, SpecConfig]:
    """label -> method, `spec` first. A method both in `spec` and `methods` runs once if both say the same."""
    out: dict[str, SpecConfig] = {} if spec.name == "ar" else {spec_label(spec): spec}
    for label, m in methods.items():
        if m.name == "ar":
            raise ValueError(f"methods.{label} is plain decoding (ar), which every eval runs as the baseline")
        if label in out and asdict(out[label]) != asdict(m):
            raise ValueError(
                f"spec={label} and methods.{label} differ ({asdict(out[label])} vs {asdict(m)}): "
                f"set {label}'s options in one place (spec.KEY=V or methods.{label}.KEY=V)"
            )
        out[label] = m
    if not out:
        raise ValueError(
            "eval compares methods against plain decoding (ar): pick "
            "spec=ngram|suffix|draft|layerskip|eagle|eagle3|medusa or methods=[ngram,eagle3]"
        )
    return out


def spec_label(spec: SpecConfig) -> str:
    if spec.name in LOOKUPS:
        return spec.name
    return spec.name + ("+ngram" if spec.ngram_tokens else "+suffix" if spec.suffix_tokens else "")


def drafter_params(spec: SpecConfig) -> int | None:
    """Parameters stored in the drafter's weight files (0 for n-gram lookup and suffix decoding; None when it has
    no files of its own: plain decoding, layerskip)."""
    if spec.name in ("ngram", "suffix"):
        return 0
    if not spec.drafter:
        return None
    files = sorted(Path(spec.drafter).glob("*.safetensors"))
    total = 0
    for file in files:
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                total += prod(f.get_slice(key).get_shape())
    return total or None
