"""draftsmith's own fp32 CPU kernels as a library (cpu_kernels/native.py): where they are wanted, built once and kept
with their digest, rebuilt when damaged, and torch's kernels (one warning) where they cannot be built or loaded."""

from __future__ import annotations

import ctypes.util
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from draftsmith.cpu_kernels import native, panels, rope_attention
from draftsmith.cpu_kernels.packed import pack_weight

needs_kernels = pytest.mark.skipif(
    not native.wanted() or native.library() is None, reason="fp32 on AVX2 and AVX-512 CPUs"
)


@pytest.fixture
def fresh() -> Iterator[None]:
    """Forget the loaded library before and after: each test sees its own build."""
    forget = (native.library, panels.kernel, rope_attention.kernel)
    for f in forget:
        f.cache_clear()
    yield
    for f in forget:
        f.cache_clear()


@pytest.mark.parametrize(
    ("capability", "setting", "wanted"),
    [
        ("AVX2", "", True),
        ("AVX2", "0", False),
        ("AVX2", "off", False),
        ("AVX2", "False", False),
        ("AVX512", "", True),
        ("AVX512", "0", False),
        ("AVX512", "1", True),
        ("AVX512", "on", True),
        ("DEFAULT", "1", False),  # no AVX2, no kernel
        ("NO AVX", "", False),
    ],
)
def test_where_the_kernels_are_wanted(monkeypatch, capability, setting, wanted):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setenv(native.ENV, setting)
    assert native.wanted() is wanted


def test_a_setting_that_means_nothing_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(native.ENV, "fast")
    with pytest.raises(ValueError, match="DRAFTSMITH_KERNELS='fast'.*use 1 \\(on\\), 0 \\(off\\)"):
        native.wanted()


def test_cxx_may_carry_a_launcher(monkeypatch):
    monkeypatch.setenv("CXX", "ccache g++ ")
    assert native.compiler_command() == ["ccache", "g++"]


def test_kernels_that_cannot_be_built_warn_once_and_leave_torch(monkeypatch, tmp_path, fresh):
    if not native.wanted():
        pytest.skip("the kernels are not wanted on this CPU")
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.warns(UserWarning, match="could not build or load its fp32 CPU kernels.*DRAFTSMITH_KERNELS=0"):
        assert not panels.available()
    assert not panels.available() and not native.usable()  # said once: the result is kept
    assert pack_weight(torch.randn(8, 4)).dim() == 2
    assert not (tmp_path / "kernels").exists() or not any((tmp_path / "kernels").iterdir())


def test_a_library_without_the_kernels_warns_and_leaves_torch(monkeypatch, fresh):
    if not native.wanted():
        pytest.skip("the kernels are not wanted on this CPU")
    libm = ctypes.util.find_library("m")
    if libm is None:
        pytest.skip("no libm to stand in for a wrong library")
    monkeypatch.setattr(native, "built_library", lambda: Path(libm))
    with pytest.warns(UserWarning, match="could not build or load its fp32 CPU kernels.*panel_linear"):
        assert not panels.available()
    assert not native.usable()


@needs_kernels
def test_the_built_library_is_kept_with_its_digest(monkeypatch, tmp_path):
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))
    first = native.built_library()
    built = first.stat().st_mtime_ns
    assert native.built_library() == first and first.stat().st_mtime_ns == built  # not built twice
    names = sorted(p.name for p in first.parent.iterdir())
    assert names == [first.name, native.digest_path(first).name]  # its digest, and no temp file left beside it


@needs_kernels
def test_a_damaged_cached_library_is_rebuilt_not_loaded(monkeypatch, tmp_path):
    """A truncated shared library crashes the loader (SIGBUS): its bytes are checked against the digest first."""
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))
    path = native.built_library()
    whole = path.read_bytes()
    path.write_bytes(whole[:4096])
    assert native.built_library() == path and path.read_bytes() == whole
    native.digest_path(path).unlink()  # a library without its digest is not trusted either
    before = path.stat().st_mtime_ns
    assert native.built_library() == path and path.stat().st_mtime_ns != before and native.intact(path)


@needs_kernels
def test_the_version_names_the_library_that_runs(monkeypatch):
    """What a cost measured here holds for (serve/engine/cost_profile.py): the built library, or none when off."""
    assert native.version() == native.built_library().stem
    monkeypatch.setenv(native.ENV, "0")
    assert native.version() is None


@needs_kernels
def test_a_build_keeps_the_newest_libraries_and_removes_the_rest(monkeypatch, tmp_path):
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))
    folder = tmp_path / "kernels"
    folder.mkdir()
    for age in range(6):  # older builds (other sources), the oldest last
        old = folder / f"draftsmith-{age:016x}.so"
        old.write_bytes(b"old")
        native.digest_path(old).write_text("digest")
        os.utime(old, (1e9 - age, 1e9 - age))
    path = native.built_library()
    kept = sorted(p.name for p in folder.glob("*.so"))
    assert kept == sorted([path.name] + [f"draftsmith-{age:016x}.so" for age in range(native.KEEP - 1)])
    assert sorted(p.name for p in folder.glob("*.sha256")) == sorted(name + ".sha256" for name in kept)
    assert native.built_library() == path  # intact: no build, nothing pruned


@needs_kernels
def test_pruning_leaves_what_is_not_a_library_and_never_fails_the_build(monkeypatch, tmp_path):
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))
    folder = tmp_path / "kernels"
    (folder / "draftsmith-y.so").mkdir(parents=True)  # a directory
    (folder / "draftsmith-link.so").symlink_to(folder / "nowhere.so")  # a dangling link
    for age in range(5):
        old = folder / f"draftsmith-{age:016x}.so"
        old.write_bytes(b"old")
        os.utime(old, (1e9 - age, 1e9 - age))
    path = native.built_library()
    assert path.is_file() and (folder / "draftsmith-y.so").is_dir() and (folder / "draftsmith-link.so").is_symlink()
    assert len(list(folder.glob("draftsmith-0*.so"))) == native.KEEP - 1
