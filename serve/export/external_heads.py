"""EAGLE-3 heads made elsewhere, as spec.drafter folders: the speculators format (vLLM's native one, PyPI
`speculators`) and the LlamaForCausalLMEagle3 layout (SpecForge / SGLang / vLLM; draftsmith-export format=vllm).

Such a folder has no draftsmith target id, so it is checked against the target by what it records: the verifier
(speculators: its architecture, and its config.json when name_or_path is a folder here), the hidden and vocabulary
sizes, and the target layers its eagle_aux_hidden_state_layer_ids name (read as vLLM reads them: id i is the input
of target layer i; absent, vLLM's and SGLang's default 2, L/2, L-3). Every check reads config.json and the
safetensors header only, so a folder that does not fit is refused before any weight loads, never run with random
weights.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from draftsmith.heads.drafter_folder import cast_own, config_hash, own_state
from draftsmith.heads.eagle3 import Eagle3Config, Eagle3Head
from draftsmith.heads.head_base import EagleConfig
from draftsmith.runtime.llama import ModelConfig, Transformer
from draftsmith.serve.export.export_eagle3 import EAGLE31_KEYS, eagle3_table
from draftsmith.serve.export.speculators import FLAT_LAYER, LAYER, PLAIN, flat_name, speculators_name
from draftsmith.serve.models.loader import load_state_dict, weight_files

EXTERNAL_KIND = "eagle3"  # the registered kind these folders load as (spec=eagle3)
ARCH = "LlamaForCausalLMEagle3"
PREFIX = {"speculators": LAYER, "specforge": FLAT_LAYER}  # the head's layer in each layout
OTHER_SPECULATORS = ("peagle", "dflash", "dflash2", "dspark", "mtp", "xpress")  # speculators types not run here
TARGET_ARCHS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
TARGET_ARCHS["qwen3"] = "Qwen3ForCausalLM"
MAX_DEPTH = 64  # a recorded speculative_tokens past this is a broken config, not a draft


@dataclass
class External:
    """What an external folder's config.json says, in draftsmith's terms."""

    fmt: str  # speculators | specforge
    layer: dict  # the head's one-layer Llama config (HF keys)
    draft_vocab_size: int
    layer_ids: list[int] | None
    target_hidden_size: int | None
    verifier: dict | None  # speculators only
    norms: dict = field(default_factory=dict)  # Eagle3Config's norm switches (EAGLE31_KEYS)


def external_format(folder: Path) -> str | None:
    """speculators / specforge for an EAGLE-3 folder made elsewhere; None for anything else (a draftsmith folder,
    an HF model, a broken file: their own loaders say what is wrong)."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or "kind" in config:
        return None
    if "speculators_model_type" in config or "speculators_config" in config:
        return "speculators"
    return "specforge" if ARCH in (config.get("architectures") or []) else None


# ---------------------------------------------------------------- config.json


def recorded_depth(folder: Path) -> int | None:
    """The chain a speculators folder tells vLLM to draft (speculators_config.proposal_methods[0]
    .speculative_tokens); None where it records none (the LlamaForCausalLMEagle3 layout records no shape)."""
    path = Path(folder) / "config.json"
    try:
        depth = json.loads(path.read_text())["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None
    if type(depth) is not int or not 1 <= depth <= MAX_DEPTH:
        raise ValueError(
            f"{path}: speculators_config.proposal_methods[0].speculative_tokens={depth!r} is no draft depth "
            f"(an integer 1..{MAX_DEPTH}): fix it, or set spec.num_tokens"
        )
    return depth


def read_external(folder: Path, fmt: str) -> External:
    config = json.loads((Path(folder) / "config.json").read_text())
    return read_speculators(folder, config) if fmt == "speculators" else read_specforge(folder, config)


def read_speculators(folder: Path, config: dict) -> External:
    path = Path(folder) / "config.json"
    mtype = config.get("speculators_model_type")
    if mtype != "eagle3":
        runs = f" ({mtype} heads run in vLLM, not in draftsmith's engine)" if mtype in OTHER_SPECULATORS else ""
        raise ValueError(
            f"{path}: speculators_model_type={mtype!r}{runs}; draftsmith reads only eagle3 speculators folders: "
            "for a draftsmith export, pass the draftsmith drafter folder it was exported from"
        )
    missing = [k for k in ("speculators_config", "transformer_layer_config", "draft_vocab_size") if k not in config]
    if "norm_before_residual" not in config:  # the engines disagree on its default: it must be spelled out
        missing.append("norm_before_residual (vLLM reads its absence as true, the speculators package as false)")
    spec = config.get("speculators_config")
    verifier = spec.get("verifier") if isinstance(spec, dict) else None
    if spec is not None and not (isinstance(verifier, dict) and "name_or_path" in verifier):
        missing.append("speculators_config.verifier.name_or_path")
    if missing:
        raise ValueError(f"{path} is missing {', '.join(missing)}: not a complete speculators eagle3 config")
    unsupported(path, config, PLAIN)
    layer = config["transformer_layer_config"]
    if not isinstance(layer, dict):
        raise ValueError(f"{path}: transformer_layer_config must be an object (a Llama config)")
    return External(
        "speculators",
        layer,
        vocab_size_of(path, "draft_vocab_size", config["draft_vocab_size"]),
        config.get("eagle_aux_hidden_state_layer_ids"),
        config.get("target_hidden_size"),
        verifier,
        read_norms(path, config),
    )


def read_specforge(folder: Path, config: dict) -> External:
    path, eagle = Path(folder) / "config.json", config.get("eagle_config") or {}
    unsupported(path, config | eagle, PLAIN | {"use_aux_hidden_state": True})  # vLLM reads eagle_config too
    layer = {k: v for k, v in config.items() if k not in ("eagle_config", "architectures")}
    size_key = "draft_vocab_size" if config.get("draft_vocab_size") is not None else "vocab_size"
    return External(
        "specforge",
        layer,
        vocab_size_of(path, size_key, config.get(size_key)),
        eagle.get("eagle_aux_hidden_state_layer_ids"),
        config.get("target_hidden_size"),
        None,
        read_norms(path, config | {k: eagle[k] for k in ("norm_before_fc",) if k in eagle}),  # vLLM: eagle_config wins
    )


def vocab_size_of(path: Path, key: str, value) -> int:
    """A vocabulary size as JSON spells one: a positive integer ("64" or 64.0 would fail far from the file)."""
    if type(value) is not int or value < 1:
        raise ValueError(f'{path}: {key}={value!r} must be a positive integer (as in "{key}": 32000)')
    return value


def read_norms(path: Path, config: dict) -> dict:
    """The head's norm switches as vLLM reads them (absent = false; a speculators folder must spell out
    norm_before_residual, checked before); anything but a boolean is refused."""
    norms = {k: config.get(k, False) for k in EAGLE31_KEYS}
    bad = [f"{k}={v!r}" for k, v in norms.items() if not isinstance(v, bool)]
    if bad:
        raise ValueError(f"{path}: {', '.join(bad)}: must be true or false")
    return norms


def unsupported(path: Path, config: dict, runs: dict) -> None:
    """Refuse settings draftsmith's Eagle3Head does not compute (each key -> the only value it runs)."""
    off = [f"{k}={config[k]!r}" for k, v in runs.items() if config.get(k, v) != v]
    if off:
        raise ValueError(
            f"{path}: {', '.join(off)}: draftsmith's EAGLE-3 head runs only "
            + ", ".join(f"{k}={v}" for k, v in runs.items())
        )


def external_config(f: External, folder: Path, target_config: ModelConfig) -> Eagle3Config:
    """The Eagle3Config the folder describes, refused (naming the key) where it is not a one-layer Llama head
    this engine runs or does not fit the target."""
    path = Path(folder) / "config.json"
    layer = {"model_type": "llama", "num_hidden_layers": None, "hidden_act": "silu", "mlp_bias": False} | f.layer
    unsupported(path, layer, {"model_type": "llama", "num_hidden_layers": 1, "hidden_act": "silu", "mlp_bias": False})
    try:
        m = ModelConfig.from_hf(layer)
    except (KeyError, ValueError) as e:
        raise ValueError(f"{path}: the head's layer config does not parse as a Llama config ({e})") from e
    check_fits(f, m, target_config, path)
    n = target_config.num_hidden_layers
    ids = tuple(f.layer_ids) if f.layer_ids else tuple(sorted({min(max(i, 0), n) for i in (2, n // 2, n - 3)}))
    sizes = {k: getattr(m, k) for k in EagleConfig.__dataclass_fields__}
    sizes["max_position_embeddings"] = max(m.max_position_embeddings, target_config.max_position_embeddings)
    try:
        return Eagle3Config(**sizes, target_layers=ids, draft_vocab_size=f.draft_vocab_size, **f.norms)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from e


def check_fits(f: External, m: ModelConfig, target_config: ModelConfig, path: Path) -> None:
    """Sizes and target layers against the target's."""
    off = []
    for name, theirs, ours in (
        ("hidden_size", m.hidden_size, target_config.hidden_size),
        ("target_hidden_size", f.target_hidden_size or m.hidden_size, target_config.hidden_size),
        ("vocab_size", m.vocab_size, target_config.vocab_size),
    ):
        if theirs != ours:
            off.append(f"{name}={theirs} (the target has {ours})")
    n = target_config.num_hidden_layers
    if f.layer_ids and not all(isinstance(i, int) and 0 <= i <= n for i in f.layer_ids):
        off.append(f"eagle_aux_hidden_state_layer_ids={f.layer_ids} (the target has layers 0..{n})")
    if off:
        raise ValueError(f"{path} was made for another target: {'; '.join(off)}; use a head made for this target")


def check_verifier(f: External, target_config: ModelConfig, target_id: str, path: Path) -> None:
    """A speculators folder names its verifier: it must be the target (its architecture; its config.json, where
    name_or_path is a folder here)."""
    if f.verifier is None:
        return
    name, archs = f.verifier.get("name_or_path"), f.verifier.get("architectures") or []
    arch = TARGET_ARCHS[target_config.model_type]
    if archs and arch not in archs:
        raise ValueError(
            f"{path}: the verifier {name} is a {'/'.join(archs)}, the target {target_id} a {arch}: "
            "use a head made for this target"
        )
    config = Path(str(name)).expanduser() / "config.json"
    if config.is_file():
        digest = hashlib.sha256(config.read_bytes()).hexdigest()[:8]
        if digest != config_hash(target_id):
            raise ValueError(
                f"{path}: the verifier {name} is not the target {target_id} (their config.json differ): "
                "use a head made for this target"
            )


# ---------------------------------------------------------------- weights


def expected_shapes(cfg: Eagle3Config, prefix: str) -> tuple[dict, dict]:
    """(required, optional) tensor name -> shape in the folder's spelling."""
    flat = eagle3_table(cfg, cfg.attention_bias)
    required = {speculators_name(k, prefix): s for k, s in flat.items()}
    optional: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size)}
    if cfg.draft_vocab_size == cfg.vocab_size:  # a full vocabulary may still carry an (identity) map
        optional |= {"d2t": (cfg.draft_vocab_size,), "t2d": (cfg.vocab_size,)}
    else:
        optional["t2d"] = required.pop("t2d")  # rebuilt from d2t where absent
    return required, optional


def header(folder: Path) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """Tensor name -> shape, and name -> safetensors dtype (F32, BF16, I64, BOOL, ...), from the headers alone."""
    shapes, dtypes = {}, {}
    for file in weight_files(folder):
        try:
            with safe_open(str(file), "pt") as st:
                for k in st.keys():  # noqa: SIM118
                    tensor = st.get_slice(k)
                    shapes[k], dtypes[k] = tuple(tensor.get_shape()), tensor.get_dtype()
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{file} is corrupt or not a safetensors file ({e})") from e
    return shapes, dtypes


def wrong_dtypes(dtypes: dict[str, str]) -> list[str]:
    """Weights must be floating point; d2t integer (target id offsets); t2d boolean or integer (a mask)."""
    want = {"d2t": ("I",), "t2d": ("BOOL", "I", "U8")}
    said = {"d2t": "an integer type", "t2d": "a boolean mask"}
    return [
        f"{k} is {d}, expected {said.get(k, 'a floating-point type')}"
        for k, d in sorted(dtypes.items())
        if not d.startswith(want.get(k, ("F", "BF")))
    ]


def check_weights(folder: Path, cfg: Eagle3Config, prefix: str) -> None:
    required, optional = expected_shapes(cfg, prefix)
    found, dtypes = header(folder)
    problems = wrong_dtypes(dtypes)
    if "d2t" in required and "d2t" not in found:
        problems.append(f"d2t is missing: draft_vocab_size {cfg.draft_vocab_size} < vocab {cfg.vocab_size} needs it")
        required.pop("d2t")
    missing, known = sorted(required.keys() - found.keys()), required | optional
    problems += [f"missing {', '.join(missing)}"] if missing else []
    extra = sorted(found.keys() - known.keys())
    problems += [f"unknown keys {', '.join(extra)}"] if extra else []
    both = sorted(found.keys() & known.keys())
    problems += [f"{k} has shape {found[k]}, expected {known[k]}" for k in both if found[k] != known[k]]
    if problems:
        raise ValueError(f"{folder} does not fit an EAGLE-3 head of its config.json:\n  - " + "\n  - ".join(problems))


def head_state(folder: Path, cfg: Eagle3Config, prefix: str, target: Transformer) -> dict[str, Tensor]:
    """The folder's tensors under Eagle3Head's names, d2t/t2d checked (and t2d rebuilt where absent); its
    embedding, if it has one, must be the target's (the head drafts with the target's)."""
    embed = target.model.embed_tokens.weight
    state = {flat_name(k, prefix): v for k, v in load_state_dict(folder).items()}
    broken = sorted(k for k, v in state.items() if v.is_floating_point() and not torch.isfinite(v).all())
    if broken:
        raise ValueError(f"{folder}: {', '.join(broken)} hold NaN or infinite values; the head is broken, retrain it")
    own = state.pop("embed_tokens.weight", None)
    if own is not None and not same_weights(own, embed, target.weights_dtype):
        raise ValueError(
            f"{folder}: embed_tokens.weight differs from the target's embedding; draftsmith's engine drafts with "
            "the target's (as vLLM does when they are equal): use a head trained with the target's embedding"
        )
    o_bias = state.pop("midlayer.self_attn.o_proj.bias", None)
    if o_bias is not None and o_bias.any():
        raise ValueError(f"{folder}: a non-zero o_proj bias, which draftsmith's EAGLE-3 head does not have")
    d2t = state.get("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long)).long()
    ids = torch.arange(cfg.draft_vocab_size) + d2t
    if ids.min() < 0 or ids.max() >= cfg.vocab_size or ids.unique().numel() != ids.numel():
        raise ValueError(f"{folder}: d2t does not map the draft vocabulary onto distinct target ids")
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    if "t2d" in state and cfg.draft_vocab_size < cfg.vocab_size and not torch.equal(state["t2d"].bool(), t2d):
        raise ValueError(f"{folder}: t2d does not mark the target ids d2t maps to")
    return state | {"d2t": d2t, "t2d": t2d}


def same_weights(a: Tensor, b: Tensor, values: torch.dtype) -> bool:
    """Equal at the coarsest of the two dtypes and `values`, the dtype b's values are (a bf16 copy of an fp32
    embedding is the same embedding, and so is an fp32 one beside a bf16 target run in fp32)."""
    low = min((a.dtype, b.dtype, values), key=lambda d: d.itemsize)
    return a.shape == b.shape and torch.equal(a.to(low).cpu(), b.to(low).cpu())


# ---------------------------------------------------------------- loading


def external_head(folder: Path, fmt: str, model: Transformer, target_id: str, dtype: torch.dtype) -> Eagle3Head:
    """An Eagle3Head from an external folder, refused (ValueError) unless it fits the target; checked on
    config.json and the safetensors header before any weight is read."""
    folder = Path(folder)
    f = read_external(folder, fmt)
    cfg = external_config(f, folder, model.config)
    check_verifier(f, model.config, target_id, folder / "config.json")
    check_weights(folder, cfg, PREFIX[fmt])
    state = head_state(folder, cfg, PREFIX[fmt], model)
    head = Eagle3Head(cfg, model).to(model.device)
    assert state.keys() == own_state(head).keys(), "the checks above admit exactly the head's tensors"
    head.load_state_dict({k: v.to(model.device) for k, v in state.items()}, strict=False)
    return cast_own(head, dtype)
