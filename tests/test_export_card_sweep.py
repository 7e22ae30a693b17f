"""The export card's draft length under concurrency in vLLM: with a measured sweep (vllm_sweep=results.json) it
recommends K per level, says where it was measured, and gives the --speculative-config with vLLM 0.32's batch-size
schedule; without one it says none was measured; a sweep for another method or a format vLLM does not serve is
refused. draftsmith-eval prints the same recommendation in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftsmith.eval.__main__ import sweep_line
from draftsmith.serve.export.base import ExportError
from draftsmith.serve.export.draft_lengths import Point
from draftsmith.serve.export.pipeline import export
from draftsmith.serve.export.vllm_sweep import KEY, Sweep, record
from helpers import export_drafters

pytestmark = pytest.mark.usefixtures("one_thread")

POINTS = [  # K=2 pays at N=1, nothing at N=8; K=5 is the tiny drafter's depth: the card's K
    *(Point(1, 1, 1.10, [1.05, 1.15]), Point(2, 1, 1.30, [1.25, 1.35]), Point(5, 1, 1.00, [0.95, 1.05])),
    *(Point(1, 8, 0.90, [0.85, 0.95]), Point(2, 8, 0.80, [0.75, 0.85]), Point(5, 8, 0.60, [0.55, 0.65])),
]


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir, tmp_path_factory):
    return export_drafters(tiny_llama_dir("llama"), tmp_path_factory.mktemp("card"), {"eagle3": ("eagle3", {})})


def sweep_file(folder: Path, method: str = "eagle3") -> Path:
    sweep = Sweep(method, "/x/export", "AMD EPYC (avx2), 2 cores", "0.32.0", "2026-12-06 11:30 UTC", 1, POINTS)
    path = folder / "results.json"
    path.write_text(json.dumps({KEY: record(sweep)}))
    return path


def card(tiny, out: Path, fmt: str = "vllm", sweep: Path | None = None) -> str:
    tcfg, drafters, _ = tiny
    folder = export(drafters["eagle3"], fmt, out, tcfg, "fp32", vllm_sweep=str(sweep) if sweep else None)
    return (folder / "README.md").read_text()


def test_the_card_recommends_from_a_measured_sweep(tiny, tmp_path):
    path = sweep_file(tmp_path)
    text = card(tiny, tmp_path / "out", sweep=path)
    assert "## Draft length under concurrency (vLLM)" in text
    assert f"vLLM 0.32.0 on AMD EPYC (avx2), 2 cores, 2026-12-06 11:30 UTC (`{path}`" in text
    assert "| concurrent requests | recommended | its speedup | K=5 (the command above) |" in text
    assert "| 1 | K=2 | 1.30x [1.25, 1.35] | 1.00x [0.95, 1.05] |" in text
    assert "| 8 | off | - | 0.60x [0.55, 0.65] |" in text
    assert "Speculation off above 1 concurrent request." in text and "no option that turns speculation off" in text
    schedule = '"num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[1, 1, 2], [2, 8, 0]]}'
    assert f'--speculative-config \'{{"method": "eagle3", "model": "{(tmp_path / "out").resolve()}"' in text
    assert schedule in text


def test_without_a_sweep_the_card_says_none_was_measured(tiny, tmp_path):
    text = card(tiny, tmp_path / "out")
    assert "No concurrency sweep was measured for this export" in text
    assert f"bash scripts/vllm_concurrency.sh --export {(tmp_path / 'out').resolve()} --k 1 2 3" in text


def test_a_sweep_that_does_not_fit_is_refused(tiny, tmp_path):
    with pytest.raises(ExportError, match="measured vLLM's 'draft_model' method, but this export is served as"):
        card(tiny, tmp_path / "out", sweep=sweep_file(tmp_path, method="draft_model"))
    with pytest.raises(ExportError, match="format=gguf is not served by vLLM"):
        card(tiny, tmp_path / "out", fmt="gguf", sweep=sweep_file(tmp_path))
    with pytest.raises(ExportError, match="vllm_sweep: .* does not exist"):
        card(tiny, tmp_path / "out", sweep=tmp_path / "missing.json")
    assert not (tmp_path / "out").exists()


def test_eval_prints_the_recommendation_line(tmp_path, capsys):
    line = sweep_line(str(sweep_file(tmp_path)))
    assert line.startswith("  vLLM draft length by concurrency (vLLM 0.32.0 on AMD EPYC (avx2), 2 cores")
    assert "N=1: K=2, N=8: off; speculation off above 1 concurrent request; --speculative-config keys" in line
    assert sweep_line(None) == ""
    (tmp_path / "old.json").write_text('{"levels": []}')
    with pytest.raises(SystemExit, match="draftsmith-eval: vllm_sweep: .*not a draft-length sweep"):
        sweep_line(str(tmp_path / "old.json"))
