"""serve/engine/cost_profile.py: the verify cost curve is measured once through the engine's forward, cached with its
fingerprint and reused; a stale or corrupt file is measured again and rewritten, saying why. spec.verify=cost builds
the schedule from it; a kind without accept probabilities then drafts as with verify=fixed. Behaviour only: no test
asserts on a measured time."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from draftsmith.cpu_kernels import panels
from draftsmith.serve.build import build_engine
from draftsmith.serve.engine import cost_profile
from draftsmith.serve.engine.cost_profile import CostCurve, ProfileSettings, fingerprint, load_or_measure, profile_path
from draftsmith.serve.engine.engine import Engine
from draftsmith.serve.engine.sampling import SamplingParams
from draftsmith.serve.models.loader import load_model
from draftsmith.serve.models.target import TargetConfig, load_target
from draftsmith.serve.proposers.propose_ngram import NgramConfig, NgramProposer
from draftsmith.serve.spec import SpecConfig
from helpers import build_tiny_chat_target, exactly

pytestmark = pytest.mark.usefixtures("one_thread")

# whatever else loads the test machine
QUICK = ProfileSettings(repeats=1, warmup=0, context=16, busy=float("inf"), waited=float("inf"))
TARGET = "tiny@00000000"


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    model = load_model(tiny_llama_dir("llama"), torch.float32, "cpu")
    return Engine(model, NgramProposer(NgramConfig(4)), max_seq_len=64)


@pytest.fixture(autouse=True)
def new_process(monkeypatch):
    """Each test starts as a new process would: no curve measured on a busy CPU kept in memory."""
    monkeypatch.setattr(cost_profile, "BUSY_CURVES", {})


@pytest.fixture
def measured(monkeypatch):
    """Counts the curve's measurements (the real ones still run)."""
    calls = []
    real = cost_profile.measure

    def counting(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(cost_profile, "measure", counting)
    return calls


def path_of(engine, tmp_path):
    return profile_path(str(tmp_path), fingerprint(engine, TARGET, 5, QUICK.context))


def test_measured_once_then_read_back(engine, measured, tmp_path):
    curve = load_or_measure(engine, TARGET, str(tmp_path), QUICK)
    assert len(curve.seconds) == 5  # the pending token + the 4-token n-gram draft
    assert all(s > 0 for s in curve.seconds) and curve.seconds == sorted(curve.seconds)
    saved = json.loads(path_of(engine, tmp_path).read_text())
    assert saved["fingerprint"] == fingerprint(engine, TARGET, 5, QUICK.context)
    assert {"target", "dtype", "device", "torch", "kernels", "threads", "cpu", "schema"} <= saved["fingerprint"].keys()
    assert load_or_measure(engine, TARGET, str(tmp_path), QUICK) == curve
    assert len(measured) == 1


def stale(data):
    data["fingerprint"]["torch"] = "0.0.1"


def nan(data):
    data["seconds"][2] = float("nan")


def decreasing(data):
    data["seconds"][-1] = data["seconds"][0] / 2


@pytest.mark.parametrize(
    "edit,why",
    [
        (stale, "is stale"),
        (lambda d: d["fingerprint"].update(cpu="another CPU"), "is stale"),
        (lambda d: d["fingerprint"].update(kernels="draftsmith-0123456789abcdef"), "is stale"),  # an older library
        (lambda d: d.pop("seconds"), "lacks"),
        (nan, "no valid curve"),
        (lambda d: d["seconds"].__setitem__(0, -1.0), "no valid curve"),
        (lambda d: d["seconds"].__setitem__(0, 0), "no valid curve"),
        (lambda d: d["seconds"].pop(), "no valid curve"),
        (lambda d: d["seconds"].__setitem__(1, "fast"), "no valid curve"),
        (decreasing, "no valid curve"),
        (None, "is not JSON"),
    ],
)
def test_a_stale_or_corrupt_profile_is_measured_again(engine, measured, tmp_path, caplog, edit, why):
    load_or_measure(engine, TARGET, str(tmp_path), QUICK)
    path = path_of(engine, tmp_path)
    if edit is None:
        path.write_text('{"fingerprint": ')
    else:
        data = json.loads(path.read_text())
        edit(data)
        path.write_text(json.dumps(data))
    with caplog.at_level(logging.INFO, logger="draftsmith.serve.cost_profile"):
        curve = load_or_measure(engine, TARGET, str(tmp_path), QUICK)
    assert len(measured) == 2
    assert [r.getMessage() for r in caplog.records if why in r.getMessage()]
    assert len(caplog.records) == 1
    assert json.loads(path.read_text()) == {
        "fingerprint": fingerprint(engine, TARGET, 5, QUICK.context),
        "seconds": curve.seconds,
    }
    load_or_measure(engine, TARGET, str(tmp_path), QUICK)
    assert len(measured) == 2  # the rewritten file is trusted


def test_rows_past_the_curve_extend_its_last_step():
    curve = CostCurve([1.0, 1.5, 2.5])
    assert (curve(1), curve(3), curve(5)) == (1.0, 2.5, 4.5)
    assert CostCurve([2.0])(3) == 6.0


@pytest.fixture(scope="module")
def chat_target(smollm2_dir, tmp_path_factory):
    return load_target(TargetConfig(path=str(build_tiny_chat_target(tmp_path_factory.mktemp("chat"), smollm2_dir))))


def test_verify_cost_on_a_kind_without_accept_probs_drafts_as_fixed(chat_target, tmp_path):
    """spec.verify=cost builds a schedule from this machine's curve (cached under the cache root); n-gram drafts
    carry no accept probabilities, so every step verifies what verify=fixed verifies."""
    fixed = build_engine(chat_target, SpecConfig("ngram", 3), False, 96)
    cost = build_engine(chat_target, SpecConfig("ngram", 3, verify="cost"), False, 96, cache_dir=str(tmp_path))
    assert fixed.draft_cut is None and cost.draft_cut is not None
    assert len(list((tmp_path / "verify_cost").glob("*.json"))) == 1
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    a, b = (e.generate(prompt, 24, SamplingParams()) for e in (fixed, cost))
    assert a.output_ids == b.output_ids
    assert a.metrics.verify_rows == b.metrics.verify_rows and a.metrics.drafts == b.metrics.drafts


def test_spec_verify_takes_fixed_cost_or_policy():
    with pytest.raises(ValueError, match="spec.verify must be one of fixed, cost, policy, got 'always'"):
        SpecConfig("ngram", verify="always")
    with pytest.raises(ValueError, match="spec=ar drafts nothing"):
        SpecConfig("ar", verify="cost")


def test_a_curve_measured_on_a_busy_machine_is_used_once_then_measured_again(engine, measured, tmp_path, caplog):
    busy = ProfileSettings(repeats=1, warmup=0, context=16, busy=-1.0, waited=float("inf"))  # any load counts as busy
    with caplog.at_level(logging.WARNING, logger="draftsmith.serve.cost_profile"):
        curve = load_or_measure(engine, TARGET, str(tmp_path), busy)
    assert len(curve.seconds) == 5 and "this process uses it, the next one measures it again" in caplog.text
    assert "load average" in json.loads(path_of(engine, tmp_path).read_text())["busy"]
    assert load_or_measure(engine, TARGET, str(tmp_path), QUICK) is curve and len(measured) == 1  # kept in memory
    cost_profile.BUSY_CURVES.clear()  # the next process
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="draftsmith.serve.cost_profile"):
        load_or_measure(engine, TARGET, str(tmp_path), QUICK)
    assert len(measured) == 2 and "was measured on a busy machine" in caplog.text
    assert "busy" not in json.loads(path_of(engine, tmp_path).read_text())  # an idle measure replaces it


def test_a_measurement_whose_threads_waited_for_a_cpu_is_measured_again_by_the_next_process(engine, measured, tmp_path):
    """The load average lags a minute behind a neighbour that just started or ended; a thread of the measurement that
    waited for a CPU (Linux's schedstat) says the CPU was shared while it ran."""
    if cost_profile.run_queue_waits() is None:
        pytest.skip("no /proc/self/task/*/schedstat here")
    waits = ProfileSettings(repeats=1, warmup=0, context=16, busy=float("inf"), waited=-1.0)  # any wait, even none
    load_or_measure(engine, TARGET, str(tmp_path), waits)
    assert "waited for a CPU" in json.loads(path_of(engine, tmp_path).read_text())["busy"]
    cost_profile.BUSY_CURVES.clear()  # the next process
    load_or_measure(engine, TARGET, str(tmp_path), QUICK)
    load_or_measure(engine, TARGET, str(tmp_path), QUICK)
    assert len(measured) == 2  # measured again once, then read back
    assert cost_profile.shared_cpu(None, 0.41, 0.1) == "a thread of it waited for a CPU 41% of the time"
    assert cost_profile.shared_cpu(None, 0.01, 0.1) == cost_profile.shared_cpu(None, None, 0.1) == ""


def test_threads_past_the_usable_cpus_leave_the_wait_unjudged(engine, measured, tmp_path, monkeypatch):
    """More torch threads than CPUs wait for each other: that says nothing of other processes."""
    monkeypatch.setattr(cost_profile, "usable_cpus", lambda: 0)
    waits = ProfileSettings(repeats=1, warmup=0, context=16, busy=float("inf"), waited=-1.0)
    load_or_measure(engine, TARGET, str(tmp_path), waits)
    assert "busy" not in json.loads(path_of(engine, tmp_path).read_text())


def test_an_unwritable_cache_measures_and_uses_the_curve_from_memory(engine, measured, tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with caplog.at_level(logging.WARNING):
        curve = load_or_measure(engine, TARGET, str(blocker / "cache"), QUICK)
    assert len(curve.seconds) == 5 and len(measured) == 1 and "not saved" in caplog.text


def test_profiles_of_different_contexts_live_side_by_side(engine, measured, tmp_path):
    short = ProfileSettings(repeats=1, warmup=0, context=8, busy=float("inf"), waited=float("inf"))
    for settings in (QUICK, short, QUICK, short):
        load_or_measure(engine, TARGET, str(tmp_path), settings)
    assert len(measured) == 2


def test_own_kernels_on_and_off_keep_a_file_each(engine, monkeypatch, tmp_path):
    """DRAFTSMITH_KERNELS=0 and the default cost rows differently: neither overwrites the other's curve."""
    monkeypatch.setattr(cost_profile.native, "version", lambda: "draftsmith-0123456789abcdef")
    on = fingerprint(engine, TARGET, 5, QUICK.context)
    monkeypatch.setattr(cost_profile.native, "version", lambda: None)
    off = fingerprint(engine, TARGET, 5, QUICK.context)
    assert on["kernels"] == "draftsmith-0123456789abcdef" and off["kernels"] is None
    assert profile_path(str(tmp_path), on) != profile_path(str(tmp_path), off)


@pytest.mark.skipif(not panels.available(), reason="the panel kernel runs fp32 on AVX2 and AVX-512 CPUs")
def test_fp32_and_narrower_panels_keep_a_file_each(tiny_llama_dir, monkeypatch, tmp_path):
    """A target whose weights a narrower panel format holds (cpu_kernels/panel_codes.py) costs rows differently from the
    same weights in fp32 panels (DRAFTSMITH_PANELS=fp32): the curve names the formats it was measured on."""
    prints = {}
    for setting in ("exact", "fp32"):
        monkeypatch.setenv(panels.ENV, setting)
        model = load_model(tiny_llama_dir("llama"), torch.float32, "cpu")
        with torch.no_grad():
            for w in (p for p in model.parameters() if p.dim() == 2):
                w.copy_(exactly("q8", w))
        prints[setting] = fingerprint(Engine(model, NgramProposer(NgramConfig(4)), max_seq_len=64), TARGET, 5, 8)
    assert prints["exact"]["panels"] == {"q8": 13} and prints["fp32"]["panels"] == {"fp32": 13}
    assert profile_path(str(tmp_path), prints["exact"]) != profile_path(str(tmp_path), prints["fp32"])
