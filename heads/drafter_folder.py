"""The drafter folder: config.json (kind, target, sizes, recipe, the draft shape it was made for) +
model.safetensors + README.md, and token_counts.safetensors (how often each target token occurs in the training
answers) when training wrote it.

Every drafter kind registers its config dataclass and module class in heads/kinds.py, so training, the
engine and export load any folder the same way, and a drafter made for another target is
refused before anything runs.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypeVar

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from draftsmith.files import move_into_place, temp_folder_beside

from .kinds import KINDS, DraftShape, get

M = TypeVar("M", bound=nn.Module)

FORMAT_VERSION = 1
TOKEN_COUNTS = "token_counts.safetensors"


@dataclass
class TargetInfo:
    """What a drafter must agree on with its target."""

    id: str  # name@sha256(config.json)[:8], as serve.target.target_id gives: the name is for display only
    hidden_size: int
    vocab_size: int
    num_layers: int


@dataclass
class Recipe:
    """How the drafter was made: goes into config.json and the model card."""

    data: str = ""
    steps: int = 0
    tokens: int = 0
    extra: dict = field(default_factory=dict)
    acceptance: dict = field(default_factory=dict)  # measured tau etc., filled in by training's eval


def save_drafter(
    head: nn.Module,
    config,
    kind: str,
    info: TargetInfo,
    recipe: Recipe,
    out: Path,
    token_counts: torch.Tensor | None = None,
    weights: dict[str, torch.Tensor] | None = None,
    draft: DraftShape | None = None,
) -> Path:
    """Write the folder to a temp dir beside `out`, then rename it into place (never half-written).
    token_counts [vocab]: target-token counts over the training answers, for serve-time draft vocabularies.
    weights: the head's own state where its module does not hold it whole (DeepSpeed); default own_state(head).
    draft: the shape the drafter is made for (unset fields: the kind's default), what the engine drafts by default."""
    out = Path(out)
    shape = get(kind).shape(draft or DraftShape())
    with temp_folder_beside(out) as tmp:
        meta = {
            "format_version": FORMAT_VERSION,
            "kind": kind,
            "target": asdict(info),
            "config": asdict(config),
            "recipe": asdict(recipe),
            "draft": asdict(shape),
        }
        (tmp / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
        state = {k: v.detach().contiguous().cpu() for k, v in (weights or own_state(head)).items()}
        save_file(state, str(tmp / "model.safetensors"), metadata={"kind": kind, "target": info.id})
        (tmp / "README.md").write_text(drafter_card(kind, info, config, recipe, shape))
        if token_counts is not None:
            save_file({"counts": token_counts.detach().long().cpu().contiguous()}, str(tmp / TOKEN_COUNTS))
        move_into_place(tmp, out)
    return out


def own_state(head: nn.Module) -> dict[str, torch.Tensor]:
    """The head's own weights: frozen target pieces it borrows (embedding, lm_head) are not saved twice."""
    shared = getattr(head, "shared_prefixes", ())
    return {k: v for k, v in head.state_dict().items() if not k.startswith(tuple(shared))}


DRAFTER_HOLDS = 'a drafter folder holds config.json with "kind" and model.safetensors, as draftsmith-train writes it'


def read_meta(folder: Path) -> dict:
    folder = Path(folder)
    path = folder / "config.json"
    if not folder.is_dir():
        raise FileNotFoundError(f"drafter folder {folder} does not exist")
    if not path.is_file() and gguf_export(folder):
        raise FileNotFoundError(gguf_export(folder))
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: {folder} is not a draftsmith drafter folder ({DRAFTER_HOLDS})")
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); re-export the drafter") from e
    if not isinstance(meta, dict) or meta.get("kind") is None:
        raise ValueError(not_a_drafter(folder, meta))
    kind = KINDS.get(meta["kind"]) if isinstance(meta["kind"], str) else None
    if kind is None or not kind.trained:
        known = ", ".join(k.name for k in KINDS.values() if k.trained)
        raise ValueError(f"{path}: unknown drafter kind {meta.get('kind')!r}; known: {known}")
    return meta


def gguf_export(folder: Path) -> str:
    """Why a folder of GGUF files (a format=gguf export) is no drafter here; "" for any other folder."""
    ggufs = sorted(p.name for p in Path(folder).glob("*.gguf"))
    if not ggufs:
        return ""
    return (
        f"{folder} holds {', '.join(ggufs)}: a GGUF for llama.cpp (format=gguf), which draftsmith's engine does "
        "not run; pass the draftsmith drafter folder it was exported from (its README.md names it)"
    )


def not_a_drafter(folder: Path, config: object) -> str:
    """Why a folder whose config.json names no draftsmith kind (an export, say) is not taken as a drafter."""
    archs = config.get("architectures") if isinstance(config, dict) else None
    archs = [archs] if isinstance(archs, str) else archs if isinstance(archs, list) else []
    what = "/".join(map(str, archs)) or "its config.json"
    return (
        f"{folder} is no draftsmith drafter folder ({what} names no draftsmith kind): pass the draftsmith drafter "
        "folder it was exported from (of exports, only EAGLE-3 layouts run, with spec=eagle3, and format=hf draft "
        "models, with spec=draft_model)"
    )


def check_target(meta: dict, info: TargetInfo, folder: Path) -> None:
    """Refuse a drafter trained for another target, naming both."""
    saved = meta["target"]
    for key in ("hidden_size", "vocab_size"):
        if saved[key] != getattr(info, key):
            raise ValueError(
                f"drafter {folder} was made for target {saved['id']} with {key}={saved[key]}, but the target "
                f"{info.id} has {key}={getattr(info, key)}: train a drafter for this target"
            )
    if config_hash(saved["id"]) != config_hash(info.id):
        raise ValueError(
            f"drafter {folder} was made for target {saved['id']}, not {info.id} (their config.json differ): "
            "train a drafter for this target"
        )


def config_hash(target_id: str) -> str:
    """What identifies a target: the hash of its config.json, not the name before `@` (a copied or renamed
    target folder is the same target)."""
    return target_id.rsplit("@", 1)[-1]


def read_drafter(folder: Path, info: TargetInfo, *shared, device="cpu", dtype=torch.float32) -> nn.Module:
    """Build the module of the folder's kind and load its weights. `shared`: target pieces the kind
    borrows (passed to its constructor after the config), e.g. the target model for EAGLE's lm_head."""
    folder = Path(folder)
    meta = read_meta(folder)
    check_target(meta, info, folder)
    kind = get(meta["kind"])
    assert kind.module is not None and kind.config is not None, "a drafter folder is of a trained kind"
    head = kind.module(kind.config(**meta["config"]), *shared)
    weights = folder / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"{weights} is missing; the drafter folder is incomplete")
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{weights} is corrupt or not a safetensors file ({e}); re-train or re-export") from e
    expected = own_state(head)
    missing, unexpected = sorted(expected.keys() - state.keys()), sorted(state.keys() - expected.keys())
    if missing or unexpected:
        raise ValueError(
            f"{weights} does not fit a {meta['kind']} drafter: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    for k, v in state.items():
        if v.shape != expected[k].shape:
            raise ValueError(
                f"{weights}: {k} has shape {tuple(v.shape)}, the config implies {tuple(expected[k].shape)}"
            )
    head.load_state_dict(state, strict=False)
    return cast_own(head.to(device=device), dtype)


def load_token_counts(folder: Path, vocab_size: int) -> torch.Tensor:
    """The training answers' token counts [vocab] the folder holds."""
    path = Path(folder) / TOKEN_COUNTS
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: drafter {folder} holds no token counts (it was saved without them); "
            "retrain it, or draft over the full vocabulary (spec.draft_vocab=0)"
        )
    try:
        counts = load_file(str(path))["counts"]
    except (SafetensorError, OSError, KeyError) as e:
        raise ValueError(
            f"{path} is corrupt ({e}); retrain the drafter, or delete the file and draft over the full vocabulary "
            "(spec.draft_vocab=0)"
        ) from e
    if counts.shape != (vocab_size,):
        raise ValueError(f"{path} counts {tuple(counts.shape)} tokens, the target's vocabulary is {vocab_size}")
    return counts


def frequent_ids(counts: torch.Tensor, n: int) -> torch.Tensor:
    """The n most frequent token ids (ties: the lower id), sorted by id."""
    if not 0 < n <= counts.numel():
        raise ValueError(f"a draft vocabulary must hold 1 to {counts.numel()} tokens, got {n}")
    return torch.sort(counts, descending=True, stable=True).indices[:n].sort().values


def restricted_linear(linear: nn.Linear, ids: torch.Tensor, dtype: torch.dtype) -> nn.Linear:
    """A frozen bias-free linear of `linear`'s output rows `ids`."""
    w = linear.weight.detach()
    out = nn.Linear(w.shape[1], ids.numel(), bias=False, device=w.device, dtype=dtype)
    out.weight.data.copy_(w[ids.to(w.device)])
    return out.requires_grad_(False)


def cast_own(head: M, dtype: torch.dtype) -> M:
    """Cast the head's own parameters, not the target pieces it borrows: a bf16 drafter can serve an fp32
    target. Buffers stay as they are (vocab maps, fp32 rope tables)."""
    shared = tuple(getattr(head, "shared_prefixes", ()))
    for name, p in head.named_parameters():
        if not name.startswith(shared) and p.is_floating_point():
            p.data = p.data.to(dtype)
    return head


def drafter_card(kind: str, info: TargetInfo, config, recipe: Recipe, shape: DraftShape) -> str:
    acc = recipe.acceptance
    measured = (
        f"Measured: mean acceptance length {acc['mean_acceptance_length']:.2f}"
        + (f", speedup {acc['speedup']:.2f}x" if "speedup" in acc else "")
        + (f" ({acc['source']})" if "source" in acc else "")
        if "mean_acceptance_length" in acc
        else "Acceptance not measured yet: run draftsmith-eval with this drafter."
    )
    sizes = ", ".join(f"{k}={v}" for k, v in asdict(config).items())
    return (
        f"# draftsmith {kind} drafter\n\n"
        f"- target: `{info.id}` (hidden {info.hidden_size}, vocab {info.vocab_size}, "
        f"{info.num_layers} layers)\n"
        f"- drafter: {kind} ({sizes})\n"
        f"- recipe: data {recipe.data or 'n/a'}, {recipe.steps} steps, {recipe.tokens} tokens {recipe.extra or ''}\n\n"
        f"{measured}\n\n"
        f"Use: `draftsmith-eval spec={get(kind).name} spec.drafter=THIS_FOLDER ...`. It drafts {shape_text(shape)} "
        "(the shape it was made for) unless the spec sets its own (spec.num_tokens=K, ...).\n"
    )


def shape_text(shape: DraftShape) -> str:
    if shape.choices is not None:
        return f"a static tree of {len(shape.choices)} nodes (depth <= {shape.num_tokens})"
    if shape.topk == 1:
        return f"a chain of {shape.num_tokens}"
    kept = f", keeping {shape.total_tokens} nodes" if shape.total_tokens else ""
    return f"a tree of depth {shape.num_tokens} with {shape.topk} children per node{kept}"
