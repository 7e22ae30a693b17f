"""Eval suites load their real packaged files (nothing downloaded) and yield well-formed prompts."""

from __future__ import annotations

import os
from collections import Counter

import pytest
from hydra import compose, initialize_config_module
from hydra.errors import MissingConfigException

from draftsmith.eval.prompts import Prompt
from draftsmith.eval.suites import SuiteConfig, load_suite, rag, round_robin
from draftsmith.serve.shared.conversations import load_conversations, split_key


def well_formed(prompts: list[Prompt]) -> bool:
    ids = [p.id for p in prompts]
    return len(set(ids)) == len(ids) and all(p.turns and all(t.strip() for t in p.turns) for p in prompts)


def test_mt_bench_has_80_two_turn_questions_in_8_categories():
    prompts = load_suite(SuiteConfig("mt_bench"))
    assert len(prompts) == 80 and well_formed(prompts)
    assert all(len(p.turns) == 2 and not p.raw for p in prompts)
    assert Counter(p.category for p in prompts) == {
        c: 10 for c in ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
    }


def test_mt_bench_first_turns_only():
    both, first = load_suite(SuiteConfig("mt_bench")), load_suite(SuiteConfig("mt_bench", max_turns=1))
    assert [p.turns for p in first] == [p.turns[:1] for p in both]
    with pytest.raises(ValueError, match="suite.max_turns must be >= 1"):
        load_suite(SuiteConfig("mt_bench", max_turns=0))


def test_a_suite_limit_covers_every_category_in_file_order():
    prompts = load_suite(SuiteConfig("mt_bench"), limit=8)
    assert len({p.category for p in prompts}) == 8
    assert [int(p.id) for p in prompts] == sorted(int(p.id) for p in prompts)
    assert len(load_suite(SuiteConfig("mt_bench"), limit=3)) == 3


def test_spread_takes_round_robin_over_categories():
    ps = [Prompt(str(i), ["q"], False, c) for i, c in enumerate("aaab")]
    assert [p.id for p in round_robin(ps, 2)] == ["0", "3"]
    assert round_robin(ps, None) == ps and round_robin(ps, 10) == ps


def test_humaneval_has_164_code_prompts_raw_or_as_chat():
    raw = load_suite(SuiteConfig("humaneval", chat=False))
    assert len(raw) == 164 and well_formed(raw)
    assert all(p.raw and p.turns[0].lstrip().startswith(("def ", "from ", "import ")) for p in raw[:5])
    chat = load_suite(SuiteConfig("humaneval", chat=True))
    assert not chat[0].raw and raw[0].turns[0] in chat[0].turns[0]


def test_pydocs_asks_about_standard_library_documentation():
    prompts = load_suite(SuiteConfig("pydocs"))
    assert len(prompts) > 200 and well_formed(prompts) and len({p.id for p in prompts}) == len(prompts)
    dedent = next(p for p in prompts if p.id == "textwrap.dedent")
    assert dedent.category == "textwrap" and "Remove any common leading whitespace" in dedent.turns[0]
    assert all(not p.raw and p.id.startswith(p.category + ".") for p in prompts)


def test_sharegpt_suite_uses_only_the_held_out_split():
    prompts = load_suite(SuiteConfig("sharegpt"))
    assert len(prompts) > 100 and well_formed(prompts)
    assert all(1 <= len(p.turns) <= 2 and all(len(t) <= 2000 for t in p.turns) for p in prompts)
    train, _ = load_conversations("sharegpt", 0.02, "train")
    trained = {split_key(c.id, "sharegpt") for c in train}
    assert not {split_key(p.id, "sharegpt") for p in prompts} & trained


def test_rag_questions_share_one_long_document():
    prompts = load_suite(SuiteConfig("rag"))
    assert len(prompts) >= 20 and well_formed(prompts)
    prefix = os.path.commonprefix([p.turns[0] for p in prompts])
    assert len(prefix) > 4000 and "MT-bench" in prefix  # the llm_judge README shipped with MT-bench


def test_rag_takes_any_document(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("# Title\n\nSome text.\n\n## Usage\n\nRun it.\n")
    prompts = rag(str(doc))
    assert all("Some text." in p.turns[0] for p in prompts)
    assert any('"Usage"' in p.turns[0] for p in prompts)
    with pytest.raises(FileNotFoundError, match="not a non-empty text file"):
        rag(str(tmp_path / "missing.md"))


def test_unknown_suite_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown suite 'nope'; available: mt_bench, humaneval, sharegpt, rag"):
        load_suite(SuiteConfig("nope"))
    with initialize_config_module("draftsmith.conf", version_base=None):
        with pytest.raises(MissingConfigException, match="(?s)suite/nope.*mt_bench"):
            compose("eval", ["out=x", "suite=nope"])
