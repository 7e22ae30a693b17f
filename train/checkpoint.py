"""Training checkpoints: OUT/checkpoints/step-NNNNNNN/, each written to a temp folder and renamed.

A checkpoint holds a drafter folder of the head as it stands (drafter/: config.json, model.safetensors
and a model card, so `spec.drafter=OUT/checkpoints/step-N/drafter` evaluates a long run mid-way), the
optimizer and LR-schedule state (optimizer.pt, read back with torch.load(weights_only=True): tensors and
plain values only), each process's RNG state (rng-RANK.pt) and trainer.json (step, tokens, the settings
that fix the data order). Resuming takes the newest one that loads; a corrupt one is named and skipped.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from draftsmith.heads.drafter import own_state

PREFIX = "step-"
DRAFTER = "drafter"


@dataclass
class State:
    step: int
    tokens: int
    wandb_id: str | None = None


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
        meta = {"step": state.step, "tokens": state.tokens, "wandb_id": state.wandb_id, "fingerprint": fingerprint}
        (tmp / "trainer.json").write_text(json.dumps(meta, indent=2) + "\n")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
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
            loaded = read(folder, head, rank)
        except Exception as e:  # a truncated or garbled file: any reader may raise
            failures.append(f"{folder} ({brief(e)})")
            log(f"checkpoint {folder} is corrupt ({brief(e)}); falling back to the previous one")
            continue
        check_fingerprint(folder, loaded["meta"]["fingerprint"], fingerprint)
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
        return State(meta["step"], meta["tokens"], meta.get("wandb_id"))
    if failures:
        raise ValueError(
            "no usable checkpoint: " + "; ".join(failures) + ". Delete them to start over, or restore a good copy"
        )
    return None


def brief(e: Exception) -> str:
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:150]}"


def read(folder: Path, head: nn.Module, rank: int) -> dict:
    """Everything a checkpoint holds, checked against the head, before anything is applied."""
    meta = json.loads((folder / "trainer.json").read_text())
    weights = folder / DRAFTER / "model.safetensors"
    state = load_file(str(weights if weights.is_file() else folder / "head.safetensors"))  # older: head.safetensors
    expected = own_shapes(head)
    if state.keys() != expected.keys():
        raise ValueError(f"its weights do not match the head: {sorted(state.keys() ^ expected.keys())[:3]}")
    for k, v in state.items():
        if v.shape != expected[k]:
            raise ValueError(f"{k} has shape {tuple(v.shape)}, the head has {tuple(expected[k])}")
    optim = torch.load(folder / "optimizer.pt", map_location="cpu", weights_only=True)
    rng = torch.load(folder / f"rng-{rank}.pt", weights_only=True)
    return {"meta": meta, "head": state, "optim": optim, "rng": rng}


def own_shapes(head: nn.Module) -> dict[str, torch.Size]:
    """ZeRO-3 leaves each process a shard of a parameter; ds_shape is its full shape."""
    params = dict(head.named_parameters())
    return {k: getattr(params.get(k), "ds_shape", v.shape) for k, v in own_state(head).items()}


def check_fingerprint(folder: Path, saved: dict, current: dict) -> None:
    diff = sorted(k for k in saved.keys() | current.keys() if saved.get(k) != current.get(k))
    if diff:
        detail = ", ".join(f"{k}: {saved.get(k)!r} then, {current.get(k)!r} now" for k in diff)
        raise ValueError(
            f"checkpoint {folder} was made with other settings ({detail}); resume=true needs the same settings "
            "(they fix the data order and schedule): restore them, or train into another out folder"
        )
