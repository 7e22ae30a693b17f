"""serve/export/draft_lengths.py and vllm_sweep.py: the draft length per concurrency from synthetic sweep results
(the best paying K, off where no interval lies above 1, the shortest of K tied within intervals), vLLM 0.32's
batch-size schedule for it, and a sweep's results.json read back (or refused, naming the fix)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftsmith.serve.export.draft_lengths import (
    SCHEDULE_KEY,
    Point,
    off_above,
    one_line,
    recommend,
    schedule,
    speculative_options,
)
from draftsmith.serve.export.vllm_sweep import KEY, Sweep, SweepError, read_sweep, record


def pt(k: int, n: int, lo: float, hi: float) -> Point:
    return Point(k, n, (lo + hi) / 2, [lo, hi])


CURVE = [  # K=3 pays most at N=1, K=1 alone pays at N=4, nothing pays at N=16
    *(pt(1, 1, 1.05, 1.15), pt(2, 1, 1.15, 1.25), pt(3, 1, 1.30, 1.40)),
    *(pt(1, 4, 1.02, 1.08), pt(2, 4, 0.95, 1.05), pt(3, 4, 0.90, 1.00)),
    *(pt(1, 16, 0.70, 0.80), pt(2, 16, 0.60, 0.70), pt(3, 16, 0.50, 0.60)),
]


def test_the_best_paying_k_per_level_and_off_where_none_pays() -> None:
    choices = recommend(CURVE)
    assert [(c.concurrency, c.k) for c in choices] == [(1, 3), (4, 1), (16, 0)]
    assert choices[0].speedup == pytest.approx(1.35) and choices[0].interval == [1.30, 1.40]
    assert choices[2].speedup is None and "no K" in choices[2].why
    assert off_above(choices) == 4
    assert one_line(choices) == "N=1: K=3, N=4: K=1, N=16: off; speculation off above 4 concurrent requests"


def test_an_interval_that_reaches_one_does_not_pay() -> None:
    choices = recommend([pt(1, 2, 1.00, 1.30), Point(2, 2, 1.5, None)])  # touching 1; one round: no interval
    assert choices[0].k == 0
    assert off_above(choices) == 0 and "every level" in one_line(choices)
    assert speculative_options(choices) is None


def test_k_tied_within_intervals_take_the_shortest() -> None:
    apart = recommend([pt(1, 8, 1.10, 1.30), pt(2, 8, 1.15, 1.35), pt(3, 8, 1.40, 1.50)])
    assert apart[0].k == 3 and apart[0].why == "the best throughput"
    tied = recommend([pt(1, 8, 1.10, 1.30), pt(2, 8, 1.15, 1.42), pt(3, 8, 1.40, 1.50)])
    assert tied[0].k == 2 and tied[0].why == "tied with K=3 within intervals: the shortest"  # K=1's ends below
    tied = recommend([pt(1, 8, 1.10, 1.42), pt(2, 8, 1.20, 1.45), pt(3, 8, 1.40, 1.50)])
    assert tied[0].k == 1 and tied[0].why == "tied with K=2, K=3 within intervals: the shortest"
    assert tied[0].speedup == pytest.approx(1.26)


def test_the_schedule_gives_sizes_between_levels_the_larger_levels_k() -> None:
    choices = recommend(CURVE)
    assert schedule(choices) == [[1, 1, 3], [2, 4, 1], [5, 16, 0]]
    assert speculative_options(choices) == {
        "num_speculative_tokens": 3,
        SCHEDULE_KEY: [[1, 1, 3], [2, 4, 1], [5, 16, 0]],
    }
    same = recommend([pt(2, 1, 1.1, 1.2), pt(2, 4, 1.1, 1.2), pt(1, 16, 0.8, 0.9), pt(2, 16, 0.8, 0.9)])
    assert schedule(same) == [[1, 4, 2], [5, 16, 0]]  # neighbouring ranges with one K merged


def test_a_level_off_below_a_paying_one_is_named() -> None:
    choices = recommend([pt(1, 1, 0.9, 1.1), pt(1, 4, 1.1, 1.2), pt(1, 16, 0.8, 0.9)])
    assert (
        one_line(choices) == "N=1: off, N=4: K=1, N=16: off; speculation off above 4 concurrent requests (and at N=1)"
    )
    assert schedule(choices) == [[1, 1, 0], [2, 4, 1], [5, 16, 0]]


def test_one_k_everywhere_needs_no_schedule() -> None:
    choices = recommend([pt(2, 1, 1.1, 1.2), pt(2, 4, 1.1, 1.2)])
    assert speculative_options(choices) == {"num_speculative_tokens": 2}
    assert off_above(choices) is None and "pays up to N=4" in one_line(choices)


def sweep_file(tmp_path: Path, points: list[Point]) -> Path:
    sweep = Sweep("eagle3", "/x/export", "AMD EPYC (avx2), 2 cores", "0.32.0", "2026-12-06 11:30 UTC", 1, points)
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"setting": "s", KEY: record(sweep)}))
    return path


def test_a_sweep_is_read_back_with_where_it_was_measured(tmp_path: Path) -> None:
    path = sweep_file(tmp_path, CURVE)
    sweep = read_sweep(path)
    assert sweep.points == CURVE and sweep.default_k == 1 and sweep.source == str(path)
    assert [c.k for c in sweep.choices()] == [3, 1, 0]
    line = sweep.line()
    assert "vLLM 0.32.0 on AMD EPYC (avx2), 2 cores" in line and str(path) in line
    assert "N=1: K=3, N=4: K=1, N=16: off; speculation off above 4 concurrent requests; --speculative-config" in line
    assert line.endswith('"num_speculative_tokens_per_batch_size": [[1, 1, 3], [2, 4, 1], [5, 16, 0]]}')


@pytest.mark.parametrize(
    "content,message",
    [
        (None, "does not exist: give the results.json"),
        ("{", "not readable JSON"),
        ('{"levels": []}', "no `draft_lengths` entry: it is not a draft-length sweep"),
        ('{"draft_lengths": {"method": "eagle3"}}', "malformed"),
    ],
)
def test_a_bad_sweep_file_is_refused_with_the_fix(tmp_path: Path, content: str | None, message: str) -> None:
    path = tmp_path / "results.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SweepError, match=message):
        read_sweep(path)
    with pytest.raises(SweepError, match="measured no point"):
        read_sweep(sweep_file(tmp_path, []))
