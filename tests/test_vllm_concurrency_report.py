"""eval/vllm_concurrency_report.py: throughput pooled over rounds and paired by round, TPOT paired by request,
τ from the counters, identical outputs counted, the concurrency at which speculation stops paying, and, over
passes of several draft lengths, the recommendation per level written to results.json and report.md."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftsmith.eval.vllm_concurrency_report import (
    Block,
    Level,
    Request,
    level,
    stops_paying,
    tpot_s,
    verdict,
    write_report,
)
from draftsmith.serve.export.vllm_sweep import read_sweep


def block(
    arm: str, n: int, rnd: int, wall: float, tpot: float, text: str = "a", drafts: float = 0, acc: float = 0, draft=""
):
    requests = [Request(f"{rnd}/{i}", 10, tpot, text) for i in range(2 * n)]
    cpu = {a: 1.0 if a == arm else 0.1 for a in ("plain", "spec")}  # the idle server: a tenth of the busy one
    return Block(arm, n, rnd, wall, requests, drafts, acc, cpu, draft)


def test_tpot_leaves_out_what_it_cannot_time() -> None:
    assert tpot_s(1.0, 0.1, 10) == pytest.approx(0.1)
    assert tpot_s(1.0, 0.1, 1) is None
    assert tpot_s(1.0, None, 10) is None
    assert tpot_s(None, 0.1, 10) is None


def test_a_level_pools_rounds_and_pairs_requests() -> None:
    blocks = []
    for rnd, wall in enumerate((4.0, 6.0, 5.0)):  # the machine's speed varies by round; spec stays twice as fast
        blocks += [block("plain", 2, rnd, wall, 0.05), block("spec", 2, rnd, wall / 2, 0.025, drafts=10, acc=5)]
    blocks[-1].requests[0].text = "b"
    row = level(blocks, 2)
    assert row.rounds == 3 and row.pairs == 12
    assert row.tok_s["plain"] == pytest.approx(120 / 15)
    assert row.throughput_speedup == pytest.approx(2.0)
    assert row.throughput_speedup_interval == pytest.approx([2.0, 2.0])  # paired by round: the variation cancels
    assert row.tok_s_interval["plain"][0] < row.tok_s["plain"] < row.tok_s_interval["plain"][1]
    assert row.tpot_ms == pytest.approx({"plain": 50.0, "spec": 25.0})
    assert row.tpot_speedup == pytest.approx(2.0)
    assert row.tau == pytest.approx(1.5)
    assert (row.identical, row.compared) == (11, 12)


def test_one_round_has_no_throughput_interval() -> None:
    row = level([block("plain", 1, 0, 4.0, 0.05), block("spec", 1, 0, 5.0, 0.06)], 1)
    assert row.throughput_speedup == pytest.approx(0.8) and row.throughput_speedup_interval is None
    assert row.tau is None
    assert stops_paying([row])[0] == 1


def row(n: int, speedup: float, iv: list[float] | None) -> Level:
    arms = {"plain": None, "spec": None}
    return Level(n, 3, 6, arms, arms, speedup, iv, arms, arms, None, None, None, None, 0, 0)


def test_speculation_stops_paying_where_the_interval_reaches_one() -> None:
    rows = [row(1, 1.3, [1.2, 1.4]), row(4, 1.1, [0.98, 1.2]), row(8, 1.2, [1.05, 1.3]), row(16, 0.8, [0.7, 0.9])]
    assert stops_paying(rows)[0] == 4
    assert "stops paying at N=4" in verdict(rows) and "slower than plain decoding at N=16" in verdict(rows)
    assert stops_paying(rows[:1]) == (None, "")
    assert "pays through N=1" in verdict(rows[:1])


def test_the_report_is_written(tmp_path: Path) -> None:
    blocks = [
        block(arm, n, r, 4.0, 0.05, drafts=4, acc=2) for n in (1, 2) for r in range(2) for arm in ("plain", "spec")
    ]
    rows = write_report(blocks, {"setting": "a test"}, tmp_path)
    result = json.loads((tmp_path / "results.json").read_text())
    (entry,) = result["passes"]
    assert [lv["concurrency"] for lv in entry["levels"]] == [1, 2] == [r.concurrency for r in rows[""]]
    assert entry["stops_paying_at"] == 1  # equal speeds: it does not pay
    assert "draft_lengths" not in result  # no pass of a known K: nothing to recommend from
    report = (tmp_path / "report.md").read_text()
    assert "| N | plain tok/s |" in report and "stops paying at N=1" in report and "idle one 0.8 CPU s" in report
    assert "over 2 round(s) only" in report
    assert (tmp_path / "speedup_vs_concurrency.png").stat().st_size > 0


def k_pass(label: str, speedups: dict[int, float], rounds: int = 5, schedule: bool = False) -> list[Block]:
    """Plain and spec blocks of one pass; spec's wall time is plain's / speedup, varying a little by round."""
    blocks = []
    for n, speedup in speedups.items():
        for r in range(rounds):
            wall = 4.0 + 0.1 * r
            blocks += [block("plain", n, r, wall, 0.05, draft=label)]
            blocks += [block("spec", n, r, wall / (speedup * (1 + 0.01 * (r % 2))), 0.04, draft=label, drafts=4)]
    return blocks


SWEEP = {"method": "eagle3", "model": "/x/export", "machine": "AMD EPYC (avx2), 2 cores", "vllm": "0.32.0"}


def sweep_meta(labels: list[tuple[str, int | None]]) -> dict:
    passes = [{"label": label, "k": k, "spec": {"num_speculative_tokens": k or 3}} for label, k in labels]
    return {"setting": "a test", "passes": passes, "sweep": SWEEP | {"date": "2026-12-06 11:30 UTC", "default_k": 1}}


def test_several_draft_lengths_give_a_recommendation_per_level(tmp_path: Path) -> None:
    blocks = k_pass("K=1", {1: 1.1, 4: 1.05, 16: 0.8}) + k_pass("K=3", {1: 1.4, 4: 0.9, 16: 0.6})
    blocks += k_pass("schedule", {1: 1.38, 4: 1.04, 16: 0.98})
    meta = sweep_meta([("K=1", 1), ("K=3", 3), ("schedule", None)])
    passes = write_report(blocks, meta, tmp_path)
    assert list(passes) == ["K=1", "K=3", "schedule"]
    result = json.loads((tmp_path / "results.json").read_text())
    assert [p["label"] for p in result["passes"]] == ["K=1", "K=3", "schedule"]
    assert {p["k"] for p in result["draft_lengths"]["points"]} == {1, 3}  # the schedule pass is not a K
    sweep = read_sweep(tmp_path / "results.json")
    assert [(c.concurrency, c.k) for c in sweep.choices()] == [(1, 3), (4, 1), (16, 0)]
    report = (tmp_path / "report.md").read_text()
    assert "| N | K=1 (card) | K=3 | schedule | recommended |" in report
    assert "**Recommendation: speculation off above 4 concurrent requests.**" in report
    assert '"num_speculative_tokens_per_batch_size": [[1, 1, 3], [2, 4, 1], [5, 16, 0]]' in report
    assert "N=1: K=3 at 1.41x [1.40, 1.41] instead of 1.10x" in report and "N=4: the card's K (1.05x" in report
    assert "N=16: plain decoding (1.00x) instead of 0.80x" in report
    assert "## K=3: `" in report and "no `n_predict`" in report
