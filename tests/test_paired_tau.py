"""Two drafters of one eval run compared by their τ, paired over the same prompts (eval/paired_tau.py)."""

from __future__ import annotations

import pytest

from draftsmith.eval.aggregate import Record
from draftsmith.eval.journal import RECORDS, RUN, Unit, unit_line
from draftsmith.eval.paired_tau import method_records, paired_tau
from draftsmith.serve.engine.metrics import Metrics


def turn(pid: str, method: str, drafts: int, by_position: list[int]) -> Record:
    m = Metrics(drafts=drafts, accepted_tokens=sum(by_position), accepted_per_position=by_position)
    return Record(pid, "c", 0, 0, method, False, [], "", m)


def test_the_ratio_is_tight_where_prompts_differ_but_one_head_accepts_more_on_each():
    """Prompts accept 10% to 90% of drafts; head a accepts half again as many first positions as b on every prompt.
    Pairing keeps the ratio's interval narrow although each head's own τ spreads with the prompts."""
    a = [turn(f"p{i}", "a", 100, [min(100, 15 * (i + 1)), 5]) for i in range(6)]
    b = [turn(f"p{i}", "b", 100, [10 * (i + 1), 5]) for i in range(6)]
    r = paired_tau({"a": a, "b": b})
    assert r["a"]["tau"] == pytest.approx(1 + (sum(min(100, 15 * (i + 1)) for i in range(6)) + 30) / 600)
    assert r["b"]["acceptance_by_position"] == pytest.approx([210 / 600, 30 / 600])
    assert r["tau_ratio"] == pytest.approx(r["a"]["tau"] / r["b"]["tau"]) and r["tau_ratio"] > 1
    low, high = r["tau_ratio_interval"]
    assert 1 < low <= r["tau_ratio"] <= high
    own_low, own_high = r["a"]["tau_interval"]
    assert own_high - own_low > high - low  # the unpaired interval carries the prompts' spread


def test_heads_that_ran_other_prompts_are_refused():
    a = [turn("p0", "a", 10, [5]), turn("p1", "a", 10, [5])]
    b = [turn("p0", "b", 10, [5]), turn("p2", "b", 10, [5])]
    with pytest.raises(ValueError, match="ran other prompts"):
        paired_tau({"a": a, "b": b})


def test_a_shallower_head_reads_zero_past_its_depth():
    a = [turn(f"p{i}", "a", 10, [6, 2]) for i in range(3)]
    b = [turn(f"p{i}", "b", 10, [6]) for i in range(3)]
    r = paired_tau({"a": a, "b": b})
    assert r["a"]["acceptance_by_position"] == pytest.approx([0.6, 0.2])
    assert r["b"]["acceptance_by_position"] == pytest.approx([0.6])
    assert r["tau_ratio"] == pytest.approx(1.8 / 1.6)


def test_a_method_the_run_lacks_is_named_with_the_ones_it_has(tmp_path):
    units = [Unit(f"p{i}", 0, [turn(f"p{i}", "ar", 0, []), turn(f"p{i}", "main", 10, [4])], []) for i in range(2)]
    (tmp_path / RECORDS).write_text("".join(unit_line(u) for u in units))
    assert [r.id for r in method_records(tmp_path, ("main", "ar"))["main"]] == ["p0", "p1"]
    with pytest.raises(ValueError, match=r"no records of \['arm'\]; its methods are \['ar', 'main'\]"):
        method_records(tmp_path, ("main", "arm"))


def test_a_head_that_made_no_draft_is_refused_not_read_as_tau_one():
    """A policy that drafted nothing leaves τ undefined: 1.0 would read as a head that accepts nothing."""
    a = [turn(f"p{i}", "a", 10, [6]) for i in range(2)]
    b = [turn(f"p{i}", "b", 0, []) for i in range(2)]
    with pytest.raises(ValueError, match=r"b made no draft.*verify=fixed"):
        paired_tau({"a": a, "b": b})


def test_one_prompt_gives_the_ratio_without_an_interval():
    r = paired_tau({"a": [turn("p0", "a", 10, [6])], "b": [turn("p0", "b", 10, [3])]})
    assert r["tau_ratio"] == pytest.approx(1.6 / 1.3)
    assert r["tau_ratio_interval"] is None and r["a"]["tau_interval"] is None


def test_a_run_still_writing_is_read_without_touching_it_and_a_study_gives_its_reported_cells(tmp_path):
    """A torn last line is left out, not cut from the journal; in a prefix_x_spec study the cells of the run's own
    prefix_cache setting are the ones its results report, so the other cells stay out."""
    cells = [turn("p0", "a", 10, [5]), turn("p0", "b", 10, [5]), turn("p0", "a", 10, [9])]
    cells[2].prefix_cache = True
    units = [Unit("p0", 0, cells, []), Unit("p1", 0, [turn("p1", "a", 10, [5]), turn("p1", "b", 10, [5])], [])]
    journal = "".join(unit_line(u) for u in units) + '{"id": "p2", "rep'
    (tmp_path / RECORDS).write_text(journal)
    (tmp_path / RUN).write_text('{"prefix_cache": false, "study": "prefix_x_spec"}')
    got = method_records(tmp_path, ("a", "b"))
    assert [r.id for r in got["a"]] == ["p0", "p1"] and all(not r.prefix_cache for r in got["a"])
    assert (tmp_path / RECORDS).read_text() == journal
    with pytest.raises(ValueError, match="two different methods"):
        method_records(tmp_path, ("a", "a"))
    with pytest.raises(ValueError, match="holds no records.jsonl"):
        method_records(tmp_path / "nothing", ("a", "b"))
