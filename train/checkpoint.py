"""Training checkpoints: OUT/checkpoints/step-NNNNNNN/, each written to a temp folder and renamed.

A checkpoint holds a drafter folder of the head as it stands (drafter/: config.json, model.safetensors
and a model card, so `spec.drafter=OUT/checkpoints/step-N/drafter` evaluates a long run mid-way), the
optimizer and LR-schedule state (optimizer.pt, read back with torch.load(weights_only=True): tensors and
plain values only), each process's RNG state (rng-RANK.pt) and trainer.json (step, tokens, the settings
that fix the data order). Resuming takes the newest one that loads; a corrupt one is named and skipped.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from draftsmith.files import move_into_place
from draftsmith.heads.drafter_folder import own_state

PREFIX = "step-"
DRAFTER = "drafter"


@dataclass
class State:
    step: int
    tokens: int
    wandb_id: str | None = None
    tau: float | None = None  # the last in-training acceptance eval, as the checkpoint's drafter card has it
    seconds: float = 0.0  # wall time in the training loop up to the last step, over every resumed piece
    stages: dict = field(default_factory=dict)  # regeneration and features as the run's first piece measured them


def checkpoints(out: Path) -> list[Path]:
    """Finished checkpoints, newest first."""
    folder = Path(out) / "checkpoints"
    return sorted(folder.glob(f"{PREFIX}*"), reverse=True) if folder.is_dir() else []


def save(
    out: Path,
    state: State,
    write_drafter: Callable[[Path], Path],
    optimizer,
    scheduler,
    fingerprint: dict,
    rank: int,
    barrier,
    keep: int,
    engine=None,
) -> Path:
    """All processes call this (each writes its RNG state); the main one writes the rest and renames.
    write_drafter(folder): the head as a drafter folder. engine: the Accelerator under DeepSpeed, whose
    ZeRO-sharded model and optimizer only it can save (engine/: DeepSpeed's own checkpoint, a file per process)."""
    folder = Path(out) / "checkpoints"
    final, tmp = folder / f"{PREFIX}{state.step:07d}", folder / f".tmp-{PREFIX}{state.step:07d}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    torch.save(rng_state(), tmp / f"rng-{rank}.pt")
    if engine is not None:
        engine.save_state(str(tmp / "engine"))
    barrier()
    if rank == 0:
        write_drafter(tmp / DRAFTER)
        optim = {} if engine is not None else {"optimizer": optimizer.state_dict()}
        torch.save({**optim, "scheduler": scheduler.state_dict()}, tmp / "optimizer.pt")
        meta: dict[str, Any] = {"step": state.step, "tokens": state.tokens, "wandb_id": state.wandb_id}
        meta |= {"fingerprint": fingerprint, "seconds": round(state.seconds, 3), "stages": state.stages}
        (tmp / "trainer.json").write_text(json.dumps(meta, indent=2) + "\n")
        move_into_place(tmp, final)
        for old in checkpoints(out)[keep:]:
            shutil.rmtree(old)
    barrier()
    return final


def rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def load_latest(
    out: Path, head: nn.Module, optimizer, scheduler, fingerprint: dict, rank: int, log, engine=None
) -> State | None:
    """Restore the newest checkpoint that loads; corrupt ones are named in the log and skipped (kept on
    disk). None when there is none; an error when all are corrupt or were made with other settings."""
    found = checkpoints(out)
    failures = []
    for folder in found:
        try:
            loaded = read(folder, head, rank, fingerprint)
        except Refusal:  # a good checkpoint made for other settings: not corrupt, and not to be skipped
            raise
        except Exception as e:  # a truncated or garbled file: any reader may raise
            failures.append(f"{folder} ({brief(e)})")
            log(f"checkpoint {folder} is corrupt ({brief(e)}); falling back to the previous one")
            continue
        if engine is not None:  # the engine's own checkpoint holds the weights (ZeRO-3: this process's shard)
            # DeepSpeed's loader unpickles (torch.load weights_only=False): it reads only files this run wrote
            engine.load_state(str(folder / "engine"))
        else:
            head.load_state_dict(loaded["head"], strict=False)
            optimizer.load_state_dict(loaded["optim"]["optimizer"])
        scheduler.load_state_dict(loaded["optim"]["scheduler"])
        torch.set_rng_state(loaded["rng"]["cpu"])
        if "cuda" in loaded["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state(loaded["rng"]["cuda"])
        meta = loaded["meta"]
        log(f"resumed from {folder} at step {meta['step']}")
        stages = meta.get("stages", {})
        return State(meta["step"], meta["tokens"], meta["wandb_id"], loaded["tau"], meta.get("seconds", 0.0), stages)
    if failures:
        raise ValueError(
            "no usable checkpoint: " + "; ".join(failures) + ". Delete them to start over, or restore a good copy"
        )
    return None


def brief(e: Exception) -> str:
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:150]}"


def read(folder: Path, head: nn.Module, rank: int, fingerprint: dict) -> dict:
    """Everything a checkpoint holds, checked against the settings, then the head, before anything is applied."""
    meta = json.loads((folder / "trainer.json").read_text())
    check_fingerprint(folder, meta["fingerprint"], fingerprint)  # first: another head size is a settings change
    state = load_file(str(folder / DRAFTER / "model.safetensors"))
    expected = own_shapes(head)
    if state.keys() != expected.keys():
        misfit(folder, f"weights {sorted(state.keys() ^ expected.keys())[:3]} do not match the head's")
    for k, v in state.items():
        if v.shape != expected[k]:
            misfit(folder, f"{k} has shape {tuple(v.shape)}, the head has {tuple(expected[k])}")
    optim = torch.load(folder / "optimizer.pt", map_location="cpu", weights_only=True)
    rng = torch.load(folder / f"rng-{rank}.pt", weights_only=True)
    return {"meta": meta, "head": state, "optim": optim, "rng": rng, "tau": measured_tau(folder / DRAFTER)}


def measured_tau(drafter: Path) -> float | None:
    return json.loads((drafter / "config.json").read_text())["recipe"]["acceptance"].get("mean_acceptance_length")


class Refusal(ValueError):
    """A good checkpoint this run cannot resume from: never skipped as corrupt."""


def misfit(folder: Path, detail: str) -> None:
    raise Refusal(
        f"checkpoint {folder} does not fit the head this run builds ({detail}): it was made with other head "
        "settings or code; restore them, or train into another out folder"
    )


def own_shapes(head: nn.Module) -> dict[str, torch.Size]:
    """ZeRO-3 leaves each process a shard of a parameter; ds_shape is its full shape."""
    params = dict(head.named_parameters())
    return {k: getattr(params.get(k), "ds_shape", v.shape) for k, v in own_state(head).items()}


# settings a fingerprint leaves out at their default, so that a checkpoint made before they existed still resumes:
# one without them was made with the default, not by an earlier draftsmith
OMITTED_AT_DEFAULT: dict[str, Any] = {"optimizer": "adamw", "schedule": "cosine", "group_by_length": False}


def check_fingerprint(folder: Path, saved: dict, current: dict) -> None:
    saved, current = OMITTED_AT_DEFAULT | saved, OMITTED_AT_DEFAULT | current
    unknown = sorted(current.keys() - saved.keys())
    if unknown:  # a setting this version records that the checkpoint's version did not: nothing to restore
        raise Refusal(
            f"checkpoint {folder} was written by an earlier draftsmith, whose fingerprint lacks "
            f"{', '.join(unknown)}: it cannot be resumed; train into another out folder"
        )
    diff = sorted(k for k in saved.keys() | current.keys() if saved.get(k) != current.get(k))
    if diff:
        detail = ", ".join(f"{k}: {saved.get(k)!r} then, {current.get(k)!r} now" for k in diff)
        raise Refusal(
            f"checkpoint {folder} was made with other settings ({detail}); resume=true needs the same settings "
            "(they fix the data order and schedule): restore them, or train into another out folder"
        )
