"""draftsmith's own fp32 CPU kernels (panels.cpp: the linears, panel_codes.cpp: their exact weight codes;
rope_attention.cpp: rope, cache write and attention; layer_ops.cpp: RMSNorm and SwiGLU; decoder_layer.cpp: a whole
layer from them; decoder_stack.cpp: a model's layers one after another), built once
with the system's C++ compiler into one shared library and loaded with ctypes.

Why: a batch-1 decode step is a pass over the weights plus a few hundred small ops; these kernels stream the weights
near the memory's pace and fold the attention's ops into one call, and each gives a row the same bits whatever the rows
around it (docs/benchmarks.md).

Where they run: fp32 on a CPU with AVX2 and FMA, AVX-512 ones included (how they compare with torch's fp32 kernels
and the compiled bf16 step: docs/benchmarks.md, The fp32
kernels on AVX-512), a bf16 model there too, as bf16 weights in fp32
(serve/models/loader.py);
DRAFTSMITH_KERNELS=0 turns them off (oneDNN's linears and torch's attention). If the library cannot be built or
loaded, one warning says why and torch's kernels run. The built library sits under the cache root beside its sha256;
a damaged or half-copied one is rebuilt, never loaded. A build keeps the newest few libraries there and removes
older ones.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import shlex
import shutil
import subprocess
import warnings
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path

import torch
from torch import Tensor

from draftsmith.files import cache_root, write_file_atomic, write_text_atomic

ENV = "DRAFTSMITH_KERNELS"
SOURCES = tuple(
    Path(__file__).with_name(f"{name}.cpp")
    for name in (
        "panels",
        "panel_codes",
        "rope_attention",
        "layer_ops",
        "decoder_layer",
        "decoder_stack",
        "eagle3_draft",
    )
)
HEADERS = tuple(
    Path(__file__).with_name(name)
    for name in ("vec.h", "panels.h", "panel_decode.h", "rope_attention.h", "decoder_layer.h")
)
EXPORTS = (
    "panel_linear",
    "code_panels",
    "rope_attention",
    "rms_norm",
    "silu_mul",
    "decoder_layer",
    "decoder_layer_work",
    "eagle3_layer",
    "eagle3_layer_work",
    "stack_work",
    "decoder_stack",
    "eagle3_draft",
    "eagle3_draft_work",
)
# -ffp-contract=off: g++ would fuse a scalar a * b + c into an FMA on one code path and not another, and a row's
# bits would then depend on the path (masked or causal) that computed it
FLAGS = ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
KEEP = 4  # built libraries kept in the cache, the newest first (prune_older)
# set while a model on the reference path runs (runtime/llama.py, Transformer.path): no call takes these kernels
SWITCHED_OFF: ContextVar[bool] = ContextVar("draftsmith_kernels_switched_off", default=False)
SETTINGS = {"1": True, "on": True, "true": True, "yes": True, "0": False, "off": False, "false": False, "no": False}


def wanted() -> bool:
    """Whether fp32 layers should run here: on AVX2 or AVX-512 CPUs, unless DRAFTSMITH_KERNELS=0."""
    return setting_from_env() is not False and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def usable() -> bool:
    """Wanted here, and the library built and loaded."""
    return wanted() and library() is not None


def runs(weight: Tensor) -> bool:
    """A model whose weights are like this one has its no-grad forward on the kernels: fp32, on the CPU, usable."""
    return weight.dtype == torch.float32 and weight.is_cpu and usable()


def version() -> str | None:
    """Which kernel library runs here, by its file's name (a digest of its sources, flags and compiler), or None where
    torch's kernels run: what a cost measured on this machine holds for (serve/engine/cost_profile.py)."""
    lib = library() if wanted() else None
    return None if lib is None else Path(lib._name).stem


def handles(x: Tensor) -> bool:
    """A no-grad fp32 CPU call where the kernels are usable and not switched off. Training, autocast (the linears then
    give bf16), other dtypes and a forward being compiled (inductor fuses these ops itself, and cannot trace a ctypes
    call) keep torch's ops."""
    eager = not torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu") and not torch.compiler.is_compiling()
    return x.dtype == torch.float32 and x.is_cpu and eager and not SWITCHED_OFF.get() and usable()


@contextlib.contextmanager
def switched_off() -> Iterator[None]:
    """Within it, every call keeps torch's ops: the linears, norms and attention of a model on the reference path."""
    token = SWITCHED_OFF.set(True)
    try:
        yield
    finally:
        SWITCHED_OFF.reset(token)


def setting_from_env() -> bool | None:
    """DRAFTSMITH_KERNELS as on, off, or None where unset."""
    value = os.environ.get(ENV, "").strip().lower()
    if value and value not in SETTINGS:
        raise ValueError(f"{ENV}={value!r} is not a setting: use 1 (on), 0 (off), or leave it unset (the default)")
    return SETTINGS.get(value)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built library, or None after one warning naming why it cannot be built or loaded."""
    try:
        lib = ctypes.CDLL(str(built_library()))  # torch is loaded: the library shares its OpenMP runtime
        for name in EXPORTS:
            getattr(lib, name)
    except (OSError, AttributeError, subprocess.CalledProcessError) as e:
        warn_unusable(e, getattr(e, "stderr", b"") or b"")
        return None
    return lib


def warn_unusable(problem: Exception, detail: bytes = b"") -> None:
    warnings.warn(
        f"draftsmith: could not build or load its fp32 CPU kernels ({problem}; "
        f"{detail.decode(errors='replace')[-400:]}); torch's kernels run instead (set {ENV}=0 to skip the attempt)",
        stacklevel=3,
    )


def bind(name: str, argtypes: list, restype: type | None = None) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """A C function of the library with its argument and result types, or None where the library is not usable."""
    lib = library()
    if lib is None:
        return None
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = argtypes, restype
    return fn


def built_library() -> Path:
    """The shared library under the cache root, named for its sources, flags and compiler; built (into a temp file,
    then renamed) where this machine has no intact copy of that one yet."""
    compiler = compiler_command()
    version = subprocess.run([*compiler, "--version"], capture_output=True, check=True).stdout
    sources = b"".join(s.read_bytes() for s in (*SOURCES, *HEADERS))
    key = hashlib.sha256(sources + " ".join([*compiler, *FLAGS]).encode() + version).hexdigest()[:16]
    path = cache_root() / "kernels" / f"draftsmith-{key}.so"
    if not intact(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        write_file_atomic(path, lambda tmp: compile_into(compiler, tmp))
        write_text_atomic(digest_path(path), file_digest(path))
        prune_older(path)
    return path


def prune_older(kept: Path) -> None:
    """After a build, keep the KEEP newest libraries beside it (other checkouts or versions may still use them; one
    removed is rebuilt when wanted, and a process that loaded it keeps its mapping) and remove the rest. Best effort:
    what is not a plain file is left alone, and one another process removes first is skipped."""
    built = []
    for p in kept.parent.glob("draftsmith-*.so"):
        try:
            if p != kept and p.is_file() and not p.is_symlink():
                built.append((p.stat().st_mtime, p))
        except OSError:  # gone since the listing
            continue
    for _, old in sorted(built, reverse=True)[KEEP - 1 :]:
        for f in (old, digest_path(old)):
            try:
                f.unlink(missing_ok=True)
            except OSError:
                continue


def compiler_command() -> list[str]:
    """$CXX (which may carry a launcher: "ccache g++"), else g++ or c++ from PATH."""
    command = shlex.split(os.environ.get("CXX", ""))
    found = command or [c for c in (shutil.which("g++") or shutil.which("c++"),) if c]
    if not found:
        raise OSError("no C++ compiler (g++ or $CXX) on PATH")
    return found


def intact(path: Path) -> bool:
    """The library is there and its bytes are the ones built (a truncated library would crash the loader)."""
    digest = digest_path(path)
    return path.exists() and digest.exists() and digest.read_text() == file_digest(path)


def digest_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def compile_into(compiler: list[str], out: Path) -> None:
    subprocess.run([*compiler, *FLAGS, *map(str, SOURCES), "-o", str(out)], capture_output=True, check=True)
