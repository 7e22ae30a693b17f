"""Export a drafter folder to the formats serving engines load: vLLM, SGLang, TGI, HF.

Each kind names its formats in its registry record (heads/kinds.py), each a Format (for the built-in kinds, in
serve/export/export_<kind>.py): an exporter returning the export's config.json, its safetensors files and the
target files to copy, and the validator's pieces. `export` writes them to a temp folder beside OUT, validates the result
(serve/export/checks.py) and only then renames it into place, so a failed export leaves nothing behind.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from draftsmith.files import move_into_place, temp_folder_beside
from draftsmith.serve.export.base import (
    EXPORT_DTYPES,
    TOKEN_MAP,
    Export,
    ExportError,
    Format,
    Source,
    check_format_name,
    format_for,
    read_source,
    sglang_misses,
)
from draftsmith.serve.export.card import EXPORT_MARK, export_card
from draftsmith.serve.export.vllm_sweep import Sweep, SweepError, read_sweep
from draftsmith.serve.models.target import DTYPES, TargetConfig

# ---------------------------------------------------------------- exporters, one per (kind, format)


# ---------------------------------------------------------------- loading and refusing bad input


def check_target_type(src: Source, fmt: str, f: Format) -> None:
    mtype = src.target_hf.get("model_type")
    if mtype not in f.target_types:
        raise ExportError(
            f"target {src.target_dir} has model_type={mtype!r}; format={fmt} serves {src.kind} drafters for "
            f"{', '.join(f.target_types)} targets only: pick another format or target"
        )


def check_out(out: Path, drafter: Path, overwrite: bool) -> None:
    out, drafter = out.resolve(), drafter.resolve()
    if out == drafter or drafter.is_relative_to(out) or out.is_relative_to(drafter):
        raise ExportError(f"out={out} overlaps the drafter folder {drafter}: export to a separate folder")
    if Path.cwd().resolve().is_relative_to(out):
        raise ExportError(f"out={out} is the current folder or holds it: export to a new folder, e.g. out=export")
    if out.exists() and not overwrite:
        raise ExportError(f"out={out} exists; pass overwrite=true to replace it, or choose another out")
    if out.exists() and not out.is_dir():
        raise ExportError(f"out={out} exists and is not a folder; remove it or choose another out")
    if out.exists() and any(out.iterdir()) and not is_export(out):
        raise ExportError(
            f"out={out} is not an earlier export (no README.md by draftsmith-export): overwrite=true replaces only "
            "an export, never a training run or other files; choose another out, or remove it yourself"
        )


def sweep_for(path: str | None, fmt: str, f: Format) -> Sweep | None:
    """The draft-length sweep the card recommends from, refused when unreadable or measured for another method."""
    if path is None:
        return None
    if not f.vllm:
        raise ExportError(f"vllm_sweep={path}: format={fmt} is not served by vLLM; drop vllm_sweep or use format=vllm")
    try:
        sweep = read_sweep(path)
    except SweepError as e:
        raise ExportError(f"vllm_sweep: {e}") from e
    if sweep.method != f.vllm:
        raise ExportError(
            f"vllm_sweep={path} measured vLLM's {sweep.method!r} method, but this export is served as {f.vllm!r}: "
            "sweep this export (bash scripts/vllm_concurrency.sh --export OUT) and give that results.json"
        )
    return sweep


def is_export(folder: Path) -> bool:
    card = folder / "README.md"
    return card.is_file() and EXPORT_MARK in card.read_text(errors="replace")


# ---------------------------------------------------------------- writing


def cast(state: dict[str, Tensor], dtype: torch.dtype) -> dict[str, Tensor]:
    """Floating tensors to the export dtype; d2t (int64) and t2d (bool) keep theirs."""
    return {k: (v.to(dtype) if v.is_floating_point() else v).detach().contiguous().cpu() for k, v in state.items()}


def write(exp: Export, src: Source, f: Format, dtype: str, folder: Path) -> None:
    if f.write_files is not None:
        f.write_files(exp, src, DTYPES[EXPORT_DTYPES[dtype]], folder)
    else:
        write_safetensors(exp, src, f, dtype, folder)
    for file in folder.iterdir():
        file.chmod(0o644)  # save_file writes owner-only files


def write_safetensors(exp: Export, src: Source, f: Format, dtype: str, folder: Path) -> None:
    config = exp.config | ({"torch_dtype": EXPORT_DTYPES[dtype]} if f.torch_dtype else {})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name, state in exp.tensors.items():
        save_file(cast(state, DTYPES[EXPORT_DTYPES[dtype]]), str(folder / name), metadata={"format": "pt"})
    for name in exp.copy:
        shutil.copy2(src.target_dir / name, folder / name)
    if exp.token_map is not None:  # SGLang reads it with torch.load(weights_only=True): a plain tensor
        torch.save(exp.token_map.long().contiguous(), folder / TOKEN_MAP)


def export(
    drafter: Path,
    fmt: str,
    out: Path,
    target_cfg: TargetConfig | None = None,
    dtype: str = "bf16",
    overwrite: bool = False,
    gguf_target: str | None = None,
    vllm_sweep: str | None = None,
) -> Path:
    """Export drafter to OUT in `fmt`; OUT appears only once the export has passed validation. gguf_target: the
    target GGUF llama.cpp runs the head beside (format=gguf), where the target was not read from one. vllm_sweep:
    a draft-length sweep's results.json (peers/vllm_concurrency.py) the card recommends from."""
    from draftsmith.serve.export.checks import check_export  # which imports this module

    drafter, out = Path(drafter).expanduser(), Path(out).expanduser()
    if dtype not in EXPORT_DTYPES:
        raise ExportError(f"unknown dtype {dtype!r}; choose one of {', '.join(EXPORT_DTYPES)}")
    check_format_name(fmt)
    check_out(out, drafter, overwrite)
    src = read_source(drafter, target_cfg or TargetConfig(), gguf_target)
    f = format_for(src.kind, fmt)
    check_target_type(src, fmt, f)
    if src.kind == "eagle3" and src.head.config.qk_norm:  # a draft model's qk norms are its own Qwen3 layers
        raise ExportError(
            "this head's layer is Qwen3-style (qk_norm): no export format is checked against an engine's forward for "
            "it yet; draft with it in draftsmith (spec.drafter=...), or train without head.args.qk_norm"
        )
    if fmt == "sglang" and (missing := sglang_misses(src)):
        raise ExportError(
            f"SGLang's EAGLE-3 layer computes none of {', '.join(missing)}, which this head uses: it would draft "
            "another head there; serve it with vLLM (format=vllm or format=speculators)"
        )
    sweep = sweep_for(vllm_sweep, fmt, f)
    exp = f.export(src)
    with temp_folder_beside(out, mode=0o755) as tmp:  # 755: an engine in a container may run as another user
        write(exp, src, f, dtype, tmp)
        token_map = TOKEN_MAP if exp.token_map is not None else None
        (tmp / "README.md").write_text(export_card(src, fmt, dtype, out.resolve(), token_map, sweep))
        check_export(tmp, src, fmt)
        move_into_place(tmp, out)
    return out


def validate(
    drafter: Path, fmt: str, out: Path, target_cfg: TargetConfig | None = None, gguf_target: str | None = None
) -> None:
    """Validate an existing export at OUT against the drafter it came from (check=true); writes nothing."""
    from draftsmith.serve.export.checks import check_export  # which imports this module

    src = read_source(Path(drafter).expanduser(), target_cfg or TargetConfig(), gguf_target)
    format_for(src.kind, fmt)
    if not Path(out).expanduser().is_dir():
        raise ExportError(f"out={out} is not a folder: nothing to check")
    check_export(Path(out).expanduser(), src, fmt)
