"""draftsmith/files.py: writes land whole or not at all."""

from pathlib import Path

import pytest

from draftsmith.files import move_into_place, temp_folder_beside, write_file_atomic, write_text_atomic


def test_a_failed_file_write_leaves_the_old_file_and_no_temp(tmp_path: Path):
    path = tmp_path / "results.json"
    write_text_atomic(path, "old")

    def fail(tmp: Path):
        tmp.write_text("half")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        write_file_atomic(path, fail)
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]
    write_text_atomic(path, "new")
    assert path.read_text() == "new"


def test_two_writers_of_one_file_never_share_a_temp(tmp_path: Path):
    """Two processes writing the same file each use their own temp: one's cleanup cannot remove the other's."""
    path, temps = tmp_path / "profile.json", []

    def outer(tmp: Path):
        temps.append(tmp)
        write_file_atomic(path, lambda inner: (temps.append(inner), inner.write_text("inner")))
        tmp.write_text("outer")  # the inner write's cleanup must not have taken this one's temp

    write_file_atomic(path, outer)
    assert temps[0] != temps[1] and path.read_text() == "outer"
    assert [p.name for p in tmp_path.iterdir()] == ["profile.json"]


def test_a_folder_replaces_the_old_one_only_when_finished(tmp_path: Path):
    out = tmp_path / "drafter"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    with pytest.raises(RuntimeError), temp_folder_beside(out) as tmp:
        (tmp / "model.safetensors").write_text("half")
        raise RuntimeError("killed")
    assert [p.name for p in tmp_path.iterdir()] == ["drafter"] and (out / "stale.txt").is_file()
    with temp_folder_beside(out, mode=0o755) as tmp:
        assert tmp.parent == tmp_path and tmp.stat().st_mode & 0o777 == 0o755
        (tmp / "model.safetensors").write_text("new")
        move_into_place(tmp, out)
    assert [p.name for p in tmp_path.iterdir()] == ["drafter"]
    assert [p.name for p in out.iterdir()] == ["model.safetensors"]
