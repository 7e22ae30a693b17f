"""Load an HF safetensors folder into the runner, with errors that say what is wrong."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from draftsmith.cpu_kernels import panels
from draftsmith.cpu_kernels.packed import pack_linears
from draftsmith.runtime.llama import ModelConfig, Transformer

log = logging.getLogger(__name__)


def read_hf_config(folder: Path) -> dict:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: a target folder needs config.json and *.safetensors")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); re-export or re-download the model") from e
    if not isinstance(config, dict):
        raise ValueError(f"{path} holds a JSON {type(config).__name__}, not an object: no model or drafter config")
    return config


SIDE_FILES = {"token_counts.safetensors"}  # a draftsmith drafter's draft-vocabulary counts: not weights


def weight_files(folder: Path) -> list[Path]:
    """The folder's weight files: those its index lists (others are never read, as transformers does: Mistral's
    repos ship consolidated.safetensors beside the shards), else its one *.safetensors. Several without an index
    are refused, naming them: merged in, a stray copy of a tensor would silently override the real one."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / n for n in names]
    else:
        files = sorted(f for f in folder.glob("*.safetensors") if f.name not in SIDE_FILES)
        if len(files) > 1:
            listed = ", ".join(f.name for f in files)
            raise ValueError(
                f"{folder}: {len(files)} weight files ({listed}) and no model.safetensors.index.json to say which "
                "tensor lives where; keep one (model.safetensors) or add the index save_pretrained writes"
            )
    if not files:
        pickles = ", ".join(sorted(f.name for f in folder.glob("*.bin")))
        why = f" ({pickles}: pickles, which draftsmith never loads)" if pickles else ""
        raise FileNotFoundError(
            f"no *.safetensors weights in {folder}{why}; save the model with save_pretrained(), which writes "
            "safetensors"
        )
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"{f} is listed in the index but missing; the download is incomplete")
    return files


def load_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's weight files; a tensor two files hold is refused (one would override the other)."""
    state: dict[str, torch.Tensor] = {}
    for f in weight_files(folder):
        try:
            part = load_file(str(f))
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{f} is corrupt or not a safetensors file ({e}); re-create it") from e
        if twice := sorted(state.keys() & part.keys()):
            raise ValueError(f"{f} holds {len(twice)} tensors another weight file holds too, e.g. {twice[:3]}")
        state.update(part)
    return state


def load_model(
    folder: Path, dtype: torch.dtype = torch.float32, device: str = "cpu", pack: bool = True, decode: bool = True
) -> Transformer:
    """A frozen model for inference; pack: prepacked linears on CPU (cpu_kernels/packed.py). decode: a bf16 model for
    the engine's batch-1 steps runs in fp32 where draftsmith's CPU kernels do (fp32_arithmetic; unpacked, on torch's
    fp32 linears); False (prefill-bound offline work) keeps torch's bf16 ops."""
    cfg = ModelConfig.from_hf(read_hf_config(folder))
    state = load_state_dict(folder)
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to_empty(device=device)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        model.lm_head.weight = model.model.embed_tokens.weight
    expected = {k for k in model.state_dict() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    missing = sorted(expected - state.keys())
    if missing:
        raise ValueError(f"{folder}: weights missing for {len(missing)} parameters, e.g. {missing[:3]}")
    unexpected = sorted(k for k in state.keys() - expected if not k.endswith("rotary_emb.inv_freq"))
    if unexpected:  # e.g. biases the config does not announce: dropping them would change the logits
        raise ValueError(f"{folder}: {len(unexpected)} weights have no slot in the runner: {unexpected[:3]}")
    for name, param in model.state_dict().items():
        if name in state and state[name].shape != param.shape:
            raise ValueError(
                f"{folder}: {name} has shape {tuple(state[name].shape)}, config implies {tuple(param.shape)}"
            )
    model.load_state_dict(state, strict=False)
    model.rope_cache(cfg.max_position_embeddings)
    if decode and fp32_arithmetic(dtype, device):
        round_weights(model, dtype)
        model.narrowed_to, dtype = dtype, torch.float32
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    if pack:
        pack_linears(model)
    if why := model.choose_path():
        log.info("%s: %s", folder.name, why)
    return model


def fp32_arithmetic(dtype: torch.dtype, device: str | torch.device) -> bool:
    """bf16 weights on a CPU where draftsmith's fp32 kernels run: they stream bf16 panels as fast as the memory gives
    and compute in fp32, faster than torch's eager or compiled bf16 (docs/benchmarks.md); the same bf16 bytes, with
    activations, KV cache and rope in fp32 (as
    llama.cpp runs a bf16 file). The model keeps its fp32 parameters beside the panels: 1.5x torch's bf16 weight
    memory. Not where the panels would hold fp32 (DRAFTSMITH_PANELS=fp32, or a kernel that failed its self-check):
    twice bf16's bytes."""
    if dtype != torch.bfloat16 or torch.device(device).type != "cpu":
        return False
    return panels.available() and panels.setting() == "exact"  # available: the kernel library loaded, and checked


def round_weights(model: Transformer, dtype: torch.dtype) -> None:
    """Every parameter rounded to `dtype`'s values, kept in its own dtype; buffers (the rope tables) untouched."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(dtype))
