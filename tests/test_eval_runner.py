"""The eval runner on a tiny random chat target: several methods and repeats, the results schema (the spec keys
plus `methods` and `by_category`), multi-turn feeding, the 2x2 prefix-cache study, sampling, Ctrl-C, bad input."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from draftsmith.cpu_kernels import panels
from draftsmith.eval import runner
from draftsmith.eval.aggregate import Record, by_category, compared, pool
from draftsmith.eval.distribution import distribution_check
from draftsmith.eval.journal import unfinished
from draftsmith.eval.methods import drafter_params, resolve_methods
from draftsmith.eval.prompts import Prompt
from draftsmith.eval.report import study, write_report
from draftsmith.eval.results import SCHEMA_VERSION, Effect, Identical, Lossless, dump, load_results, to_json
from draftsmith.eval.runner import EvalConfig, run_eval
from draftsmith.eval.study import finding, study_arms, study_cells
from draftsmith.heads.drafter_folder import Recipe, save_drafter
from draftsmith.heads.kinds import DraftShape
from draftsmith.serve.drafters import auto_draft_dtype, target_info
from draftsmith.serve.engine.generation import Generation
from draftsmith.serve.engine.metrics import Metrics
from draftsmith.serve.models.target import LoadedTarget, TargetConfig, load_target
from draftsmith.serve.spec import SpecConfig
from draftsmith.train.head import HeadConfig, build_head
from helpers import SPEC_KEYS, eval_config

pytestmark = pytest.mark.usefixtures("one_thread")

ROWS = [
    {"id": "a", "category": "writing", "turns": ["Say hello twice.", "Now say it again."]},
    {"id": "b", "category": "code", "prompt": "def add(a, b):\n    return a + b\n\ndef add(a, b):"},
    {"id": "c", "category": "code", "prompt": "x = 1\nx = 1\nx = 1\nx ="},
]


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


@pytest.fixture(scope="module")
def two_methods(tiny_target, prompts_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("ev") / "ev"
    overrides = ["spec=ngram", "methods=[layerskip]", "methods.layerskip.layers=1", "repeats=2", "max_new_tokens=6"]
    overrides.append("methods.layerskip.verify=cost")  # its drafts cut by this machine's verify cost
    return out, run_eval(eval_config(tiny_target, out, f"prompts={prompts_file}", *overrides))


def test_several_methods_and_repeats_keep_the_spec_keys_and_add_methods(two_methods):
    out, r = two_methods
    written = json.loads((out / "results.json").read_text())
    for key in ("target", "device", "dtype", "prompts", "max_new_tokens", "temperature", "baseline", "spec"):
        assert key in written
    assert r.prompts == 3 and r.repeats == 2 and r.partial is False
    assert list(r.methods) == ["ngram", "layerskip"] and r.spec == r.methods["ngram"]
    for label, m in r.methods.items():
        assert all(k in written["methods"][label] for k in SPEC_KEYS) and len(m.speedup_per_repeat) == 2
        assert m.lossless.checked == 8 == m.lossless.identical  # 4 turns x 2 repeats
    assert r.lossless.checked == 16 == r.lossless.identical
    assert r.methods["ngram"].drafter_params == 0 and r.methods["layerskip"].drafter_params is None
    assert r.prefix_cache.hit_tokens > 0  # turn 2 of "a" reuses turn 1
    for m in (r.baseline, *r.methods.values()):  # rows per step: plain decoding verifies the pending token alone
        assert sum(m.verify_rows) == m.target_forward_passes and m.mean_verify_rows >= 1
    assert r.baseline.verify_rows == [r.baseline.target_forward_passes]
    assert r.methods["layerskip"].config["verify"] == "cost"
    assert written == to_json(r)


def test_results_json_round_trips_through_the_types(two_methods):
    """load -> types -> dump gives the file back byte for byte; one schema_version field."""
    out, r = two_methods
    text = (out / "results.json").read_text()
    loaded = load_results(out / "results.json")
    assert loaded == r and dump(loaded) == text
    assert json.loads(text)["schema_version"] == SCHEMA_VERSION and text.count('"schema_version"') == 1


@pytest.mark.parametrize(
    "edit, found",
    [
        (lambda r: r.pop("schema_version"), "none"),  # written before schema versions
        (lambda r: r.update(schema_version=0), "0"),
        (lambda r: r.update(schema_version=99), "99"),
    ],
)
def test_a_results_json_of_another_schema_version_is_refused_with_the_fix(two_methods, tmp_path, edit, found):
    out, _ = two_methods
    r = json.loads((out / "results.json").read_text())
    edit(r)
    path = tmp_path / "results.json"
    path.write_text(json.dumps(r))
    with pytest.raises(ValueError) as e:
        load_results(path)
    assert (
        str(path) in str(e.value) and f"schema version {found}," in str(e.value) and "re-run the eval" in str(e.value)
    )


def test_a_results_json_from_before_drafter_dtypes_and_panels_were_recorded_still_loads(two_methods, tmp_path):
    out, _ = two_methods
    r = json.loads((out / "results.json").read_text())
    for m in r["methods"].values():
        m.pop("drafter_dtype", None)
    r["environment"].pop("panels", None)
    (tmp_path / "results.json").write_text(json.dumps(r))
    old = load_results(tmp_path)
    assert old.environment.panels is None and all(m.drafter_dtype is None for m in old.methods.values())


def test_a_results_json_missing_a_field_names_it(two_methods, tmp_path):
    out, _ = two_methods
    r = json.loads((out / "results.json").read_text())
    del r["methods"]["ngram"]["lossless"]
    (tmp_path / "results.json").write_text(json.dumps(r))
    with pytest.raises(
        ValueError, match=r"results.json is not a draftsmith-eval result .*methods.ngram: missing lossless"
    ):
        load_results(tmp_path)


def test_results_are_grouped_by_category_and_prompt(two_methods):
    out, r = two_methods
    cats = r.by_category
    assert {c: v.prompts for c, v in cats.items()} == {"code": 2, "writing": 1}
    for label, m in r.methods.items():
        assert sum(cats[c].methods[label].new_tokens for c in cats) == m.new_tokens
        assert all(cats[c].methods[label].speedup > 0 for c in cats)
    rows = [json.loads(x) for x in (out / "per_prompt.jsonl").read_text().splitlines()]
    assert [x["id"] for x in rows] == ["a", "b", "c"] and rows[0]["methods"]["ngram"]["checked"] == 4
    outputs = [json.loads(x) for x in (out / "outputs.jsonl").read_text().splitlines()]
    assert len(outputs) == 3 * 4 * 2  # methods x turns x repeats
    assert {(x["id"], x["turn"], x["method"], x["repeat"]) for x in outputs} >= {("a", 1, "layerskip", 1)}


def test_per_position_acceptance_spans_the_draft_length(two_methods):
    _, r = two_methods
    for label, m in r.methods.items():
        if m.drafts:
            assert len(m.acceptance_rate_per_position) == m.config["num_tokens"], label


class Recorder:
    """Stands in for an Engine: answers every prompt with a fixed text and remembers what it was asked."""

    def __init__(self, tokenizer, answers: list[str]):
        self.tokenizer, self.answers, self.prompts = tokenizer, answers, []

    def check_fits(self, prompt_len, max_new_tokens):
        pass

    def generate(self, ids, max_new_tokens, sp):
        self.prompts.append(ids)
        out = self.tokenizer(self.answers[len(self.prompts) - 1], add_special_tokens=False)["input_ids"]
        return Generation(out, Metrics(new_tokens=len(out)), "length")


def save_eagle3(target: LoadedTarget, folder: Path, draft: DraftShape | None = None) -> Path:
    """An untrained eagle3 head for the target, saved as a drafter folder (made for `draft`)."""
    head, head_cfg = build_head("eagle3", target, HeadConfig(kind="eagle3", draft_vocab_size=64))
    return save_drafter(head, head_cfg, "eagle3", target_info(target), Recipe(), folder, draft=draft)


def test_drafter_params_counts_the_heads_parameters_not_its_vocabulary_maps_or_token_counts(tiny_target, tmp_path):
    target = load_target(TargetConfig(path=str(tiny_target)))
    head, head_cfg = build_head("eagle3", target, HeadConfig(kind="eagle3", draft_vocab_size=64))
    counts = torch.ones(target.model.config.vocab_size)
    folder = save_drafter(head, head_cfg, "eagle3", target_info(target), Recipe(), tmp_path / "h", counts)
    assert (folder / "token_counts.safetensors").is_file()
    trained = sum(p.numel() for p in head.parameters() if p.requires_grad)  # not the target's borrowed embeddings
    assert drafter_params(SpecConfig(name="eagle3", drafter=str(folder))) == trained


def test_a_drafter_is_evaluated_in_the_draft_shape_it_was_made_for(tiny_target, prompts_file, tmp_path):
    """spec=eagle3 spec.drafter=HEAD drafts in the depth 1 x 3 the head was made for, not the spec's defaults
    (depth 5, top-4, 12 nodes): the shape is the folder's where the spec leaves it unset."""
    target = load_target(TargetConfig(path=str(tiny_target)))
    folder = save_eagle3(target, tmp_path / "head", DraftShape(num_tokens=1, topk=3, total_tokens=0))
    overrides = ["spec=eagle3", f"spec.drafter={folder}", "limit=1", "warmup=0", "max_new_tokens=4"]
    m = run_eval(eval_config(tiny_target, tmp_path / "ev", f"prompts={prompts_file}", *overrides)).methods["eagle3"]
    assert (m.config["num_tokens"], m.config["tree"]) == (1, {"topk": 3, "total_tokens": 0})
    assert len(m.acceptance_rate_per_position) == 1 and m.lossless.identical == m.lossless.checked
    # spec.draft_dtype=auto as it resolved here: an fp32 target's head in bf16 wherever bf16 runs
    assert m.config["draft_dtype"] == "auto" and m.drafter_dtype == str(auto_draft_dtype(target.model)).split(".")[1]


def test_multi_turn_feeds_the_models_own_answer_back(tiny_target):
    tok = AutoTokenizer.from_pretrained(tiny_target)
    engine = Recorder(tok, ["FIRST-ANSWER", "SECOND-ANSWER"])
    prompt = Prompt("q", ["Question one?", "Question two?"], False, "writing")
    cfg = EvalConfig(out="unused")
    records, skipped = runner.answer(engine, ("ar", True), prompt, tok, cfg, rep=0, i=0)
    assert skipped == []
    assert [r.text for r in records] == ["FIRST-ANSWER", "SECOND-ANSWER"] and [r.turn for r in records] == [0, 1]
    second = tok.decode(engine.prompts[1])
    assert second.index("Question one?") < second.index("FIRST-ANSWER") < second.index("Question two?")
    assert "SECOND-ANSWER" not in second


def record(method: str, category: str, drafts: int, accepted: int, tokens: int, seconds: float) -> Record:
    m = Metrics(drafts=drafts, accepted_tokens=accepted, new_tokens=tokens, total_s=seconds)
    return Record("x", category, 0, 0, method, True, [], "", m)


def test_tau_and_speedup_are_pooled_not_means_of_means():
    recs = [record("s", "a", 1, 4, 10, 1.0), record("s", "b", 3, 0, 30, 1.0)]
    base = [record("ar", "a", 0, 0, 10, 2.0), record("ar", "b", 0, 0, 30, 2.0)]
    s = compared("s", recs, base)
    assert s.mean_acceptance_length == 2.0  # 1 + 4 / 4, not the mean of 5 and 1
    assert s.speedup == 2.0 and pool(recs).tokens_per_s == 20.0
    cats = by_category(recs + base, ["s"])
    assert cats["a"].methods["s"].mean_acceptance_length == 5.0 and cats["b"].prompts == 1


def fx(
    prefill=(5.0, 4.0, 6.0), cold=(2.0, 1.8, 2.2), hit=(2.0, 1.8, 2.2), stack=(1.0, 0.9, 1.1), total=(2.5, 2.2, 2.8)
):
    e = lambda t: Effect(ratio=t[0], interval=list(t[1:]))
    return {
        "prefill": e(prefill),
        "decode_cold": e(cold),
        "decode_hit": e(hit),
        "stacking": e(stack),
        "total": e(total),
    }


def test_study_finding_is_computed_from_the_ratios_and_their_intervals():
    text = finding(fx(), "ngram")
    assert "The prefix cache cut TTFT 5.00x [4.00, 6.00]" in text
    assert "ngram cut TPOT 2.00x [1.80, 2.20] without the cache and 2.00x [1.80, 2.20] with it" in text
    assert "does not differ significantly with and without a cache hit" in text
    assert "together they cut total latency 2.50x [2.20, 2.80]" in text
    assert "did not significantly change TPOT (1.05x [0.90, 1.20])" in finding(fx(cold=(1.05, 0.9, 1.2)), "ngram")
    assert "did not significantly change TTFT" in finding(fx(prefill=(1.02, 0.95, 1.1)), "ngram")
    slower = finding(fx(cold=(0.6, 0.5, 0.7)), "eagle3")
    assert "eagle3 made TPOT longer (without / with it: 0.60x [0.50, 0.70])" in slower
    assert "cut TPOT" not in slower  # a slowdown is not called a win
    assert "decode effect differs" in finding(fx(stack=(1.3, 1.2, 1.5)), "ngram")


def test_study_without_decode_steps_withholds_its_finding():
    """max_new_tokens=1: no token after the first, so TPOT is 0/0; it gave "0.00x" ratios and an unflagged control."""
    rows = [
        Record(p, "rag", 0, 0, name, cache, [1], "", Metrics(new_tokens=1, ttft_s=t, total_s=t))
        for p, t in (("a", 0.01), ("b", 0.02), ("c", 0.03))
        for name, cache in study_arms("ngram")
    ]
    s = study_cells(rows, "ngram", greedy=True)
    assert all(c.tpot_ms is None for c in s.cells)
    assert s.control.ratio is None and "undefined" in s.control.undefined
    assert s.finding.startswith("Finding withheld") and "max_new_tokens" in s.finding and "0.00x" not in s.finding
    assert s.effects["prefill"].ratio == 1.0  # TTFT is still defined
    text = study(s)
    assert "undefined" in text and "0.00x" not in text


def test_prefix_x_spec_study_runs_the_four_cells(tiny_target, tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("# Notes\n\n" + "The cache keeps blocks of sixteen tokens. " * 30 + "\n\n## Usage\n\nAsk.\n")
    out = tmp_path / "ev"
    overrides = ["spec=ngram", "suite=rag", f"suite.document={doc}", "limit=2", "study=prefix_x_spec"]
    r = run_eval(eval_config(tiny_target, out, *overrides, "max_new_tokens=4"))
    s = r.study
    assert [(c.prefix_cache, c.speculation) for c in s.cells] == [
        (False, None),
        (True, None),
        (False, "ngram"),
        (True, "ngram"),
    ]
    hits = [c.prefix_cache_hit_rate for c in s.cells]
    assert hits[0] == hits[2] == 0 and hits[1] > 0.3 and hits[3] > 0.3  # question 2 reuses the document
    assert s.identical == Identical(checked=6, identical=6)
    assert set(s.effects) == {"control", "prefill", "decode_cold", "decode_hit", "stacking", "total"}
    # a loaded machine may withhold the finding (the control); either way the sentence says which
    assert s.finding.startswith("Finding withheld") == s.control.noisy
    assert ("TTFT" in s.finding) != s.control.noisy
    assert r.lossless.checked == 2 and r.prompts == 2  # the main results: the cached cells
    assert load_results(out) == r  # the study round-trips too


def test_distribution_check_with_only_rare_tokens_reports_too_few_samples():
    """Every token seen fewer than MIN_COUNT times falls into the rare bin: it reported tv 0.0, p 1.0 from nothing."""
    sampled = lambda method, rep, ids: Record("x", "c", 0, rep, method, True, ids, "", Metrics(new_tokens=len(ids)))
    base = [sampled("ar", 0, [1, 2]), sampled("ar", 1, [3, 4])]
    mine = [sampled("s", 0, [5, 6]), sampled("s", 1, [7, 8])]
    d = distribution_check(base, mine)
    assert d.p_value is None and d.tv_distance is None and d.note.startswith("too few samples")
    many = distribution_check([sampled("ar", 0, [1] * 5)], [sampled("s", 0, [1] * 4 + [2])])
    assert many.p_value is not None and many.tv_distance > 0


def test_sampling_replaces_equality_with_a_distribution_check(tiny_target, prompts_file, tmp_path):
    # top_k=2: unrestricted, a random tiny target samples near-uniformly from its whole vocabulary, so no token
    # would be common enough to compare (the check then says too few samples)
    overrides = [f"prompts={prompts_file}", "temperature=1", "top_k=2", "repeats=2", "max_new_tokens=8", "limit=2"]
    r = run_eval(eval_config(tiny_target, tmp_path / "ev", *overrides))
    d = r.methods["ngram"].distribution_check
    assert r.lossless.checked == 0 and d.units == 4 and 0 <= d.p_value <= 1
    assert "permutation" in d.test and d.tv_distance is not None
    assert (r.temperature, r.top_k, r.top_p) == (1.0, 2, 1.0) and load_results(tmp_path / "ev") == r


def test_ctrl_c_leaves_a_partial_result_of_finished_prompts(tiny_target, prompts_file, tmp_path, monkeypatch):
    real = runner.answer

    def interrupted(engine, arm, prompt, *args):
        if prompt.id == "b" and arm[0] == "ngram":
            raise KeyboardInterrupt
        return real(engine, arm, prompt, *args)

    monkeypatch.setattr(runner, "answer", interrupted)
    out = tmp_path / "ev"
    r = run_eval(eval_config(tiny_target, out, f"prompts={prompts_file}", "max_new_tokens=4"))
    assert r.partial is True and r.prompts == 1 and r.lossless.checked == 2
    assert json.loads((out / "results.json").read_text())["partial"] is True


def test_methods_group_composes_several_labelled_methods(tiny_target, tmp_path):
    cfg = eval_config(tiny_target, tmp_path, "spec=ar", "methods=[ngram,eagle3]", "methods.eagle3.drafter=HEAD")
    methods = resolve_methods(cfg.spec, cfg.methods)
    assert list(methods) == ["ngram", "eagle3"] and methods["eagle3"].drafter == "HEAD"
    same = eval_config(tiny_target, tmp_path, "spec=ngram", "methods=[ngram,layerskip]")
    assert list(resolve_methods(same.spec, same.methods)) == ["ngram", "layerskip"]  # one ngram, same settings


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["spec=ar"], "eval compares methods against plain decoding"),
        (["spec=ngram", "spec.num_tokens=2", "methods=[ngram]"], "spec=ngram and methods.ngram differ"),
        (["study=nope"], "unknown study 'nope'; available: prefix_x_spec"),
        (["repeats=0"], "repeats must be >= 1"),
        (["temperature=-1"], "temperature must be >= 0"),
    ],
)
def test_bad_settings_are_refused_before_anything_is_written(tiny_target, prompts_file, tmp_path, overrides, message):
    out = tmp_path / "ev"
    with pytest.raises(ValueError, match=re.escape(message)):
        run_eval(eval_config(tiny_target, out, f"prompts={prompts_file}", *overrides))
    assert not out.exists()


def test_an_empty_prompts_file_writes_nothing(tiny_target, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    out = tmp_path / "ev"
    with pytest.raises(ValueError, match="is empty"):
        run_eval(eval_config(tiny_target, out, f"prompts={empty}", "methods=[layerskip]"))
    assert not out.exists()


def test_a_crashed_eval_keeps_every_finished_prompt_and_resumes(tiny_target, prompts_file, tmp_path, monkeypatch):
    real, asked = runner.answer, []

    def crash_on_c(engine, arm, prompt, *args):
        if prompt.id == "c":
            raise RuntimeError("boom")
        return real(engine, arm, prompt, *args)

    out = tmp_path / "ev"
    overrides = [f"prompts={prompts_file}", "max_new_tokens=4", "methods=[layerskip]", "methods.layerskip.layers=1"]
    monkeypatch.setattr(runner, "answer", crash_on_c)
    with pytest.raises(RuntimeError, match="boom"):
        run_eval(eval_config(tiny_target, out, *overrides))
    lines = (out / "records.jsonl").read_text().splitlines()
    assert [json.loads(x)["id"] for x in lines] == ["a", "b"] and not (out / "results.json").exists()

    with pytest.raises(ValueError, match="unfinished eval .* resume=true"):
        run_eval(eval_config(tiny_target, out, *overrides))
    with pytest.raises(ValueError, match=r"other settings \(max_new_tokens\)"):
        run_eval(eval_config(tiny_target, out, *overrides[:1], "max_new_tokens=5", *overrides[2:], "resume=true"))

    with open(out / "records.jsonl", "a") as f:
        f.write('{"id": "c", "repeat": 0, "reco')  # a kill mid-write
    monkeypatch.setattr(
        runner, "answer", lambda engine, arm, prompt, *a: asked.append(prompt.id) or real(engine, arm, prompt, *a)
    )
    r = run_eval(eval_config(tiny_target, out, *overrides, "resume=true"))
    # a and b are answered again, unrecorded (so the engines' state is an uninterrupted run's); their records
    # come from disk
    assert set(asked) == {"a", "b", "c"}
    assert r.prompts == 3 and r.partial is False
    assert r.methods["ngram"].lossless == Lossless(checked=4, identical=4, note=r.lossless.note)
    assert (out / "records.jsonl").read_text().splitlines()[:2] == lines
    assert len((out / "records.jsonl").read_text().splitlines()) == 3


def test_resume_refuses_edited_prompts_and_a_drafter_retrained_in_place(tiny_target, tmp_path, monkeypatch):
    """run.json held only the paths: a resume mixed records of the old prompts or drafter with new ones."""
    target = load_target(TargetConfig(path=str(tiny_target)))

    def train_head(seed: int) -> Path:
        torch.manual_seed(seed)
        return save_eagle3(target, tmp_path / "head")

    folder, prompts = train_head(0), tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    real = runner.answer

    def crash_on_c(engine, arm, prompt, *args):
        if prompt.id == "c":
            raise RuntimeError("boom")
        return real(engine, arm, prompt, *args)

    monkeypatch.setattr(runner, "answer", crash_on_c)
    out = tmp_path / "ev"
    overrides = [f"prompts={prompts}", "spec=eagle3", f"spec.drafter={folder}", "warmup=0", "max_new_tokens=2"]
    with pytest.raises(RuntimeError, match="boom"):
        run_eval(eval_config(tiny_target, out, *overrides))

    prompts.write_text("".join(json.dumps(r) + "\n" for r in [{**ROWS[0], "turns": ["Say bye."]}, *ROWS[1:]]))
    with pytest.raises(ValueError, match=r"other settings \(prompts_sha256\)"):
        run_eval(eval_config(tiny_target, out, *overrides, "resume=true"))
    prompts.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    if panels.available():  # fp32 panels: other bytes, and the head in fp32 under auto
        monkeypatch.setenv(panels.ENV, "fp32")
        with pytest.raises(ValueError, match=r"other settings \((drafter_dtypes, )?panels\)"):
            run_eval(eval_config(tiny_target, out, *overrides, "resume=true"))
        monkeypatch.delenv(panels.ENV)
    train_head(1)
    with pytest.raises(ValueError, match=r"other settings \(drafters\)"):
        run_eval(eval_config(tiny_target, out, *overrides, "resume=true"))
    saved = json.loads((out / "run.json").read_text())
    (out / "run.json").write_text(json.dumps({k: v for k, v in saved.items() if k != "panels"}))
    with pytest.raises(
        ValueError, match=r"other settings \(drafters\); it was run by an older draftsmith, which did not record panels"
    ):
        run_eval(eval_config(tiny_target, out, *overrides, "resume=true"))


def test_a_killed_rerun_into_a_finished_folder_leaves_no_stale_result(tiny_target, prompts_file, tmp_path, monkeypatch):
    """A fresh run removes the earlier run's results before its first prompt: a kill leaves an unfinished run (which
    compare cannot mistake for the old result and a plain rerun refuses to wipe), not the old results.json."""
    out = tmp_path / "ev"
    overrides = [f"prompts={prompts_file}", "max_new_tokens=2", "limit=2"]
    write_report(out, run_eval(eval_config(tiny_target, out, *overrides)))
    assert {p.name for p in out.iterdir()} >= {"results.json", "report.md", "outputs.jsonl", "per_prompt.jsonl"}
    real = runner.answer

    def killed_on_b(engine, arm, prompt, *args):
        if prompt.id == "b":
            raise KeyboardInterrupt  # run_all keeps "a" and reports partial; a SIGKILL would not even get that far
        return real(engine, arm, prompt, *args)

    monkeypatch.setattr(runner, "answer", killed_on_b)
    monkeypatch.setattr(runner, "write_outputs", lambda *a: None)  # killed before it writes anything else
    run_eval(eval_config(tiny_target, out, *overrides))
    assert {p.name for p in out.iterdir()} == {"records.jsonl", "run.json"}
    assert unfinished(out)
    with pytest.raises(ValueError, match="unfinished eval .* resume=true"):
        run_eval(eval_config(tiny_target, out, *overrides))


def test_a_later_turn_beyond_the_context_is_skipped_and_counted(tiny_target, tmp_path):
    path = tmp_path / "long.jsonl"
    rows = [{"id": "long", "turns": ["Say hi.", "Repeat this: " + "words and more words " * 120, "Bye."]}, ROWS[1]]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "ev"
    r = run_eval(eval_config(tiny_target, out, f"prompts={path}", "max_new_tokens=4", "max_seq_len=200"))
    skipped = r.skipped
    assert skipped.turns == 4  # plain decoding and ngram each skipped turn 2 of "long", and turn 3 after it
    got = {(s.id, s.turn, s.method): s.reason for s in skipped.list}
    assert set(got) == {("long", t, m) for t in (1, 2) for m in ("ar", "ngram")}
    assert "exceeds the context" in got[("long", 1, "ar")] and "follows turn 2" in got[("long", 2, "ngram")]
    assert r.lossless.checked == 2  # the turns that ran: long's first, and the raw prompt
