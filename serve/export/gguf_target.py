"""The target as llama.cpp runs it: a GGUF file beside the drafter's GGUF. Which file that is, and the check that it
is the drafter's own target (same sizes, same tokens, same embedding) before anything is written or run.

A head is only as good as the target it was trained on: llama.cpp would load a head beside any GGUF of the same
width and draft garbage, so a GGUF target that differs from the drafter's is refused here, by name.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import torch
from safetensors import safe_open

from draftsmith.serve.export.base import ExportError
from draftsmith.serve.export.gguf_file import read_gguf

EMBED = "model.embed_tokens.weight"
# ||gguf - hf|| / ||hf|| of the token embedding: a 4-bit GGUF of the same weights is ~0.1 off, another model ~1.4
SAME_WEIGHTS = 0.3

CONVERT_HINT = (
    "convert your target with llama.cpp's converter (bash scripts/llamacpp_build.sh keeps it): "
    "python ~/.cache/draftsmith/llama.cpp/src/convert_hf_to_gguf.py TARGET_DIR --outtype f32 --outfile target.gguf"
)


def hf_vocab(target_dir: Path) -> list[str] | None:
    """The target tokenizer's token strings by id (tokenizer.json), None where it has no tokenizer.json."""
    path = target_dir / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True)
    tokens = [""] * (max(vocab.values()) + 1)
    for text, i in vocab.items():
        tokens[i] = text
    return tokens


def hf_merges(target_dir: Path) -> list[str] | None:
    """A BPE tokenizer's merges as GGUF writes them ("a b"), None for another tokenizer or none."""
    path = target_dir / "tokenizer.json"
    if not path.is_file():
        return None
    merges = json.loads(path.read_text()).get("model", {}).get("merges")
    if not isinstance(merges, list):
        return None
    return [m if isinstance(m, str) else " ".join(m) for m in merges]


def special_problems(meta: dict[str, gguf.GGUFValue], hf: dict) -> list[str]:
    """BOS / EOS ids, which llama.cpp stops and starts with, against the target's config.json."""
    problems = []
    for name in ("bos", "eos"):
        ours, theirs = hf.get(f"{name}_token_id"), meta.get(f"tokenizer.ggml.{name}_token_id")
        ours = ours[0] if isinstance(ours, list) and ours else ours
        if isinstance(ours, int) and theirs is not None and theirs.value != ours:
            problems.append(f"its {name.upper()} token is {theirs.value}, the target's {ours}")
    return problems


def hf_embedding(target_dir: Path) -> torch.Tensor | None:
    for file in sorted(target_dir.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            if EMBED in f.keys():
                return f.get_tensor(EMBED).float()
    return None


def mismatches(meta: dict[str, gguf.GGUFValue], embed: torch.Tensor | None, target_dir: Path, hf: dict) -> list[str]:
    arch = meta.get("general.architecture")
    if arch is None:
        return ["it has no general.architecture"]
    a = arch.value
    sizes = {"embedding_length": "hidden_size", "block_count": "num_hidden_layers"}
    problems = [
        f"{a}.{k}={meta[f'{a}.{k}'].value}, the drafter's target has {h}={hf[h]}"
        for k, h in sizes.items()
        if f"{a}.{k}" in meta and meta[f"{a}.{k}"].value != hf[h]
    ]
    tokens = meta["tokenizer.ggml.tokens"].value if "tokenizer.ggml.tokens" in meta else None
    if tokens is None:
        return problems + ["it has no tokenizer (tokenizer.ggml.tokens)"]
    if len(tokens) != hf["vocab_size"]:
        problems.append(f"its vocabulary has {len(tokens)} tokens, the drafter's target {hf['vocab_size']}")
    vocab = hf_vocab(target_dir)
    if vocab is not None:
        differ = [i for i, (x, y) in enumerate(zip(tokens, vocab, strict=False)) if x != y]  # sizes: checked above
        if differ:
            i = differ[0]
            problems.append(
                f"{len(differ)} token strings differ from the target's tokenizer.json (id {i}: "
                f"{tokens[i]!r} vs {vocab[i]!r})"
            )
    merges = hf_merges(target_dir)
    theirs = meta["tokenizer.ggml.merges"].value if "tokenizer.ggml.merges" in meta else None
    if merges is not None and theirs is not None and list(theirs) != merges:
        problems.append(f"its {len(theirs)} BPE merges differ from the target's {len(merges)} (tokenizer.json)")
    problems += special_problems(meta, hf)
    ours = hf_embedding(target_dir)
    if embed is not None and ours is not None and embed.shape == ours.shape:
        off = ((embed - ours).norm() / ours.norm().clamp_min(1e-12)).item()
        if off > SAME_WEIGHTS:
            problems.append(f"its token embedding is {off:.2f} (relative) away from the target's: other weights")
    return problems


def check_target_gguf(path: Path | None, target_dir: Path, hf: dict) -> dict[str, gguf.GGUFValue]:
    """The target GGUF's metadata once it is known to be the drafter's target; ExportError naming what differs."""
    if path is None:
        raise ExportError(
            f"format=gguf needs the target as a GGUF, which llama.cpp runs beside the head; the target "
            f"{target_dir} is an HF folder: {CONVERT_HINT}, then pass gguf_target=target.gguf"
        )
    if not path.is_file():
        raise ExportError(f"gguf_target={path} does not exist: {CONVERT_HINT}")
    try:
        meta, tensors = read_gguf(path, names=("token_embd.weight",))
    except ValueError as e:
        raise ExportError(f"gguf_target: {e}") from e
    problems = mismatches(meta, tensors.get("token_embd.weight"), target_dir, hf)
    if problems:
        raise ExportError(
            f"gguf_target={path} is not the drafter's target {target_dir}: "
            + "; ".join(problems)
            + f". Give the GGUF of that target ({CONVERT_HINT})"
        )
    return meta
