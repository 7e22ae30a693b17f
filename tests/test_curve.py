"""draftsmith-curve on a tiny chat target: two data sizes trained and evaluated alike, the report's numbers from
the runs' own records, a finished point read back instead of run again, a stopped one resumed, and a rerun with
other settings refused."""

import json
import shutil
from pathlib import Path

import pytest

from draftsmith.eval.curve import CurveConfig, run_curve
from helpers import build_tiny_chat_target, sum_chats


@pytest.fixture(scope="module")
def made(smollm2_dir, tmp_path_factory) -> tuple[CurveConfig, Path]:
    root = tmp_path_factory.mktemp("curve")
    target = build_tiny_chat_target(root / "target", smollm2_dir, head_dim=32)
    train_args = [f"data.source={sum_chats(root)}", "data.regenerated=false", "data.max_length=48"]
    train_args += ["train.max_steps=2", "train.batch_size=2", "train.eval_every=0"]
    cfg = CurveConfig(
        out=str(root / "out"),
        target_args=[f"target.path={target}", "target.dtype=float32"],
        sizes=[8, 4],
        train_args=train_args,
        suites=["mt_bench", "humaneval"],
        limit=2,
        max_new_tokens=4,
    )
    run_curve(cfg)
    return cfg, Path(cfg.out)


def test_each_size_is_trained_and_evaluated_and_reported(made):
    cfg, out = made
    curve = json.loads((out / "curve.json").read_text())
    small, large = curve["points"]
    assert [small["conversations"], large["conversations"]] == [4, 8]  # run and reported smallest first
    assert 0 < small["answer_tokens"] < large["answer_tokens"]
    for p in (small, large):
        assert p["stages"]["steps"]["steps"] == 2 and p["stages"]["steps"]["seconds"] > 0 and p["cpu_hours"] > 0
        assert p["stages"]["features"]["seconds"] > 0  # each size builds its own feature cache
        assert p["examples"] == p["conversations"]  # the 48 chats hold both sizes
        for suite in ("mt_bench", "humaneval"):
            evaluated = json.loads(
                (out / "points" / f"c{p['conversations']}" / f"eval-{suite}" / "results.json").read_text()
            )
            assert p["suites"][suite]["tau"] == evaluated["spec"]["mean_acceptance_length"]
            assert p["suites"][suite]["identical"] == ("4/4" if suite == "mt_bench" else "2/2")  # 2 turns each
    fits = {f["suite"]: f for f in curve["fits"]}
    assert set(fits) == {"mt_bench", "humaneval"} and set(fits["mt_bench"]["predictions"]) == {"10x", "100x"}
    report = (out / "curve.md").read_text()
    assert "### mt_bench" in report and "τ per doubling" in report and (out / "curve.png").stat().st_size > 0


def test_a_finished_point_is_read_back_and_a_stopped_one_resumes(made):
    cfg, out = made
    small = out / "points" / "c4"
    before = (out / "points" / "c8" / "train.log").read_text()
    shutil.rmtree(small / "head" / "final")  # stopped after its last checkpoint, before the final folder
    shutil.rmtree(small / "eval-humaneval")
    run_curve(cfg)
    assert (out / "points" / "c8" / "train.log").read_text() == before  # nothing of the finished point ran again
    assert "resume=true" in (small / "train.log").read_text()  # its checkpoints were picked up
    resumed = json.loads((out / "curve.json").read_text())["points"][0]
    assert resumed["stages"]["steps"]["seconds"] > 0  # the steps' time came back with the checkpoint
    assert resumed["stages"]["features"]["seconds"] > 0  # and what its first piece measured
    assert (small / "head" / "final" / "config.json").is_file() and (
        small / "eval-humaneval" / "results.json"
    ).is_file()


def test_a_rerun_asking_for_fewer_sizes_in_another_order_keeps_every_finished_point(made):
    cfg, out = made
    reordered = [*cfg.train_args[1:], cfg.train_args[0]]
    run_curve(CurveConfig(**{**cfg.__dict__, "sizes": [4], "train_args": reordered}))
    assert [p["conversations"] for p in json.loads((out / "curve.json").read_text())["points"]] == [4, 8]


def test_a_rerun_with_other_settings_is_refused_naming_both(made):
    cfg, out = made
    other = CurveConfig(**{**cfg.__dict__, "train_args": [*cfg.train_args, "train.lr=1e-4"]})
    with pytest.raises(ValueError, match="train_args.*train.lr=1e-4"):
        run_curve(other)


def test_points_whose_heads_trained_with_other_settings_are_refused_naming_them(made):
    """A recipe default that changed between two runs of a curve (here the loss's positions) would bend its line:
    each head folder records the settings that shaped it, and the curve refuses to join unlike ones."""
    cfg, out = made
    config = out / "points" / "c8" / "head" / "final" / "config.json"
    before = config.read_text()
    recorded = json.loads(before)
    assert recorded["recipe"]["extra"]["training"]["loss_on"] == "all"  # train=quick with head=eagle3
    recorded["recipe"]["extra"]["training"]["loss_on"] = "answers"
    config.write_text(json.dumps(recorded))
    try:
        with pytest.raises(ValueError, match=r"points 4 and 8 .*loss_on.*'all'.*'answers'.*delete points/c8"):
            run_curve(cfg)
    finally:
        config.write_text(before)


def test_bad_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="sizes"):
        CurveConfig(out="x", sizes=[4, 4])
    with pytest.raises(ValueError, match="suites"):
        CurveConfig(out="x", suites=["gsm8k"])
    with pytest.raises(ValueError, match="curve sets per point"):
        CurveConfig(out="x", train_args=["data.max_conversations=9"])
    with pytest.raises(ValueError, match="train.lr twice"):
        CurveConfig(out="x", train_args=["train.lr=1e-3", "train.lr=1e-4"])


def test_cpu_hours_charge_every_point_the_pooled_pace_of_each_stage():
    """Regeneration per row and features per answer token at the pace of the points that measured them (a point
    that found its answers or features cached still pays), plus the point's own steps; a stage no point measured
    is charged nothing and named."""
    from draftsmith.eval.curve_report import Point, charge

    measured = {"regenerate": {"rows": 100, "seconds": 200.0}, "features": {"tokens": 9, "seconds": 50.0}}
    a = Point(100, 100, 10_000, 0, {**measured, "steps": {"steps": 5, "seconds": 30.0}}, {})
    b = Point(300, 280, 30_000, 0, {"steps": {"steps": 9, "seconds": 90.0}}, {})  # answers and features cached
    assert charge([a, b], cores=2) == []
    assert a.cpu_hours == pytest.approx((200 + 50 + 30) * 2 / 3600)
    assert b.cpu_hours == pytest.approx((2.0 * 280 + 0.005 * 30_000 + 90) * 2 / 3600)
    assert charge([b], cores=2) == ["regeneration", "features"] and b.cpu_hours == pytest.approx(90 * 2 / 3600)
