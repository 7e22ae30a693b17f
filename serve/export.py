"""Export a drafter folder to the formats serving engines load: vLLM, SGLang, TGI, HF.

Each kind names its formats in its registry record (heads/kinds.py), each a Format (serve/formats.py for the
built-in ones): an exporter returning the export's config.json, its safetensors files and the target files to
copy, and the validator's pieces. `export` writes them to a temp folder beside OUT, validates the result
(serve/export_check.py) and only then renames it into place, so a failed export leaves nothing behind.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from draftsmith.heads.drafter import (
    TOKEN_COUNTS,
    TargetInfo,
    check_target,
    frequent_ids,
    load_drafter,
    load_token_counts,
    own_state,
    read_meta,
)
from draftsmith.heads.eagle3 import DRAFT_VOCAB
from draftsmith.heads.files import move_into_place, temp_folder_beside
from draftsmith.heads.kinds import KINDS, DraftShape, folder_shape, get, resolve
from draftsmith.heads.llama import SUPPORTED_TYPES

from .export_card import EXPORT_MARK, export_card
from .loader import read_hf_config
from .target import DTYPES, SHORT_NAMES, TargetConfig, resolve_target, target_id

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


class ExportError(ValueError):
    """A user-fixable problem with the export's inputs, or an export that fails validation."""


@dataclass
class Source:
    """What an exporter reads: the drafter (embedding / lm_head placeholders: those are never exported) and
    its target's folder and config.json."""

    folder: Path
    meta: dict
    head: nn.Module
    target_dir: Path
    target_hf: dict
    token_counts: Tensor | None = None  # the training answers' token counts, where the folder has them

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


@dataclass(frozen=True)
class Format:
    """One export format of a kind: the exporter, what the validator checks (serve/export_check.py: tables built
    from the drafter's own config, not from the exporter, and the format's forward in plain torch), and the
    engines that load it (the card's serve commands)."""

    export: Callable[[Source], Export]
    shapes: Callable[[Source, dict], dict[str, tuple[int, ...]]]  # (src, written config.json) -> name -> shape
    config: Callable[[Source], dict]  # config.json keys the engines read, with the values the drafter implies
    forward: Callable[[Source, Any], dict[str, tuple]]  # (src, export_check.Probe) -> name -> (export's, drafter's)
    problems: Callable[[Source, Path, dict], list[str]] = no_problems  # more checks: (src, folder, config.json)
    tensor_checks: Callable[[Source, dict, torch.dtype], list[str]] = no_problems  # (src, tensors, export dtype)
    token_map: Callable[[Source], Tensor | None] | None = None  # the SGLang token map the exporter writes
    weights: str = "model.safetensors"  # the file the validator reads
    torch_dtype: bool = True  # config.json says the export's dtype
    target_types: tuple[str, ...] = SUPPORTED_TYPES  # target model_types its engines run these drafters with
    vllm: str = ""  # vLLM's speculative method for this folder ("": vLLM does not load it)
    vllm_alone: bool = False  # the folder names its target and method: `vllm serve OUT` serves it (speculators)
    vllm_options: tuple[tuple[str, Any], ...] = ()  # more --speculative-config keys vLLM needs for it
    sglang: str = ""  # SGLang's --speculative-algorithm ("": SGLang does not load it)
    tgi: bool = False  # TGI loads it
    hf: bool = False  # transformers loads it (assisted generation)


# ---------------------------------------------------------------- exporters, one per (kind, format)


def eagle3_vllm(src: Source) -> Export:
    """vLLM's and SGLang's LlamaForCausalLMEagle3: our parameter names already are theirs."""
    c = src.head.config
    state = own_state(src.head)
    if c.draft_vocab_size == c.vocab_size:  # no draft vocabulary: vLLM has no slot for an identity d2t
        state = {k: v for k, v in state.items() if k not in ("d2t", "t2d")}
    if c.attention_bias:
        state["midlayer.self_attn.o_proj.bias"] = torch.zeros(c.hidden_size)  # engines' attention_bias has o bias
    eagle = {"eagle_aux_hidden_state_layer_ids": list(c.target_layers), "use_aux_hidden_state": True}
    config = llama_head_config(src, "LlamaForCausalLMEagle3") | {
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.hidden_size,
        "eagle_config": eagle | ({"norm_before_fc": True} if c.norm_before_fc else {}),
    }
    # EAGLE-3.1's switches where set (vLLM reads both at the top, norm_before_fc in eagle_config first; llama.cpp
    # reads norm_before_fc at the top): unset, the folder stays what engines without them load
    config |= {k: True for k in ("norm_before_fc", "norm_output") if getattr(c, k, False)}
    return Export(config, {"model.safetensors": state})


def eagle_vllm(src: Source) -> Export:
    """vLLM's EagleLlamaForCausalLM: its fc has no bias. fc(x) + b enters the layer as its residual stream and
    attention input, so b is moved exactly into the attention: q/k/v biases W b, o_proj bias b."""
    state = own_state(src.head)
    b = state.pop("fc.bias")
    bias = src.head.config.attention_bias or bool(b.any())
    if bias:
        for p in "qkv":
            w = state[f"layers.0.self_attn.{p}_proj.weight"]
            old = state.get(f"layers.0.self_attn.{p}_proj.bias", torch.zeros(w.shape[0]))
            state[f"layers.0.self_attn.{p}_proj.bias"] = (old.double() + w.double() @ b.double()).float()
        state["layers.0.self_attn.o_proj.bias"] = b
    config = llama_head_config(src, "EagleLlamaForCausalLM") | {"attention_bias": bias}
    return Export(config, {"model.safetensors": state})


def eagle_sglang(src: Source) -> Export:
    """SGLang's LlamaForCausalLMEagle: the original EAGLE layout, fc with its bias. With the training answers'
    token counts, also a token map of the most frequent quarter of the vocabulary (at least 8k ids; FR-Spec
    kept 32k of Llama-3's 128k) for --speculative-token-map."""
    c = src.head.config
    state = own_state(src.head)
    if c.attention_bias:
        state["layers.0.self_attn.o_proj.bias"] = torch.zeros(c.hidden_size)
    return Export(llama_head_config(src, "LlamaForCausalLMEagle"), {"model.safetensors": state}, [], token_map(src))


def token_map(src: Source) -> Tensor | None:
    """The ids an SGLang EAGLE export's token map keeps: the training answers' most frequent quarter, at least the
    default draft vocabulary."""
    if src.token_counts is None:
        return None
    v = src.head.config.vocab_size
    return frequent_ids(src.token_counts, min(v, max(DRAFT_VOCAB, v // 4)))


def medusa_vllm(src: Source) -> Export:
    c = src.head.config
    config = {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": c.hidden_size,
        "vocab_size": c.vocab_size,
        "num_heads": c.num_heads,
        "num_hidden_layers": c.num_layers,
        "medusa_fc_bias": True,
        "truncated_vocab_size": c.vocab_size,
    }
    return Export(config, {"model.safetensors": own_state(src.head)})


def medusa_tgi(src: Source) -> Export:
    """FasterDecoding's layout, which TGI reads: head h's block l is `h.l.linear`, its lm_head `h.L`."""
    c = src.head.config
    state = {}
    for name, t in own_state(src.head).items():
        part = name.split(".")  # blocks.h.layers.l.weight | lm_heads.h.weight
        key = f"{part[1]}.{part[3]}.linear.{part[4]}" if part[0] == "blocks" else f"{part[1]}.{c.num_layers}.weight"
        state[key] = t
    config = {
        "medusa_num_heads": c.num_heads,
        "medusa_num_layers": c.num_layers,
        "base_model_name_or_path": str(src.target_dir.resolve()),
    }
    return Export(config, {"medusa_lm_head.safetensors": state})


def draft_model_hf(src: Source) -> Export:
    """A plain HF causal-LM folder: the target's config.json with the draft's sizes, its tokenizer files."""
    m = src.head.config
    config = {k: v for k, v in src.target_hf.items() if k not in DROPPED_HF_KEYS}
    config |= {
        "vocab_size": m.vocab_size,
        "hidden_size": m.hidden_size,
        "intermediate_size": m.intermediate_size,
        "num_hidden_layers": m.num_hidden_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_key_value_heads,
        "head_dim": m.head_dim,
        "rms_norm_eps": m.rms_norm_eps,
        "max_position_embeddings": m.max_position_embeddings,
        "tie_word_embeddings": m.tie_word_embeddings,
    }
    if isinstance(config.get("layer_types"), list):  # per-layer list (Qwen2/3): sized to the draft's layers
        config["layer_types"] = config["layer_types"][: m.num_hidden_layers]
    copy = [f for f in TOKENIZER_FILES if (src.target_dir / f).is_file()]
    return Export(config, {"model.safetensors": own_state(src.head)}, copy)


# the dtype goes in once, as torch_dtype, which transformers 4 and 5 both read
DROPPED_HF_KEYS = (
    "_name_or_path",
    "_model_name_or_path",
    "quantization_config",
    "auto_map",
    "transformers_version",
    "dtype",
)


def llama_head_config(src: Source, arch: str) -> dict:
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


# ---------------------------------------------------------------- loading and refusing bad input


def load_source(drafter: Path, target: TargetConfig) -> Source:
    """The drafter folder and its target, refused (ExportError) when missing, corrupt or mismatched."""
    drafter = Path(drafter).expanduser()
    try:
        meta = read_meta(drafter)
    except (FileNotFoundError, ValueError) as e:
        raise ExportError(f"cannot export {drafter}: {e}") from e
    try:
        target_dir = resolve_target(target)
        hf = read_hf_config(target_dir)
    except (FileNotFoundError, ValueError) as e:
        raise ExportError(f"the target: {e}") from e
    try:
        info = TargetInfo(target_id(target, target_dir), hf["hidden_size"], hf["vocab_size"], hf["num_hidden_layers"])
        check_target(meta, info, drafter)
        head = load_drafter(drafter, info).eval().requires_grad_(False)
        counts = load_token_counts(drafter, info.vocab_size) if (drafter / TOKEN_COUNTS).is_file() else None
    except FileNotFoundError as e:
        raise ExportError(f"cannot export {drafter}: {e}") from e
    except (KeyError, TypeError) as e:  # a config.json whose fields do not fit its kind
        raise ExportError(f"{drafter}/config.json is corrupt ({type(e).__name__}: {e}); re-train or re-save it") from e
    except ValueError as e:
        raise ExportError(str(e)) from e
    return Source(drafter, meta, head, target_dir, hf, counts)


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


def is_export(folder: Path) -> bool:
    card = folder / "README.md"
    return card.is_file() and EXPORT_MARK in card.read_text(errors="replace")


# ---------------------------------------------------------------- writing


def cast(state: dict[str, Tensor], dtype: torch.dtype) -> dict[str, Tensor]:
    """Floating tensors to the export dtype; d2t (int64) and t2d (bool) keep theirs."""
    return {k: (v.to(dtype) if v.is_floating_point() else v).detach().contiguous().cpu() for k, v in state.items()}


def write(exp: Export, src: Source, f: Format, dtype: str, folder: Path) -> None:
    config = exp.config | ({"torch_dtype": EXPORT_DTYPES[dtype]} if f.torch_dtype else {})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name, state in exp.tensors.items():
        save_file(cast(state, DTYPES[EXPORT_DTYPES[dtype]]), str(folder / name), metadata={"format": "pt"})
    for name in exp.copy:
        shutil.copy2(src.target_dir / name, folder / name)
    if exp.token_map is not None:  # SGLang reads it with torch.load(weights_only=True): a plain tensor
        torch.save(exp.token_map.long().contiguous(), folder / TOKEN_MAP)
    for f in folder.iterdir():
        f.chmod(0o644)  # save_file writes owner-only files


def export(
    drafter: Path, fmt: str, out: Path, target: TargetConfig | None = None, dtype: str = "bf16", overwrite: bool = False
) -> Path:
    """Export drafter to OUT in `fmt`; OUT appears only once the export has passed validation."""
    from .export_check import check_export  # which imports this module

    drafter, out = Path(drafter).expanduser(), Path(out).expanduser()
    if dtype not in EXPORT_DTYPES:
        raise ExportError(f"unknown dtype {dtype!r}; choose one of {', '.join(EXPORT_DTYPES)}")
    check_format_name(fmt)
    check_out(out, drafter, overwrite)
    src = load_source(drafter, target or TargetConfig())
    f = format_for(src.kind, fmt)
    check_target_type(src, fmt, f)
    exp = f.export(src)
    with temp_folder_beside(out, mode=0o755) as tmp:  # 755: an engine in a container may run as another user
        write(exp, src, f, dtype, tmp)
        token_map = TOKEN_MAP if exp.token_map is not None else None
        (tmp / "README.md").write_text(export_card(src, fmt, dtype, out.resolve(), token_map))
        check_export(tmp, src, fmt)
        move_into_place(tmp, out)
    return out


def validate(drafter: Path, fmt: str, out: Path, target: TargetConfig | None = None) -> None:
    """Validate an existing export at OUT against the drafter it came from (check=true); writes nothing."""
    from .export_check import check_export  # which imports this module

    src = load_source(Path(drafter).expanduser(), target or TargetConfig())
    format_for(src.kind, fmt)
    if not Path(out).expanduser().is_dir():
        raise ExportError(f"out={out} is not a folder: nothing to check")
    check_export(Path(out).expanduser(), src, fmt)
