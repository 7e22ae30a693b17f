"""Imports follow docs/design.md: cpu_kernels <- runtime <- heads <- serve <- train, serve <- eval, train and eval <-
peers, and draftsmith/'s own modules (files.py) import none of them; nothing imports a __main__; no
two modules import each other, however indirectly. The workers run by path in vLLM's own Python (STANDALONE) import
no draftsmith at all. In tests/, no file imports a test module or conftest: what several
modules share is in helpers.py (plain code) or conftest.py (fixtures), so running one test file never runs another's
module code.

Every import statement in the packages' files is read with `ast` (those inside functions and TYPE_CHECKING blocks
too), relative ones resolved against the file's package."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ALLOWED = {
    "draftsmith": set(),
    "cpu_kernels": {"cpu_kernels"},
    "runtime": {"cpu_kernels", "runtime"},
    "heads": {"cpu_kernels", "runtime", "heads"},
    "serve": {"cpu_kernels", "runtime", "heads", "serve"},
    "train": {"cpu_kernels", "runtime", "heads", "serve", "train"},
    "eval": {"cpu_kernels", "runtime", "heads", "serve", "eval"},
    "peers": {"cpu_kernels", "runtime", "heads", "serve", "train", "eval", "peers"},
}
# run by their path in vLLM's own Python, where draftsmith is not installed
STANDALONE = ("train/regenerate_vllm_worker.py", "peers/vllm_worker.py", "peers/vllm_reload_worker.py")


def module_name(path: Path) -> str:
    """draftsmith.serve.engine.step for serve/engine/step.py, draftsmith.files for draftsmith/files.py; a package's
    __init__.py is the package."""
    parts = ["draftsmith", *path.relative_to(ROOT).with_suffix("").parts]
    if parts[1] == "draftsmith":
        parts = parts[1:]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of each import statement in the file, one per module it names: `from X import a`
    names X.a too, so a module imported by name (`from . import __main__`) is seen."""
    here = module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative to the file's package
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return out


def refusal(package: str, module: str) -> str | None:
    parts = module.split(".")
    if "__main__" in parts:
        return "a __main__ module"
    if parts[0] == "draftsmith" and len(parts) > 1 and parts[1] in ALLOWED and parts[1] not in ALLOWED[package]:
        return f"{package} may import only {', '.join(sorted(ALLOWED[package]))}"
    return None


def violations(package: str) -> list[str]:
    """One line per import statement that breaks the layers: file:line, the module and why."""
    bad = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        for line, module in imported(path):
            why = refusal(package, module)
            where = f"{path.relative_to(ROOT)}:{line}"
            if why and where not in bad:
                bad[where] = f"{where} imports {module} ({why})"
    return list(bad.values())


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_follow_the_layers(package):
    assert violations(package) == []


def test_the_walk_sees_what_it_should_refuse(tmp_path, monkeypatch):
    pkg = tmp_path / "heads"
    pkg.mkdir()
    (pkg / "x.py").write_text(
        "from draftsmith.serve.build import load_target\n"
        "def f():\n    from ..train import log\n"
        "from .__main__ import main\n"
        "from draftsmith.eval import __main__\n"
        "import draftsmith.runtime.llama\n"
    )
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    found = violations("heads")
    assert len(found) == 4 and not any("runtime.llama" in v for v in found)
    assert any("draftsmith.train" in v for v in found) and any("draftsmith.heads.__main__" in v for v in found)


def test_the_lower_rooms_refuse_what_sits_above_them(tmp_path, monkeypatch):
    for room, line in [
        ("cpu_kernels", "from draftsmith.runtime.kv_cache import KVCache\n"),
        ("runtime", "from draftsmith.heads import kinds\n"),
        ("draftsmith", "from draftsmith.cpu_kernels import native\n"),
    ]:
        (tmp_path / room).mkdir()
        (tmp_path / room / "x.py").write_text(line + "from draftsmith.files import cache_root\n")
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    assert [len(violations(room)) for room in ("cpu_kernels", "runtime", "draftsmith")] == [1, 1, 1]


def draftsmith_imports(path: Path) -> list[str]:
    """One line per import of draftsmith in the file, a relative one (resolved into the package) included."""
    where = path.relative_to(ROOT)
    return [f"{where}:{line} imports {m}" for line, m in imported(path) if m.split(".")[0] == "draftsmith"]


def test_standalone_workers_import_no_draftsmith():
    assert all((ROOT / f).is_file() for f in STANDALONE)
    assert [v for f in STANDALONE for v in draftsmith_imports(ROOT / f)] == []


def test_the_standalone_walk_sees_absolute_and_relative_imports(tmp_path, monkeypatch):
    (tmp_path / "peers").mkdir()
    worker = tmp_path / "peers" / "w.py"
    lines = ["import json", "import vllm_worker", "from draftsmith.files import x", "def f():", "    from . import y"]
    worker.write_text("\n".join(lines) + "\n")
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    assert [v.split(" ")[0] for v in draftsmith_imports(worker)] == ["peers/w.py:3", "peers/w.py:5"]


def test_importing_the_runtime_registers_no_drafter_kinds():
    """The target's model and its kernels load without the drafters: draftsmith.heads (whose import registers every
    kind) stays unimported."""
    code = (
        "import sys, draftsmith.runtime.llama, draftsmith.runtime.static_forward\n"
        "import draftsmith.cpu_kernels.decoder_stack\n"
        "print(sorted(m for m in sys.modules if m.startswith('draftsmith.heads')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def import_graph() -> dict[str, set[str]]:
    """Each package module and the package modules it imports: `from X import a` counts X.a where that is a
    module, else X (a package's __init__ is imported before any of its modules in every case, so it is not an
    edge of its own)."""
    paths = [p for package in ALLOWED for p in sorted((ROOT / package).rglob("*.py"))]
    modules = {module_name(p) for p in paths}
    graph = {}
    for path in paths:
        edges = set()
        for _, name in imported(path):
            edges |= {name} if name in modules else {name.rpartition(".")[0]} & modules
        graph[module_name(path)] = edges - {module_name(path)}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_no_import_cycles():
    found = cycles(import_graph())
    assert found == [], "import cycles (move the shared types into a leaf module):\n" + "\n".join(
        " <-> ".join(c) for c in found
    )


def test_the_cycle_walk_finds_indirect_and_hidden_imports():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert cycles(graph) == [["a", "b", "c"]]


def imports_of_test_modules(tests: Path) -> list[str]:
    """One line per import statement in tests/ (inside functions too) that names a test module (a test_*.py
    there) or conftest, as `import test_x`, `from test_x import a` or `from tests import test_x`."""
    modules = {p.stem for p in tests.glob("test_*.py")} | {"conftest"}
    bad = []
    for path in sorted(tests.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [f"{node.module or ''}.{a.name}" for a in node.names]
            else:
                continue
            named = sorted({part for name in names for part in name.split(".")} & modules)
            if named:
                bad.append(f"{path.relative_to(tests.parent)}:{node.lineno} imports {', '.join(named)}")
    return bad


def test_no_test_module_imports_another():
    assert imports_of_test_modules(ROOT / "tests") == []


def test_the_tests_walk_sees_a_test_module_imported(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_a.py").write_text("import torch\nfrom helpers import PROMPTS\n")
    (tests / "test_b.py").write_text(
        "from test_a import PROMPTS\ndef f():\n    import test_a\nfrom tests import test_a\nimport conftest\n"
    )
    (tests / "helpers.py").write_text("from test_b import f\n")
    found = imports_of_test_modules(tests)
    assert len(found) == 5 and all("test_a.py" not in v for v in found), found
