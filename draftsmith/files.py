"""Writing files and folders so that a reader, or a run killed mid-way, sees the old version or the new one and
never a half-written one: write beside the destination, then rename into place (a rename is atomic on one
filesystem). Every writer in the package goes through these: drafter folders, the converted target, exports,
training checkpoints, the feature cache, eval results."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

DEFAULT_CACHE = "~/.cache/draftsmith"


def cache_root(cache_dir: str | None = None) -> Path:
    """Where converted targets, feature caches, regenerated answers and built kernels go: target.cache_dir when
    set, else $DRAFTSMITH_CACHE, else ~/.cache/draftsmith."""
    return Path(cache_dir or os.environ.get("DRAFTSMITH_CACHE") or DEFAULT_CACHE).expanduser()


def write_file_atomic(path: Path, write: Callable[[Path], object]) -> None:
    """write(tmp) fills a temp file beside path, which then replaces path; on failure path is untouched. The temp
    name is unique, so two processes writing the same file (two servers measuring one profile) never share it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")  # write() creates it: umask's mode
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(path: Path, text: str) -> None:
    write_file_atomic(path, lambda tmp: tmp.write_text(text))


@contextmanager
def temp_folder_beside(out: Path, mode: int | None = None) -> Iterator[Path]:
    """A fresh temp folder in out's parent (same filesystem, so move_into_place is a rename), removed on exit
    unless moved. mode: its permissions (mkdtemp makes it owner-only)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    if mode is not None:
        tmp.chmod(mode)
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def move_into_place(tmp: Path, out: Path) -> None:
    """Rename the finished folder tmp to out; an existing out is moved aside first and removed only once the new
    one is in place, so a crash in between leaves one of them whole."""
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}-old-", dir=out.parent))
        os.replace(out, old / out.name)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
