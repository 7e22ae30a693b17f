"""Regeneration through a real vLLM (the venv scripts/setup.sh makes) on a tiny chat target: the rows say vLLM
wrote them, the answers are the target's (fp32 greedy, against draftsmith's own decoder), turn by turn; the
fidelity check counts agreement. Without vLLM the module is skipped, except where DRAFTSMITH_REQUIRE_VLLM=1
(scripts/test.sh sets it: the README's setup installs vLLM, so CI must not skip)."""

import json
import os
import subprocess
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from draftsmith.serve.models.target import TargetConfig, load_target
from draftsmith.serve.shared.cli import typed
from draftsmith.serve.shared.conversations import Conversation, Skipped
from draftsmith.train import regenerate_backends, regenerate_vllm
from draftsmith.train.data import RegenerateConfig
from draftsmith.train.regenerate import RegenerateRun, regenerate, run
from draftsmith.train.regenerate_vllm import VllmUnavailable, find_vllm_python
from helpers import build_tiny_chat_target, command_line, said, user

try:
    VLLM = find_vllm_python(None, None)
except VllmUnavailable as e:
    if os.environ.get("DRAFTSMITH_REQUIRE_VLLM") == "1":
        raise
    pytest.skip(f"vLLM is not installed: {e}", allow_module_level=True)

NEW = 12
EAGER = {"enforce_eager": True}  # no torch.compile warm-up: the tiny target starts in seconds


CONVS = [
    Conversation("a", [user("What is 2 plus 2?"), said("4."), user("And 3 plus 3?"), said("6.")]),
    Conversation("b", [user("Name a colour."), said("Red.")]),
    Conversation("c", [{"role": "system", "content": "Be brief."}, user("Hi"), user("Say something"), said("Hi.")]),
]


@pytest.fixture(scope="module")
def target_dir(smollm2_dir, tmp_path_factory) -> Path:
    # head_dim 32: vLLM's CPU attention has no kernel for the tiny default of 16
    return build_tiny_chat_target(tmp_path_factory.mktemp("tiny-chat"), smollm2_dir, head_dim=32)


def cfg(backend: str) -> RegenerateConfig:
    return RegenerateConfig(max_new_tokens=NEW, backend=backend, dtype="float32", engine_args=EAGER, batch_size=2)


def test_vllm_answers_turn_by_turn_as_the_target_does(target_dir, tmp_path):
    target = load_target(TargetConfig(path=str(target_dir), dtype="float32"))
    lines = []
    theirs = regenerate(CONVS, target, cfg("vllm"), tmp_path / "v.jsonl", 256, Skipped(), say=lines.append)
    ours = regenerate(CONVS, target, cfg("draftsmith"), tmp_path / "d.jsonl", 256, Skipped())
    assert [c.generator["engine"] for c in theirs] == ["vllm"] * 3 and theirs[0].generator["dtype"] == "float32"
    assert any("by vllm 0.32" in line for line in lines)
    a = theirs[0].messages  # the second user turn follows vLLM's own first answer, not the source's "4."
    assert [m["role"] for m in a] == ["user", "assistant", "user", "assistant"] and a[1] != said("4.")
    assert [m["role"] for m in theirs[2].messages] == ["system", "user", "user", "assistant"]  # one run, one answer
    assert [c.messages for c in theirs] == [c.messages for c in ours]


def test_the_command_checks_fidelity_and_says_so(target_dir, tmp_path, capsys):
    overrides, out = command_line(target_dir, tmp_path, CONVS, "vllm")
    overrides += ["+data.regenerate.engine_args.enforce_eager=true", "data.regenerate.fidelity=3"]
    overrides += ["data.regenerate.fidelity_tokens=8", "data.regenerate.dtype=float32"]
    with initialize_config_module("draftsmith.conf", version_base=None):
        run(typed(compose("regenerate", overrides=overrides), RegenerateRun))
    printed = capsys.readouterr().out
    assert "regenerated 3 conversations" in printed and "by vllm 0.32" in printed and "float32, greedy" in printed
    assert not out.with_suffix(".fidelity.vllm.log").exists()  # the fp32 vLLM that regenerated was asked again
    result = json.loads(out.with_suffix(".fidelity.json").read_text())  # beside the answers
    assert result["prompts"] == 3 and result["identical"] + len(result["first_differences"]) == 3
    assert f"equals draftsmith's plain decoding on {result['identical']}/3" in printed


def test_a_target_vllm_cannot_run_falls_back_under_auto_saying_why(smollm2_dir, tmp_path, monkeypatch):
    """vLLM loads a head size of 16 but its CPU attention cannot run it: the worker's one-token warm-up fails at
    start, so auto answers with draftsmith's own decoder, saying why (backend=vllm raising that cause instead is
    test_regenerate's, on a vLLM that fails to import)."""
    monkeypatch.setattr(regenerate_backends, "native_bf16", lambda device: True)  # where auto asks vLLM first
    folder = build_tiny_chat_target(tmp_path / "t16", smollm2_dir, head_dim=16)
    target, lines = load_target(TargetConfig(path=str(folder), dtype="float32")), []
    convs = regenerate(CONVS[1:2], target, cfg("auto"), tmp_path / "a.jsonl", 256, Skipped(), say=lines.append)
    assert convs[0].generator["engine"] == "draftsmith"
    assert any("falls back to draftsmith's own" in line and "head_dim=16" in line for line in lines), lines
    summary = next(line for line in lines if line.startswith("regenerated "))
    assert "by draftsmith" in summary and "to start it" not in summary  # vLLM's failed start is not the own decoder's


LONG = [
    Conversation(f"long{i}", [user(f"Story {i}: " + "the quick brown fox jumps over the lazy dog " * 16)])
    for i in range(4)
]


def test_sampled_answers_survive_a_chunked_prefill(target_dir, tmp_path):
    """Four ~150-token prompts against a 256-token step budget: vLLM splits a prefill across steps, where it rewinds
    a seeded request's generator (a CPU generator cannot: it used to crash). Sampled answers are written, and
    differ from greedy."""
    target = load_target(TargetConfig(path=str(target_dir), dtype="float32"))
    args = EAGER | {"max_num_batched_tokens": 256}
    sampled = RegenerateConfig(max_new_tokens=NEW, backend="vllm", dtype="float32", engine_args=args, temperature=0.9)
    first = regenerate(LONG, target, sampled, tmp_path / "s.jsonl", 256, Skipped())
    greedy = regenerate(LONG, target, cfg("vllm"), tmp_path / "g.jsonl", 256, Skipped())
    assert [c.generator["temperature"] for c in first] == [0.9] * 4
    assert [c.messages for c in first] != [c.messages for c in greedy]


NUCLEUS_CHECK = """
import sys, runpy, torch
from vllm.v1.sample.ops import topk_topp_sampler as sampler
whole_sort = sampler.apply_top_k_top_p
runpy.run_path(sys.argv[1])["nucleus_among_candidates"]()
gen = torch.Generator().manual_seed(0)
peaked = torch.randn(24, 49152, generator=gen) * 8  # nuclei of a few tokens, far from p's edge: among the candidates
flat = torch.randn(8, 49152, generator=gen) * 0.01  # nuclei of ~40k tokens: past the candidates, vLLM's sort
logits, p = torch.cat([peaked, flat])[torch.randperm(32, generator=gen)], torch.full((32,), 0.8)
ours, theirs = sampler.apply_top_k_top_p(logits.clone(), None, p), whole_sort(logits.clone(), None, p)
sizes = ours.isfinite().sum(1)
assert torch.equal(ours.isfinite(), theirs.isfinite()), "another nucleus"
assert torch.equal(ours[ours.isfinite()], logits[ours.isfinite()])
assert sizes.min() >= 1 and sizes.max() > 1024, sizes
print(sorted(sizes.tolist()))
"""


def test_the_workers_top_p_keeps_vllms_nucleus(tmp_path):
    """The worker's top-p (a row's top tokens, not its whole vocabulary sorted) keeps the tokens vLLM's keeps: rows
    whose nucleus lies among the candidates, and rows whose nucleus reaches past them (those go to vLLM's sort)."""
    script = tmp_path / "nucleus.py"
    script.write_text(NUCLEUS_CHECK)
    command = [VLLM, str(script), str(regenerate_vllm.WORKER)]
    done = subprocess.run(command, capture_output=True, text=True, env=regenerate_vllm.worker_env())
    assert done.returncode == 0, done.stderr[-2000:]
    sizes = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(sizes) == 32 and sizes[0] < 10 and sizes[-1] > 1024


def test_top_p_answers_are_written_through_the_workers_nucleus(target_dir, tmp_path):
    target = load_target(TargetConfig(path=str(target_dir), dtype="float32"))
    nucleus = RegenerateConfig(
        max_new_tokens=NEW, backend="vllm", dtype="float32", engine_args=EAGER, temperature=0.7, top_p=0.8
    )
    rows = regenerate(CONVS, target, nucleus, tmp_path / "p.jsonl", 256, Skipped())
    assert [(c.generator["temperature"], c.generator["top_p"]) for c in rows] == [(0.7, 0.8)] * 3
    assert all(m["content"] for c in rows for m in c.messages if m["role"] == "assistant")
