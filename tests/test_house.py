"""House rules the code itself can check: a comment or a name says what code does and why, never which tracker
entry it came from (the reason stays, the history lives in git and the tracker)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the package's folders (draftsmith/ holds __init__.py and files.py), the tests, the scripts and the benchmarks
FOLDERS = (
    "cpu_kernels",
    "runtime",
    "heads",
    "serve",
    "train",
    "eval",
    "peers",
    "conf",
    "draftsmith",
    "tests",
    "scripts",
    "benchmarks",
    ".ci",
)
TEXT = {".py", ".yaml", ".yml", ".json", ".sh", ".toml", ".md", ".txt", ".cfg", ".ini", ""}
# a tracker entry by number, in prose or in a name (a word "issue" then a number, maybe after a space, _ or -)
TRACKER = re.compile(r"issue[ _-]?[0-9]+", re.IGNORECASE)


def files(root: Path) -> list[Path]:
    """The text files under root's FOLDERS, symlinks (draftsmith/'s links) and caches skipped."""
    out = []
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*")):
            rel = path.relative_to(root)
            if any((root / Path(*rel.parts[: i + 1])).is_symlink() for i in range(len(rel.parts))):
                continue
            if "__pycache__" in rel.parts or not path.is_file() or path.suffix not in TEXT:
                continue
            out.append(path)
    return out


def tracker_mentions(root: Path) -> list[str]:
    """file:line: text for each line that names a tracker entry by number."""
    found = []
    for path in files(root):
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if TRACKER.search(line):
                found.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
    return found


def test_no_tracker_numbers_in_package_tests_or_conf():
    found = tracker_mentions(ROOT)
    assert not found, "name what the code does, not the tracker entry:\n" + "\n".join(found)


def test_the_scan_sees_prose_and_names(tmp_path):
    word = "iss" + "ue"  # spelled apart so this file passes its own scan
    (tmp_path / "heads").mkdir()
    (tmp_path / "conf").mkdir()
    (tmp_path / "heads" / "a.py").write_text(f"x = 1  # {word.title()} 15: why\nKEYS_{word.upper()}2 = ()\nok = 3\n")
    (tmp_path / "conf" / "b.yaml").write_text(f"k: 1  # see {word} 7\nissues: fine\n")
    (tmp_path / "heads" / "__pycache__").mkdir()
    (tmp_path / "heads" / "__pycache__" / "c.py").write_text(f"# {word} 1\n")
    found = tracker_mentions(tmp_path)
    assert sorted(":".join(f.split(":")[:2]) for f in found) == ["conf/b.yaml:1", "heads/a.py:1", "heads/a.py:2"]
