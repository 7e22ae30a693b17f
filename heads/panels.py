"""fp32 CPU linears on a small kernel of draftsmith's own (heads/panels.cpp), built once with the system's C++
compiler and loaded with ctypes.

Why: a decode step multiplies one row by every weight, so it is a pass over the weights and its speed is the
memory's. oneDNN's fp32 kernels stream SmolLM2's weights at 18-24 GB/s on an AVX2 EPYC where the memory gives
about 30; this kernel streams them at 31-35 and also beats oneDNN at 2-32 rows (docs/benchmarks.md).
It keeps the engine's exactness by construction: every output is one FMA chain over the input features in order,
whatever the row count, the tile or the thread, so a row's product carries the same bits in a decode, a verify and
a prefill. (The fp32 eager step still runs torch's SDPA, whose bits can differ with the row count; the compiled
step's attention is row-invariant, and the lossless tests hold on both.) The weight is repacked once into panels of
PANEL outputs, [panels, in, PANEL], which a thread streams front to back.

Where it runs: fp32 on a CPU with AVX2 and FMA, by default where torch's best kernels are AVX2 (measured there);
DRAFTSMITH_PANELS=1 turns it on on an AVX-512 CPU as well, =0 off (oneDNN's kernels, as before). If the kernel
cannot be built or loaded, or fails its self-check, one warning says why and oneDNN runs. The built library sits
under the cache root beside its sha256; a damaged or half-copied one is rebuilt, never loaded.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import shlex
import shutil
import subprocess
import warnings
from pathlib import Path

import torch
from torch import Tensor

from .files import cache_root, write_file_atomic, write_text_atomic

ENV = "DRAFTSMITH_PANELS"
PANEL = 32  # outputs per panel: heads/panels.cpp's P
SOURCE = Path(__file__).with_name("panels.cpp")
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")
SETTINGS = {"1": True, "on": True, "true": True, "yes": True, "0": False, "off": False, "false": False, "no": False}


def wanted() -> bool:
    """Whether fp32 linears should run here: off under DRAFTSMITH_PANELS=0, and only on AVX2 or AVX-512 CPUs."""
    setting = setting_from_env()
    capability = torch.backends.cpu.get_cpu_capability()
    if setting is False or capability not in ("AVX2", "AVX512"):
        return False
    return setting is True or capability == "AVX2"


def setting_from_env() -> bool | None:
    """DRAFTSMITH_PANELS as on, off, or None where unset."""
    value = os.environ.get(ENV, "").strip().lower()
    if value and value not in SETTINGS:
        raise ValueError(f"{ENV}={value!r} is not a setting: use 1 (on), 0 (off), or leave it unset (the default)")
    return SETTINGS.get(value)


def available() -> bool:
    """fp32 linears take the panel kernel: wanted here, and built."""
    return wanted() and kernel() is not None


@functools.cache
def kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The built and self-checked panel_linear, or None after one warning naming why it cannot run."""
    try:
        fn = loaded(built_library())  # torch is loaded: the library shares its OpenMP runtime
        self_check(fn)
    except (OSError, AttributeError, subprocess.CalledProcessError, ArithmeticError) as e:
        detail = getattr(e, "stderr", b"") or b""
        warnings.warn(
            f"draftsmith: could not build or load the fp32 panel kernel ({e}; "
            f"{detail.decode(errors='replace')[-400:]}); "
            f"fp32 linears run oneDNN's kernels (set {ENV}=0 to skip the attempt)",
            stacklevel=2,
        )
        return None
    return fn


def loaded(path: Path) -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    fn = ctypes.CDLL(str(path)).panel_linear
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
    fn.argtypes += [ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = None
    return fn


def self_check(fn: ctypes._CFuncPtr) -> None:  # type: ignore[name-defined]
    """One small product against float64, so a kernel built wrong never reaches a model."""
    g = torch.Generator().manual_seed(0)
    out = PANEL + 3  # a whole panel and a padded one
    w, b, x = torch.randn(out, 7, generator=g), torch.randn(out, generator=g), torch.randn(5, 7, generator=g)
    y, packed = torch.empty(5, out), pack_panels(w)  # held in names: a temporary's memory is freed before the call
    fn(x.data_ptr(), 5, 7, packed.data_ptr(), out, b.data_ptr(), y.data_ptr())
    want = torch.nn.functional.linear(x.double(), w.double(), b.double())
    if not torch.allclose(y.double(), want, rtol=1e-5, atol=1e-5):
        raise ArithmeticError("its self-check product differs from float64's")


def built_library() -> Path:
    """The kernel's shared library under the cache root, named for its source, flags and compiler; built (into a
    temp file, then renamed) where this machine has no intact copy of that one yet."""
    compiler = compiler_command()
    version = subprocess.run([*compiler, "--version"], capture_output=True, check=True).stdout
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + version).hexdigest()[:16]
    path = cache_root() / "kernels" / f"panels-{key}.so"
    if not intact(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        write_file_atomic(path, lambda tmp: compile_into(compiler, tmp))
        write_text_atomic(digest_path(path), file_digest(path))
    return path


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
    subprocess.run([*compiler, *FLAGS, str(SOURCE), "-o", str(out)], capture_output=True, check=True)


def pack_panels(weight: Tensor) -> Tensor:
    """A [out, in] fp32 weight as [panels, in, PANEL], its outputs padded with zeros to whole panels."""
    out, inp = weight.shape
    panels = -(-out // PANEL)
    padded = weight.new_zeros(panels * PANEL, inp)
    padded[:out] = weight.detach()
    return padded.view(panels, PANEL, inp).transpose(1, 2).contiguous()


def panel_linear(x: Tensor, panels: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
    """x @ W.T + bias for W packed by pack_panels; x fp32 [..., in]."""
    check_operands(x, panels, bias, out_features)
    rows = x.reshape(math.prod(x.shape[:-1]), x.shape[-1]).contiguous()
    if not len(rows) or not rows.shape[1]:  # nothing to multiply: the kernel is not called
        y = x.new_zeros(len(rows), out_features) + (0 if bias is None else bias)
        return y.view(*x.shape[:-1], out_features)
    y = x.new_empty(len(rows), out_features)
    fn = kernel()
    assert fn is not None, "panels are only packed where the kernel is built"
    b = None if bias is None else bias.contiguous()  # held in a name: its memory must outlive the call
    b_ptr = None if b is None else b.data_ptr()
    fn(rows.data_ptr(), len(rows), rows.shape[1], panels.data_ptr(), out_features, b_ptr, y.data_ptr())
    return y.view(*x.shape[:-1], out_features)


def check_operands(x: Tensor, panels: Tensor, bias: Tensor | None, out_features: int) -> None:
    """The kernel reads raw fp32 memory: shapes and dtypes are checked here, where a mistake can still be named."""
    if x.dtype != torch.float32 or not x.is_cpu:
        raise ValueError(f"the panel kernel multiplies fp32 CPU inputs, got {x.dtype} on {x.device}: cast the input")
    whole = panels.dim() == 3 and panels.shape[2] == PANEL and panels.is_contiguous()
    if not whole or panels.shape[0] * PANEL < out_features or panels.dtype != torch.float32:
        raise ValueError(f"panels {tuple(panels.shape)} do not hold {out_features} fp32 outputs: pack with pack_panels")
    if x.shape[-1] != panels.shape[1]:
        raise ValueError(f"input has {x.shape[-1]} features, the weight expects {panels.shape[1]}")
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (out_features,) or bias.is_cuda):
        raise ValueError(f"bias must be fp32 of shape ({out_features},), got {bias.dtype} {tuple(bias.shape)}")
