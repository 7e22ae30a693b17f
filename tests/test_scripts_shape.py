"""scripts/ holds the shell entry points alone: what they run is package code or a benchmark. Every function and
method in benchmarks/ and peers/ (the checks that left scripts/ for the package), recursively, is at most MAX_LINES
long, read with `ast`.

A function's length is `end_lineno - lineno + 1` of its def (decorators excluded); nested functions count on their
own and inside the one that holds them."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = (ROOT / "benchmarks", ROOT / "peers")
MAX_LINES = 50


def long_functions(path: Path, root: Path = ROOT, limit: int = MAX_LINES) -> list[str]:
    """'file:line name (N lines)' for each function in the file longer than limit, the file relative to root."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            if n > limit:
                out.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({n} lines)")
    return out


def test_scripts_hold_no_python() -> None:
    found = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "scripts").rglob("*.py"))
    assert found == [], "scripts/ holds shell entry points: move these into the package or benchmarks/"


def test_scripts_are_found() -> None:
    assert all(len(list(folder.rglob("*.py"))) >= 5 for folder in FOLDERS)


def test_long_functions_are_seen(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))  # def line + MAX_LINES body lines
    (tmp_path / "long.py").write_text(f"def long():\n{body}\n\n\ndef short():\n    return 1\n")
    assert long_functions(tmp_path / "long.py", tmp_path) == [f"long.py:1 long ({MAX_LINES + 1} lines)"]


def test_script_functions_are_short() -> None:
    found = [f for folder in FOLDERS for path in sorted(folder.rglob("*.py")) for f in long_functions(path)]
    assert not found, f"functions over {MAX_LINES} lines; split them into named steps:\n" + "\n".join(found)
