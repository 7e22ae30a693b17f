"""Building engines from configs: drafters that do not fit the target are refused with both names."""

import json
import shutil

import pytest

from draftsmith.serve.build import build_engine
from draftsmith.serve.models.target import TargetConfig, eos_ids, load_target
from draftsmith.serve.spec import SpecConfig
from helpers import build_tiny, build_tiny_chat_target


@pytest.fixture(scope="module")
def tiny(smollm2_dir, tmp_path_factory):
    return build_tiny_chat_target(tmp_path_factory.mktemp("tiny-chat"), smollm2_dir)


def test_drafter_with_another_vocab_size_is_refused(tiny, tmp_path):
    target = load_target(TargetConfig(path=str(tiny)))
    other = build_tiny(tmp_path / "d", "llama", vocab_size=1000)
    with pytest.raises(ValueError, match=r"vocab_size 1000 but target .*49152"):
        build_engine(target, SpecConfig("draft_model", drafter=str(other)), False, 256)


def test_drafter_with_another_tokenizer_is_refused(tiny, smollm2_dir, tmp_path):
    target = load_target(TargetConfig(path=str(tiny)))
    other = build_tiny_chat_target(tmp_path / "d", smollm2_dir, seed=1)
    vocab = (other / "tokenizer.json").read_text().replace('"<|im_start|>"', '"<|im_begin|>"')
    (other / "tokenizer.json").write_text(vocab)
    with pytest.raises(ValueError, match="different tokenizer"):
        build_engine(target, SpecConfig("draft_model", drafter=str(other)), False, 256)


def test_drafter_without_tokenizer_or_folder_is_refused(tiny, tmp_path):
    target = load_target(TargetConfig(path=str(tiny)))
    bare = tmp_path / "bare"
    shutil.copytree(tiny, bare)
    for f in bare.glob("tokenizer*"):
        f.unlink()
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        build_engine(target, SpecConfig("draft_model", drafter=str(bare)), False, 256)
    with pytest.raises(FileNotFoundError, match="not a folder"):
        build_engine(target, SpecConfig("draft_model", drafter=str(tmp_path / "nope")), False, 256)


def test_matching_drafter_builds_and_eos_comes_from_config_and_tokenizer(tiny, smollm2_dir, tmp_path):
    target = load_target(TargetConfig(path=str(tiny)))
    draft = build_tiny_chat_target(tmp_path / "d", smollm2_dir, seed=2, num_hidden_layers=1)
    engine = build_engine(target, SpecConfig("draft_model", 3, drafter=str(draft)), True, 256)
    assert engine.proposer.model.config.num_hidden_layers == 1
    assert eos_ids(target) == (target.tokenizer.eos_token_id,)


@pytest.mark.parametrize("spec", ["draft_model", "eagle3", "medusa"])
@pytest.mark.parametrize(
    "config,message",
    [
        (None, "holds a JSON NoneType, not an object"),
        ([1, 2], "holds a JSON list, not an object"),
        ({"kind": ["eagle3"]}, r"unknown drafter kind \['eagle3'\]"),
        ({"kind": None}, r"no draftsmith drafter folder \(its config.json names no draftsmith kind\)"),
        ({"architectures": "MedusaModel"}, r"\(MedusaModel names no draftsmith kind\)"),
    ],
)
def test_a_config_json_that_is_no_drafter_config_is_refused_by_name(tiny, tmp_path, spec, config, message):
    target = load_target(TargetConfig(path=str(tiny)))
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        build_engine(target, SpecConfig(spec, drafter=str(odd)), False, 256)


def test_a_draft_longer_than_the_context_is_refused_as_such(tiny):
    target = load_target(TargetConfig(path=str(tiny)))
    room = target.model.config.max_position_embeddings
    with pytest.raises(ValueError, match=rf"a draft of up to {room} tokens \(ngram\) leaves no room"):
        build_engine(target, SpecConfig("ngram", num_tokens=room), False, 256)
