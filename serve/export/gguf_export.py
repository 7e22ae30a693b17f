"""What every head's llama.cpp export (format=gguf) shares: one GGUF of llama.cpp's architecture for the kind, the
llama-style keys and decoder-layer tensor names llama.cpp's converter writes for every such head, the target GGUF's
tokenizer (llama.cpp pairs draft and target by vocabulary), and the Format pieces that write the file, read it back
and compare its keys with what the drafter implies. Each kind's export_<kind>_gguf.py adds its own keys, tensors,
refusals and the validator's forward."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from torch import Tensor

from draftsmith.serve.export.base import Export, ExportError, Source
from draftsmith.serve.export.gguf_file import FILE_TYPES, gguf_value, plain, read_gguf, write_gguf
from draftsmith.serve.export.gguf_target import check_target_gguf

LAYER = {  # an HF decoder layer's tensors -> llama.cpp's blk.{i}.<name>
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}

# the targets' model_types whose llama.cpp graphs expose the layer inputs a head reads (llama_set_embeddings_layer_inp:
# src/models/llama.cpp and qwen3.cpp set res->t_layer_inp; qwen2.cpp does not, and llama.cpp aborts on a null one);
# HF's mistral converts to llama.cpp's llama
LLAMACPP_TARGETS = ("llama", "mistral", "qwen3")

Metadata = Callable[[Source, torch.dtype], dict[str, gguf.GGUFValue]]  # a kind's keys, typed, in the converter's order


def f32(x: float) -> float:
    """A float as GGUF stores it (float32), so the validator compares what llama.cpp reads."""
    return float(np.float32(x))


def llama_metadata(
    arch: str, src: Source, block_count: int, dtype: torch.dtype, lead: dict[str, Any], tail: dict[str, Any]
) -> dict[str, gguf.GGUFValue]:
    """The keys llama.cpp's converter writes for a head of Llama-style layers, typed, in its order: the kind's `lead`
    keys, the sizes, rope and eps, file_type, the kind's `tail` keys, quantization_version (the tokenizer's come
    after)."""
    c, t = src.head.config, src.target_hf
    keys = lead | {
        "general.type": "model",
        "general.name": f"{src.meta['target']['id']} {arch} drafter",
        f"{arch}.block_count": block_count,
        f"{arch}.context_length": max(c.max_position_embeddings, t.get("max_position_embeddings", 0)),
        f"{arch}.embedding_length": c.hidden_size,
        f"{arch}.feed_forward_length": c.intermediate_size,
        f"{arch}.attention.head_count": c.num_attention_heads,
        f"{arch}.attention.head_count_kv": c.num_key_value_heads,
        f"{arch}.rope.freq_base": f32(c.rope_theta),
        f"{arch}.attention.layer_norm_rms_epsilon": f32(c.rms_norm_eps),
        f"{arch}.attention.key_length": c.head_dim,
        f"{arch}.attention.value_length": c.head_dim,
        "general.file_type": FILE_TYPES[dtype],
    }
    return typed(keys | tail | {"general.quantization_version": 2})


def layer_problems(src: Source, layers: tuple[int, ...]) -> list[str]:
    """The target layers llama.cpp cannot hand a head: past the target's last layer's input."""
    last = src.target_hf["num_hidden_layers"]
    if max(layers) < last:
        return []
    return [
        f"it reads target layer {last} (the last layer's output); llama.cpp hands a head the inputs of layers "
        f"0..{last - 1} only (its llama and qwen3 graphs set no layer input {last})"
    ]


def typed(keys: dict[str, Any]) -> dict[str, gguf.GGUFValue]:
    return {k: gguf_value(v) for k, v in keys.items()}


def tokenizer_keys(meta: dict[str, gguf.GGUFValue]) -> dict[str, gguf.GGUFValue]:
    return {k: v for k, v in meta.items() if k.startswith("tokenizer.")}


def head_gguf(
    src: Source, file: str, reasons: list[str], tensors: Callable[[], dict[str, Tensor]], more: dict
) -> Export:
    """The export of a head llama.cpp can run (else ExportError naming every reason, the kind's and those of its
    target layers), beside a target GGUF that is the drafter's target: its config holds the target GGUF's tokenizer
    keys, then `more` tokenizer keys."""
    reasons = reasons + layer_problems(src, src.head.config.target_layers)
    if reasons:
        raise ExportError(f"llama.cpp cannot run {src.folder} as a draft ({src.kind}): " + "; ".join(reasons))
    target = check_target_gguf(src.target_gguf, src.target_dir, src.target_hf)
    return Export(tokenizer_keys(target) | typed(more), {file: tensors()})


def tokenizer_problems(src: Source, config: dict, more: dict[str, Any]) -> list[str]:
    """The export's tokenizer is the target GGUF's key for key (llama.cpp pairs draft and target by vocabulary),
    with `more` keys (DFlash's mask token)."""
    try:
        target = check_target_gguf(src.target_gguf, src.target_dir, src.target_hf)
    except ExportError as e:
        return [str(e)]
    want = plain(tokenizer_keys(target)) | more
    ours = {k: v for k, v in config.items() if k.startswith("tokenizer.")}
    keys = sorted(want.keys() | ours.keys())
    return [f"{k} differs from the target GGUF's" for k in keys if want.get(k) != ours.get(k)]


def type_problems(path: Path, expected: dict[str, gguf.GGUFValue]) -> list[str]:
    """Keys of the right value but another GGUF type: llama.cpp refuses to load them ("wrong type i32 but expected
    type u32")."""
    meta, _ = read_gguf(path, names=())
    return [
        f"GGUF metadata {k} is {kind(meta[k])}, llama.cpp reads {kind(v)}"
        for k, v in expected.items()
        if k in meta and (meta[k].type, meta[k].sub_type) != (v.type, v.sub_type)
    ]


def kind(v: gguf.GGUFValue) -> str:
    return v.type.name + (f" of {v.sub_type.name}" if v.sub_type is not None else "")


def no_keys(src: Source) -> dict[str, Any]:
    return {}


def gguf_files(
    arch: str, file: str, metadata: Metadata, tokens: Callable[[Source], dict[str, Any]] = no_keys
) -> dict[str, Any]:
    """A Format's fields for one GGUF file: its writer (the kind's keys, then the export's tokenizer keys), its
    reader, the keys the validator expects (general.file_type aside: it says the export's dtype) and its further
    checks: no architecture key the drafter does not imply (llama.cpp would read it: dflash.attention.causal), the
    target GGUF's tokenizer with the kind's `tokens` keys."""

    def write(exp: Export, src: Source, dtype: torch.dtype, folder: Path) -> None:
        write_gguf(folder / file, arch, metadata(src, dtype) | exp.config, exp.tensors[file], dtype)

    def read(folder: Path) -> tuple[dict, dict[str, Tensor]]:
        path = folder / file
        if not path.is_file():
            raise ExportError(f"export {folder} is incomplete: {file} is missing")
        try:
            meta, tensors = read_gguf(path)
        except ValueError as e:
            raise ExportError(f"export {folder} is corrupt: {e}") from e
        return plain(meta), tensors

    def config(src: Source) -> dict:
        keys = metadata(src, torch.float32)
        return {"general.architecture": arch} | {k: v.value for k, v in keys.items() if k != "general.file_type"}

    def problems(src: Source, folder: Path, written: dict) -> list[str]:
        expected = config(src)
        unexpected = [k for k in sorted(written) if k.startswith(f"{arch}.") and k not in expected]
        typed_keys = metadata(src, torch.float32) | typed(tokens(src))
        problems = [f"unexpected GGUF metadata {k}" for k in unexpected] + type_problems(folder / file, typed_keys)
        return problems + tokenizer_problems(src, written, tokens(src))

    return dict(
        write_files=write,
        read_files=read,
        config=config,
        problems=problems,
        weights=file,
        torch_dtype=False,
        one_dtype=False,
        target_types=LLAMACPP_TARGETS,
    )
