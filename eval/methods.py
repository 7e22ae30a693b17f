"""Which methods an eval runs: `spec` plus the `methods` group, each under a label; and a drafter's size."""

from __future__ import annotations

import hashlib
from dataclasses import asdict
from math import prod
from pathlib import Path

from omegaconf import DictConfig
from safetensors import safe_open

from draftsmith.heads.kinds import by_spec, specs
from draftsmith.serve.build import paired_lookup
from draftsmith.serve.models.loader import weight_files
from draftsmith.serve.spec import SpecConfig, needs_drafter


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
            f"eval compares methods against plain decoding (ar): pick spec={'|'.join(specs()[1:])} "
            "or methods=[ngram,eagle3]"
        )
    return out


def check_drafters(cfg: DictConfig) -> None:
    """Before the config is typed (SpecConfig would name its own key, spec.drafter): each method of `methods`
    that needs a drafter has methods.LABEL.drafter."""
    for label, m in (cfg.get("methods") or {}).items():
        needs = needs_drafter(m.get("name"))
        if needs and not m.get("drafter"):
            raise ValueError(f"methods.{label} needs methods.{label}.drafter=DIR: {needs}")


def spec_label(spec: SpecConfig) -> str:
    """spec.name, with the lookup it pairs (serve/proposers/hybrid.py: the proposer's name, e.g. eagle3_suffix,
    as conf/methods names it)."""
    lookup = paired_lookup(spec)
    return f"{spec.name}_{lookup}" if lookup else spec.name


HEAD_BYTES = 1 << 20  # of each weight file: its header and first tensors change when it is retrained


def drafter_identity(folder: str | None) -> str | None:
    """A cheap fingerprint of a drafter folder: config.json and each weight file's size and first MiB, so a resume
    notices a drafter retrained in place. None without a local folder."""
    if not folder or not Path(folder).is_dir():
        return None
    h = hashlib.sha256()
    for file in sorted(f for pattern in ("config.json", "*.safetensors", "*.bin") for f in Path(folder).glob(pattern)):
        with open(file, "rb") as f:
            h.update(f"{file.name}:{file.stat().st_size}:".encode() + f.read(HEAD_BYTES))
    return h.hexdigest()[:16]


def drafter_params(spec: SpecConfig) -> int | None:
    """Parameters in the drafter's weight files: floating-point tensors only, so the draft-vocabulary maps (d2t,
    t2d) and the token counts a draftsmith folder keeps beside its weights are not counted; without a drafter,
    what its kind registers (0 for n-gram lookup and suffix decoding; None when it drafts with the target's own
    weights: layerskip)."""
    if not spec.drafter:
        return by_spec(spec.name).parameters
    total = 0
    for file in weight_files(Path(spec.drafter)):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                tensor = f.get_slice(key)
                if tensor.get_dtype().startswith(("F", "BF")):  # F16/F32/F64, BF16, F8_*: not I64 or BOOL
                    total += prod(tensor.get_shape())
    return total or None
