"""Intervals (bootstrap over prompts, paired where it should be), the 2x2 study's noise control, the repeat-spread
control, and what results.json says about the machine."""

from __future__ import annotations

import pytest

from draftsmith.eval.aggregate import Record, compared, repeat_spread
from draftsmith.eval.machine import SPEED_FLAGS, cpu_flags, describe, environment
from draftsmith.eval.results import RepeatSpread
from draftsmith.eval.stats import Bootstrap, intervals, significant
from draftsmith.eval.study import study_cells
from draftsmith.serve.engine.metrics import Metrics


def rec(
    pid: str, method: str, seconds: float, tokens: int = 10, cache: bool = True, repeat: int = 0, ttft=None, **counts
) -> Record:
    m = Metrics(new_tokens=tokens, total_s=seconds, ttft_s=0.1 * seconds if ttft is None else ttft, **counts)
    return Record(pid, "c", 0, repeat, method, cache, [], "", m)


def test_paired_speedup_interval_is_tight_when_prompts_differ_but_the_ratio_does_not():
    """Prompts take 1 s to 20 s, but every one runs exactly 2x faster with the method: pairing cancels the prompt
    effect, so the interval is [2, 2], while tokens/s alone varies widely."""
    base = [rec(f"p{i}", "ar", 1.0 + 2 * i, tokens=10 + i) for i in range(10)]
    fast = [rec(f"p{i}", "m", (1.0 + 2 * i) / 2, tokens=10 + i) for i in range(10)]
    out = compared("m", fast, base, seed=1)
    assert out.speedup == pytest.approx(2.0)
    low, high = out.intervals["speedup"]
    assert low == pytest.approx(2.0) and high == pytest.approx(2.0) and out.significant is True
    tps = out.intervals["tokens_per_s"]
    assert tps[1] / tps[0] > 1.5  # the unpaired number does carry the prompt-to-prompt spread


def test_a_noisy_speedup_around_one_is_not_significant():
    times = [1.0, 1.3, 0.8, 1.1, 0.9, 1.2, 0.7, 1.0]
    base = [rec(f"p{i}", "ar", 1.0) for i in range(8)]
    mine = [rec(f"p{i}", "m", t) for i, t in enumerate(times)]
    out = compared("m", mine, base, seed=0)
    low, high = out.intervals["speedup"]
    assert low < 1.0 < high and out.significant is False
    assert low <= out.speedup <= high


def test_intervals_need_two_prompts_and_bracket_the_pooled_tau():
    one = [rec("p0", "m", 1.0, drafts=4, accepted_tokens=4, draft_tokens=8)]
    assert intervals(Bootstrap.over(["p0"], 0), one) == {}
    assert significant(None) is None
    many = [rec(f"p{i}", "m", 1.0, drafts=4, accepted_tokens=i, draft_tokens=8) for i in range(6)]
    iv = intervals(Bootstrap.over([r.id for r in many], 0), many, positions=2)
    tau = 1 + sum(range(6)) / 24
    assert iv["mean_acceptance_length"][0] < tau < iv["mean_acceptance_length"][1]
    assert len(iv["acceptance_rate_per_position"]) == 2


def study_records(plain_cached_tpot: float, n: int = 6, jitter: float = 0.02) -> list[Record]:
    """Plain decoding at 50 ms/token uncached, `plain_cached_tpot` cached; speculation 1.25x faster in both."""
    out = []
    for i in range(n):
        wobble = 1 + jitter * ((i % 3) - 1)
        for method, cache, tpot, ttft in (
            ("ar", False, 0.050, 1.0),
            ("ar", True, plain_cached_tpot, 0.2),
            ("m", False, 0.040, 1.0),
            ("m", True, plain_cached_tpot / 1.25, 0.2),
        ):
            out.append(rec(f"p{i}", method, ttft + 32 * tpot * wobble, tokens=33, cache=cache, ttft=ttft))
    return out


def test_the_study_states_its_finding_when_the_control_holds():
    s = study_cells(study_records(0.050), "m", greedy=True)
    assert s.control.noisy is False and s.control.ratio == pytest.approx(1.0)
    assert s.finding.startswith("The prefix cache cut TTFT") and "m cut TPOT 1.25x" in s.finding
    assert "does not differ significantly" in s.finding
    assert all(c.intervals["tpot_ms"] for c in s.cells)


def test_the_study_withholds_its_finding_when_plain_decoding_tpot_moves_with_the_cache():
    """Plain TPOT 65 ms without the cache and 152 ms with it cannot be the cache's doing."""
    s = study_cells(study_records(0.050 * 152 / 65), "m", greedy=True)
    assert s.control.noisy is True and s.control.interval[0] > 1.5
    assert s.finding.startswith("Finding withheld: the machine was too noisy")
    assert "cut TPOT" not in s.finding


def test_repeat_spread_measures_how_much_the_same_prompt_varied():
    same = [rec("a", "ar", 1.0, repeat=r) for r in range(3)] + [rec("b", "ar", 2.0, repeat=r) for r in range(3)]
    for r, t in zip(same, [1.0, 1.0, 1.0, 2.0, 2.0, 2.0], strict=True):
        r.metrics.total_s = t
    assert repeat_spread(same) == RepeatSpread(prompts=2, median=0.0, max=0.0)
    same[1].metrics.total_s = 1.5  # prompt a: 1.0, 1.5, 1.0 -> (1.5 - 1.0) / 1.0
    assert repeat_spread(same).max == pytest.approx(0.5)
    assert repeat_spread([rec("a", "ar", 1.0)]) is None  # one repeat: nothing to compare


def test_environment_names_the_cpu_its_speed_flags_and_threads():
    import torch

    env = environment(torch.device("cpu"), torch.float32)
    assert set(env.cpu_flags) <= set(SPEED_FLAGS) and env.cpu_flags == cpu_flags()
    assert env.threads == torch.get_num_threads() and env.gpu is None and env.cpu
    assert f"{env.threads} threads" in describe(env)
