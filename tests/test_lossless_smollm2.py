"""Greedy speculative output equals plain greedy output, token for token, on the real SmolLM2 (fp32)."""

import pytest
import torch

from draftsmith.eval.suites import mt_bench
from draftsmith.serve.build import Loaded, SpecConfig, build_engine, encode_chat, load
from draftsmith.serve.sampling import SamplingParams
from draftsmith.serve.target import TargetConfig
from helpers import truncated_copy

NEW_TOKENS = 64
PROMPTS = 20


@pytest.fixture(scope="module")
def target(smollm2_dir) -> Loaded:
    return load(TargetConfig(dtype="float32", device="cpu"))


@pytest.fixture(scope="module")
def prompts(target) -> list[list[int]]:
    return [encode_chat(target.tokenizer, [{"role": "user", "content": p.turns[0]}]) for p in mt_bench(PROMPTS)]


@pytest.fixture(scope="module")
def plain(target, prompts) -> list[list[int]]:
    engine = build_engine(target, SpecConfig("ar"), prefix_cache=False, max_seq_len=1024)
    return [engine.generate(ids, NEW_TOKENS, SamplingParams()).output_ids for ids in prompts]


@pytest.fixture(scope="module")
def draft_dir(smollm2_dir, tmp_path_factory):
    return truncated_copy(smollm2_dir, tmp_path_factory.mktemp("draft-smollm2-2l"), 2)


@pytest.mark.parametrize("spec", ["ngram", "suffix", "layerskip", "draft"])
def test_greedy_speculation_is_lossless_on_mt_bench(spec, target, prompts, plain, draft_dir):
    cfg = {
        "ngram": SpecConfig("ngram", 5),
        "suffix": SpecConfig("suffix", 24),
        "layerskip": SpecConfig("layerskip", 2, layers=4),
        "draft": SpecConfig("draft", 3, drafter=str(draft_dir)),
    }[spec]
    engine = build_engine(target, cfg, prefix_cache=True, max_seq_len=1024)
    accepted = 0
    for ids, expected in zip(prompts, plain, strict=True):
        g = engine.generate(ids, NEW_TOKENS, SamplingParams())
        assert g.output_ids == expected
        accepted += g.metrics.accepted_tokens
    assert accepted > 0, f"{spec} never had a draft token accepted: the check would be vacuous"
    assert engine.prefix_cache.hit_tokens > 0  # the shared system prompt is served from the cache


def test_plain_outputs_are_real_text(target, plain):
    text = target.tokenizer.decode(plain[0], skip_special_tokens=True)
    assert len(plain) == PROMPTS and len(text.split()) > 10
    assert all(0 < len(o) <= NEW_TOKENS for o in plain)
    assert torch.get_num_threads() >= 1
