"""What every export format is made of: the drafter as an exporter reads it (Source), what an exporter returns
(Export), one format's exporter, validator pieces and engines (Format), and the lookup of a kind's formats."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch
from torch import Tensor, nn

from draftsmith.heads.drafter_folder import (
    TOKEN_COUNTS,
    TargetInfo,
    check_target,
    load_token_counts,
    read_drafter,
    read_meta,
)
from draftsmith.heads.head_base import HeadBase
from draftsmith.heads.kinds import KINDS, DraftShape, folder_shape, get, resolve
from draftsmith.runtime.llama import SUPPORTED_TYPES
from draftsmith.serve.models.loader import read_hf_config
from draftsmith.serve.models.target import SHORT_NAMES, TargetConfig, resolve_target, target_gguf, target_id

EXPORT_DTYPES = {short: name for name, short in SHORT_NAMES.items()}  # dtype=bf16 | fp16 | fp32 -> torch name

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)

TOKEN_MAP = "token_map.pt"  # SGLang's --speculative-token-map: the ids an EAGLE-2 draft's lm_head keeps (FR-Spec)


H = TypeVar("H", bound=nn.Module, covariant=True)  # the drafter's module: Source[Eagle3Head] in EAGLE-3's exporters


class ExportError(ValueError):
    """A user-fixable problem with the export's inputs, or an export that fails validation."""


@dataclass
class Source(Generic[H]):
    """What an exporter reads: the drafter (embedding / lm_head placeholders: those are never exported) and
    its target's folder and config.json. A bare `Source` holds any drafter's module."""

    folder: Path
    meta: dict
    head: H
    target_dir: Path
    target_hf: dict
    token_counts: Tensor | None = None  # the training answers' token counts, where the folder has them
    target_gguf: Path | None = None  # the GGUF llama.cpp runs as the target (format=gguf), where there is one

    @property
    def kind(self) -> str:
        return self.meta["kind"]

    @property
    def shape(self) -> DraftShape:
        """The draft the drafter was made for: what the card's serve commands ask for."""
        return folder_shape(self.meta)

    @property
    def formats(self) -> dict[str, Format]:
        return {name: resolve(ref) for name, ref in get(self.kind).formats.items()}


@dataclass
class Export:
    config: dict
    tensors: dict[str, dict[str, Tensor]]  # file name -> state dict
    copy: list[str] = field(default_factory=list)  # files copied from the target folder
    token_map: Tensor | None = None  # int64 ids, written as TOKEN_MAP


def no_problems(*_) -> list[str]:
    return []


# EAGLE-3 heads' norm switches, as vLLM's config.json names them: EAGLE-3.1's two, and speculators' residual norm.
# vLLM computes all three; SGLang's LlamaForCausalLMEagle3 none (it reads neither key nor input_norm weight).
NORM_SWITCHES = ("norm_before_fc", "norm_output", "norm_before_residual")


def sglang_misses(src: Source) -> list[str]:
    """The head's norm switches that are on: SGLang would draft without them (every output still the target's,
    acceptance lower) and says nothing."""
    return [k for k in NORM_SWITCHES if getattr(src.head.config, k, False)]


@dataclass(frozen=True)
class Format:
    """One export format of a kind: the exporter, what the validator checks (serve/export/checks.py: tables built
    from the drafter's own config, not from the exporter, and the format's forward in plain torch), and the
    engines that load it (the card's serve commands)."""

    export: Callable[[Source], Export]
    shapes: Callable[[Source, dict], dict[str, tuple[int, ...]]]  # (src, written config.json) -> name -> shape
    config: Callable[[Source], dict]  # config.json keys the engines read, with the values the drafter implies
    forward: Callable[[Source, Any], dict[str, tuple]]  # (src, checks.Probe) -> name -> (export's, drafter's)
    problems: Callable[[Source, Path, dict], list[str]] = no_problems  # more checks: (src, folder, config.json)
    tensor_checks: Callable[[Source, dict, torch.dtype], list[str]] = no_problems  # (src, tensors, export dtype)
    token_map: Callable[[Source], Tensor | None] | None = None  # the SGLang token map the exporter writes
    weights: str = "model.safetensors"  # the file the validator reads
    torch_dtype: bool = True  # config.json says the export's dtype
    target_types: tuple[str, ...] = SUPPORTED_TYPES  # target model_types its engines run these drafters with
    vllm: str = ""  # vLLM's speculative method for this folder ("": vLLM does not load it)
    vllm_alone: bool = False  # the folder names its target and method: `vllm serve OUT` serves it (speculators)
    vllm_options: tuple[tuple[str, Any], ...] = ()  # more --speculative-config keys vLLM needs for it
    vllm_depth: Callable[[Source], int] | None = None  # its num_speculative_tokens, where not the drafter's depth
    vllm_variants: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = ()  # more commands: (what for, keys added)
    sglang: str = ""  # SGLang's --speculative-algorithm ("": SGLang does not load it)
    tgi: bool = False  # TGI loads it
    hf: bool = False  # transformers loads it (assisted generation)
    llamacpp: str = ""  # llama.cpp's --spec-type for this file ("": llama.cpp does not load it)
    llamacpp_depth: Callable[[Source], int] | None = None  # its --spec-draft-n-max, where not the drafter's depth
    llamacpp_note: str = ""  # the card's sentence on what else llama.cpp's drafting with it does
    # a format that is not config.json + safetensors (GGUF): its own writer (export, source, dtype, folder) and
    # reader (folder -> (metadata, tensors)); its tensors may mix dtypes (llama.cpp keeps norms in float32)
    write_files: Callable[[Export, Source, torch.dtype, Path], None] | None = None
    read_files: Callable[[Path], tuple[dict, dict[str, Tensor]]] | None = None
    one_dtype: bool = True


def llama_head_config(src: Source[HeadBase], arch: str) -> dict:
    """The one-layer Llama config EAGLE heads are served with; rope as the target's config.json spells it."""
    c, t = src.head.config, src.target_hf
    config = {
        "architectures": [arch],
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "vocab_size": c.vocab_size,
        "max_position_embeddings": max(c.max_position_embeddings, t.get("max_position_embeddings", 0)),
        "tie_word_embeddings": False,
        "attention_bias": c.attention_bias,
        "mlp_bias": False,
        "bos_token_id": t.get("bos_token_id"),
        "eos_token_id": t.get("eos_token_id"),
        "rope_theta": c.rope_theta,  # legacy key (transformers 4 readers); rope_parameters wins where present
    }
    if c.rope_scaling:
        config["rope_scaling"] = c.rope_scaling
    if "rope_parameters" in t:
        config["rope_parameters"] = t["rope_parameters"]
    return config


def read_source(drafter: Path, target_cfg: TargetConfig, gguf_target: str | None = None) -> Source:
    """The drafter folder and its target, refused (ExportError) when missing, corrupt or mismatched.
    gguf_target: the target's GGUF for llama.cpp, where it is not the file the target was read from."""
    drafter = Path(drafter).expanduser()
    try:
        meta = read_meta(drafter)
    except (FileNotFoundError, ValueError) as e:
        raise ExportError(f"cannot export {drafter}: {e}") from e
    try:
        target_dir = resolve_target(target_cfg)
        hf = read_hf_config(target_dir)
    except (FileNotFoundError, ValueError) as e:
        raise ExportError(f"the target: {e}") from e
    try:
        info = TargetInfo(
            target_id(target_cfg, target_dir), hf["hidden_size"], hf["vocab_size"], hf["num_hidden_layers"]
        )
        check_target(meta, info, drafter)
        head = read_drafter(drafter, info).eval().requires_grad_(False)
        counts = load_token_counts(drafter, info.vocab_size) if (drafter / TOKEN_COUNTS).is_file() else None
    except FileNotFoundError as e:
        raise ExportError(f"cannot export {drafter}: {e}") from e
    except (KeyError, TypeError) as e:  # a config.json whose fields do not fit its kind
        raise ExportError(f"{drafter}/config.json is corrupt ({type(e).__name__}: {e}); re-train or re-save it") from e
    except ValueError as e:
        raise ExportError(str(e)) from e
    try:
        gguf = target_gguf(target_cfg, gguf_target)
    except FileNotFoundError as e:
        raise ExportError(f"the target: {e}") from e
    return Source(drafter, meta, head, target_dir, hf, counts, gguf)


def all_formats() -> list[str]:
    """Every format some registered kind exports to."""
    return list(dict.fromkeys(name for k in KINDS.values() for name in k.formats))


def check_format_name(fmt: str) -> None:
    if fmt not in all_formats():
        raise ExportError(f"unknown format {fmt!r}; choose one of {', '.join(all_formats())}")


def format_for(kind: str, fmt: str) -> Format:
    """The Format a kind registered under `fmt`, refused (ExportError) when it has none."""
    check_format_name(fmt)
    mine = get(kind).formats
    if fmt not in mine:
        can = ", ".join(f"{k.name}: {'/'.join(k.formats)}" for k in KINDS.values() if k.formats)
        raise ExportError(f"format={fmt} cannot hold {kind} drafters; use format={'|'.join(mine)} ({can})")
    return resolve(mine[fmt])
