"""Reports from real (tiny) eval results: report.md and its PNGs, draftsmith-compare over several folders and
over a hydra sweep, W&B logging (offline), and the bad inputs of compare."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace

import pytest
from hydra import compose, initialize_config_module

from draftsmith.cpu_kernels import native
from draftsmith.eval.__main__ import print_headline
from draftsmith.eval.compare import compare, main, parse_args
from draftsmith.eval.report import write_report
from draftsmith.eval.results import load_results
from draftsmith.eval.runner import EvalConfig, run_eval
from draftsmith.eval.wandb_log import log_eval
from draftsmith.serve.shared.cli import typed
from draftsmith.serve.shared.wandb_run import WandbConfig

pytestmark = pytest.mark.usefixtures("one_thread")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "offline"}
PNG = b"\x89PNG"


@pytest.fixture(scope="module")
def evaluated(tiny_target, tmp_path_factory):
    """One eval with two methods (one under the draft policy) and the 2x2 study on a short shared document."""
    root = tmp_path_factory.mktemp("report")
    doc = root / "doc.md"
    doc.write_text("# Notes\n\n" + "Blocks of sixteen tokens are cached. " * 20 + "\n\n## Usage\n\nAsk.\n")
    out = root / "ev"
    overrides = [
        f"target.path={tiny_target}",
        f"out={out}",
        "wandb.enabled=false",
        "spec=ngram",
        "spec.policy.report_estimates=true",  # verified whole, its estimates reported beside
        "methods=[layerskip]",
        "methods.layerskip.layers=1",
        "methods.layerskip.verify=policy",
        "methods.layerskip.policy.probe_every=1",  # a step it leaves plain probes: estimates to report
        "suite=rag",
        f"suite.document={doc}",
        "limit=2",
        "study=prefix_x_spec",
        "max_new_tokens=4",
    ]
    with initialize_config_module("draftsmith.conf", version_base=None):
        cfg = typed(compose("eval", overrides), EvalConfig)
    return out, run_eval(cfg)


def test_report_has_the_tables_a_person_reads_and_the_plots(evaluated):
    out, results = evaluated
    path = write_report(out, results)
    text = path.read_text()
    for heading in (
        "## Overall",
        "## Speedup by category",
        "## τ by category",
        "## Per-position acceptance",
        "## Verify rows per step",
        "## Steps: plain, probe, whole or cut",
        "## Acceptance estimates against what was accepted",
    ):
        assert heading in text
    steps = results.methods["layerskip"].steps
    assert sum(steps.values()) == results.methods["layerskip"].target_forward_passes
    assert "| layerskip | draft_model @ depth 1 |" in text  # the policy's estimates against what was accepted
    assert "| ngram | ngram @ depth 1 |" in text and results.methods["ngram"].steps["whole"] > 0  # reported, whole
    assert "| ngram |" in text and "| layerskip |" in text and "| method | rag | all |" in text
    assert "Greedy: 4/4 turns identical to plain decoding (lossless)." in text
    assert "**Finding:** The prefix cache" in text or "**Finding:** Finding withheld" in text  # a loaded machine
    assert "| control: plain TPOT, cache on / off (should be 1.00x) |" in text
    assert "Brackets: 95% intervals" in text and "## Noise" in text and "No turn was skipped." in text
    for key in ("device", "dtype", "torch", "commit"):
        assert f"| {key} |" in text
    for png in ("acceptance.png", "speedup_by_category.png", "study.png", "calibration.png"):
        assert (out / png).read_bytes()[:4] == PNG and f"({png})" in text
    assert write_report(out).read_text() == text  # from results.json alone


def sweep_copy(src, dst, params: int, speedup: float, cpu: str | None = None, **settings):
    """A second eval folder, as a sweep over draft size would make: same layout, other numbers (and settings)."""
    shutil.copytree(src, dst)
    r = json.loads((dst / "results.json").read_text()) | settings
    m = r["methods"]["layerskip"]
    # its significance follows the interval set here, not the timed eval's it copies (which load can make either)
    m |= {"drafter_params": params, "speedup": speedup, "significant": not speedup - 0.05 <= 1 <= speedup + 0.05}
    m["intervals"]["speedup"] = [speedup - 0.05, speedup + 0.05]
    if cpu:
        r["environment"]["cpu"] = cpu
    (dst / "results.json").write_text(json.dumps(r))
    return dst


def test_compare_merges_folders_into_one_report(evaluated, tmp_path):
    out, results = evaluated
    first = sweep_copy(out, tmp_path / "small", 1_000_000, 1.2)
    second = sweep_copy(out, tmp_path / "large", 4_000_000, 1.1)
    path, warnings = compare([str(first), str(second)], tmp_path / "cmp")
    text = path.read_text()
    assert warnings == [] and "**Warning:**" not in text
    assert "| small:layerskip | rag | 1.00M | num_tokens 3 | 1.20x [1.15, 1.25] |" in text
    assert "| large:layerskip | rag | 4.00M | num_tokens 3 | 1.10x [1.05, 1.15] |" in text
    assert "| small:layerskip | large:layerskip | 1.20x vs 1.10x | significant |" in text
    assert "All runs on one machine" in text
    assert "| small:ngram | rag | 0 | num_tokens 5 |" in text and "## Speedup by category" in text
    assert (tmp_path / "cmp" / "speedup_vs_params.png").read_bytes()[:4] == PNG
    rows = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert len(rows) == 4 and {r["label"] for r in rows} >= {"small:ngram", "large:layerskip"}


def test_compare_tells_overlapping_runs_apart_and_warns_about_other_machines(evaluated, tmp_path):
    out, _ = evaluated
    first = sweep_copy(out, tmp_path / "a", 1_000_000, 1.20)
    second = sweep_copy(out, tmp_path / "b", 1_000_000, 1.18, cpu="Some Other CPU")
    text = compare([str(first), str(second)], tmp_path / "cmp")[0].read_text()
    assert "| a:layerskip | b:layerskip | 1.20x vs 1.18x | not significant |" in text
    assert "**Warning: these runs come from different machines**" in text and "Some Other CPU" in text


def test_compare_warns_when_runs_differ_in_dtype_or_prompts(evaluated, tmp_path):
    out, _ = evaluated
    first = sweep_copy(out, tmp_path / "a", 1_000_000, 1.20)
    second = sweep_copy(out, tmp_path / "b", 1_000_000, 1.18, dtype="float16", prompts_sha256="edited")
    path, warnings = compare([str(first), str(second)], tmp_path / "cmp")
    assert len(warnings) == 1 and f"**Warning:** {warnings[0]}" in path.read_text()
    assert "differ in settings that change speed or outputs" in warnings[0]
    assert "dtype: " in warnings[0] and "float16" in warnings[0] and "prompts_sha256: " in warnings[0]
    assert "max_new_tokens" not in warnings[0]


def test_compare_warns_when_runs_differ_in_any_setting_that_changes_speed_or_outputs(evaluated, tmp_path):
    """Two sampled runs differing only in prefix_cache, top_k or top_p were compared without a word (top_k and top_p
    were not even in results.json): every setting that changes speed or outputs is recorded and compared."""
    out, _ = evaluated
    results = json.loads((out / "results.json").read_text())
    assert (results["top_p"], results["top_k"]) == (1.0, 0)
    first = sweep_copy(out, tmp_path / "a", 1_000_000, 1.20)
    second = sweep_copy(out, tmp_path / "b", 1_000_000, 1.18, top_k=20, top_p=0.9)
    r = json.loads((second / "results.json").read_text())
    r["prefix_cache"]["enabled"] = False
    r["config"] |= {"seed": 7, "cuda_graphs": "off", "max_seq_len": 512, "warmup": 0}
    (second / "results.json").write_text(json.dumps(r))
    warnings = compare([str(first), str(second)], tmp_path / "cmp")[1]
    assert len(warnings) == 1
    for named in ("prefix_cache: False, True", "top_k: 0, 20", "top_p: 0.9, 1.0", "seed: 0, 7"):
        assert named in warnings[0], (named, warnings[0])
    for named in ("cuda_graphs: auto, off", "max_seq_len: 4096, 512", "warmup: 0, 1"):
        assert named in warnings[0], (named, warnings[0])
    assert "max_new_tokens" not in warnings[0] and "temperature" not in warnings[0]


def test_the_forward_and_kernels_that_ran_are_recorded_and_compared(evaluated, tmp_path):
    """cuda_graphs=auto and target.dtype=auto resolve by the CPU and DRAFTSMITH_KERNELS: two runs both saying "auto"
    can have run different forwards (compiled on oneDNN, or eager on draftsmith's kernels). What ran is recorded, and
    a difference is warned about; a file written before these fields loads without them."""
    out, results = evaluated
    engine_kernels = native.version() if results.dtype == "float32" else None
    assert results.environment.forward == "dynamic" and results.environment.kernels == engine_kernels
    first = sweep_copy(out, tmp_path / "a", 1_000_000, 1.20)
    second = sweep_copy(out, tmp_path / "b", 1_000_000, 1.18)
    r = json.loads((second / "results.json").read_text())
    r["environment"] |= {"forward": "compiled", "kernels": None}
    (second / "results.json").write_text(json.dumps(r))
    warnings = compare([str(first), str(second)], tmp_path / "cmp")[1]
    assert len(warnings) == 1 and "forward: compiled, dynamic" in warnings[0]
    assert ("own kernels: False, True" in warnings[0]) == (engine_kernels is not None)
    for key in ("forward", "kernels"):
        del r["environment"][key]
    (second / "results.json").write_text(json.dumps(r))
    assert load_results(second).environment.forward is None


def test_compare_reads_a_sweep_folder_as_its_runs(evaluated, tmp_path):
    out, _ = evaluated
    for i in range(2):
        shutil.copytree(out, tmp_path / "sweep" / str(i))
    compare([str(tmp_path / "sweep")], tmp_path / "cmp")
    labels = [r["label"] for r in json.loads((tmp_path / "cmp" / "compare.json").read_text())]
    assert labels == ["0:ngram", "0:layerskip", "1:ngram", "1:layerskip"]


def test_compare_names_an_unfinished_run_of_a_sweep(evaluated, tmp_path, capsys):
    """sw/1 crashed (records.jsonl, no results.json): it was dropped without a word."""
    out, _ = evaluated
    sweep = tmp_path / "sw"
    for i in range(3):
        shutil.copytree(out, sweep / str(i))
    (sweep / "1" / "results.json").unlink()
    main([str(sweep), f"out={tmp_path / 'cmp'}"])
    note = f"unfinished: {sweep / '1'} (resume=true finishes it)"
    assert f"warning: {note}" in capsys.readouterr().out
    assert f"**Warning:** {note}" in (tmp_path / "cmp" / "report.md").read_text()
    labels = [r["label"] for r in json.loads((tmp_path / "cmp" / "compare.json").read_text())]
    assert labels == ["0:ngram", "0:layerskip", "2:ngram", "2:layerskip"]
    with pytest.raises(ValueError, match=f"no finished eval to compare; unfinished: {sweep / '1'}"):
        compare([str(sweep / "1")], tmp_path / "cmp2")


def test_compare_refuses_to_write_into_an_eval_folder(evaluated, tmp_path, capsys):
    out, _ = evaluated
    sweep = tmp_path / "sweep"
    for i in range(2):
        shutil.copytree(out, sweep / str(i))
    before = {p: p.read_bytes() for p in sweep.rglob("*") if p.is_file()}
    for target in (sweep / "0", sweep):
        with pytest.raises(SystemExit) as exit_:
            main([str(sweep), f"out={target}"])
        assert exit_.value.code == 2 and "is an eval folder" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in sweep.rglob("*") if p.is_file()} == before


def test_compare_refuses_bad_input_and_writes_nothing(evaluated, tmp_path, capsys):
    out, _ = evaluated
    report = tmp_path / "cmp"
    with pytest.raises(FileNotFoundError, match="missing is not an eval folder: no results.json"):
        compare([str(out), str(tmp_path / "missing")], report)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "results.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not a draftsmith-eval result"):
        compare([str(out), str(bad)], report)
    old = json.loads((out / "results.json").read_text())
    del old["schema_version"]  # a results.json from before schema versions
    (bad / "results.json").write_text(json.dumps(old))
    with pytest.raises(ValueError, match=f"{bad / 'results.json'} has results schema version none.*re-run the eval"):
        compare([str(out), str(bad)], report)
    with pytest.raises(ValueError, match="give one out=REPORT"):
        parse_args([str(out)])
    with pytest.raises(ValueError, match="unknown argument 'title=x'"):
        parse_args([str(out), "out=r", "title=x"])
    with pytest.raises(SystemExit) as exit_:
        main([str(tmp_path / "missing"), f"out={report}"])
    assert exit_.value.code == 2 and "not an eval folder" in capsys.readouterr().err
    assert not report.exists()


def test_wandb_logs_summary_tables_and_plots_offline(evaluated, tmp_path):
    out, results = evaluated
    folder = shutil.copytree(out, tmp_path / "ev")
    write_report(folder, results)
    assert log_eval(WandbConfig(enabled=False), folder, results, {}) is None and not (folder / "wandb").exists()
    run_id = log_eval(WandbConfig(project="draftsmith-test", group="sweep-a"), folder, results, {"suite": "rag"})
    runs = list((folder / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))


def test_cli_sweep_then_compare(tiny_target, tmp_path):
    """draftsmith-eval -m writes one folder per job (each with report.md and a W&B run in one group);
    draftsmith-compare reads the sweep folder."""
    (tmp_path / "p.jsonl").write_text(json.dumps({"id": "a", "prompt": "a b a b a b a"}) + "\n")
    sweep = tmp_path / "sweep"
    args = [f"target.path={tiny_target}", f"prompts={tmp_path / 'p.jsonl'}", "max_new_tokens=4", f"out={sweep}"]
    r = subprocess.run(
        [sys.executable, "-m", "draftsmith.eval", "-m", "spec.num_tokens=2,3", *args],
        capture_output=True,
        text=True,
        env=ENV,
        cwd=tmp_path,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "speedup" in r.stdout and "report:" in r.stdout
    for job in ("0", "1"):
        assert (sweep / job / "report.md").is_file() and list((sweep / job / "wandb").glob("offline-run-*"))
    r = subprocess.run(
        [sys.executable, "-m", "draftsmith.eval.compare", str(sweep), f"out={tmp_path / 'cmp'}"],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "| 0:ngram |" in (tmp_path / "cmp" / "report.md").read_text()


def test_a_method_drafting_deeper_than_its_intervals_still_reports_and_plots(evaluated, tmp_path):
    """A head paired with a lookup (eagle3_ngram at depth 1) reports acceptance at the lookup's deeper positions,
    which its per-position intervals (taken over the head's depth) do not cover: each shows without an interval."""
    _, results = evaluated
    results = copy.deepcopy(results)
    m = results.methods["ngram"]
    m.acceptance_rate_per_position = [0.5, 0.25, 0.125]
    m.intervals["acceptance_rate_per_position"] = [[0.4, 0.6]]
    text = write_report(tmp_path, results).read_text()
    row = next(line for line in text.splitlines() if line.startswith("| ngram | 0.50 [0.40, 0.60] |"))
    assert row.count("|") == 5 and "0.25" in row and "0.12" in row
    assert (tmp_path / "acceptance.png").read_bytes()[:4] == PNG


def test_a_busy_machine_is_named_in_the_report_and_the_headline(evaluated, tmp_path, capsys):
    """Interleaving cancels a steady competitor in the control, but not its effect on the ratios themselves (beside
    a CPU hog the rag study's eagle3 ran 0.69x where it ran 0.94x idle): a load above 1.5x the CPUs is said."""
    out, results = evaluated
    env = replace(results.environment, cpu_count=2)
    busy = replace(results, environment=replace(env, load_before=[1.5, 1.0, 1.0], load_after=[4.1, 3.0, 2.0]))
    idle = replace(results, environment=replace(env, load_before=[0.9, 1.0, 1.0], load_after=[2.1, 1.5, 1.0]))
    (tmp_path / "idle").mkdir(), (tmp_path / "busy").mkdir()
    assert "BUSY" not in write_report(tmp_path / "idle", idle).read_text()
    print_headline(idle)
    assert "BUSY" not in capsys.readouterr().out
    text = write_report(tmp_path / "busy", busy).read_text()
    assert "BUSY: load average 4.10 on 2 CPUs" in text
    print_headline(busy)
    assert "BUSY: load average 4.10 on 2 CPUs" in capsys.readouterr().out
    unknown = replace(results, environment=replace(env, load_before=None, load_after=None))  # getloadavg failed
    print_headline(unknown)
    assert "BUSY" not in capsys.readouterr().out
