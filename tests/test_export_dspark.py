"""DSpark export for a tiny random Llama target: vLLM's native `dspark` layout (DFlash's backbone keys plus
markov_head.* and confidence_head.proj.*, config.json with sample_from_anchor and the heads' settings), the
model card's vLLM commands, the refusal of the Markov heads vLLM does not run, and the validator catching a
renamed or missing head tensor, a wrong sample_from_anchor, a shifted d2t and tampered heads. The run in vLLM
itself is peers/vllm_crosscheck.py (its own environment)."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from draftsmith.serve.export.base import ExportError, format_for, read_source
from draftsmith.serve.export.checks import TOLERANCE, forward_pairs, mismatch, read_export
from draftsmith.serve.export.pipeline import export
from helpers import (
    DFLASH_KEYS,
    DFLASH_VOCAB_KEYS,
    DRAFT_V,
    H,
    V,
    edit_weights,
    export_drafters,
    flip_ten,
    rename,
    scale,
    set_config,
    validation_failure,
)

pytestmark = pytest.mark.usefixtures("one_thread")

R = 8  # markov_rank
HEAD_KEYS = {"markov_head.markov_w1.weight": (V, R), "markov_head.markov_w2.weight": (DRAFT_V, R)}
HEAD_KEYS |= {"confidence_head.proj.weight": (1, H + R), "confidence_head.proj.bias": (1,)}
DFLASH_CONFIG = {"mask_token_id": 2, "target_layer_ids": [-1, 0, 1], "block_size": 4}
DRAFTERS = {  # name -> (kind, the config's own fields)
    "draft-vocab": ("dspark", {}),
    "full-vocab": ("dspark", {"draft_vocab_size": V, "confidence_with_markov": False}),
    "gated": ("dspark", {"markov_type": "gated"}),
    "rnn": ("dspark", {"markov_type": "rnn"}),
}


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir, tmp_path_factory):
    """The target's TargetConfig and dspark drafters with trained-looking weights (the Markov W2 not zero)."""
    tcfg, drafters, _ = export_drafters(tiny_llama_dir("llama"), tmp_path_factory.mktemp("export-dspark"), DRAFTERS)
    return tcfg, drafters


def test_export_keys_shapes_config_and_card(tiny, tmp_path):
    tcfg, drafters = tiny
    out = export(drafters["draft-vocab"], "vllm", tmp_path / "out", tcfg, "fp32")
    tensors = load_file(str(out / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in tensors.items()} == DFLASH_KEYS | DFLASH_VOCAB_KEYS | HEAD_KEYS
    config = json.loads((out / "config.json").read_text())
    want = {
        "architectures": ["Qwen3DSparkModel"],
        "model_type": "qwen3",
        "num_hidden_layers": 2,
        "draft_vocab_size": DRAFT_V,
        "block_size": 4,
        "dflash_config": DFLASH_CONFIG,
        "sample_from_anchor": True,  # the anchor's slot drafts the first token, as trained
        "markov_rank": R,
        "markov_head_type": "vanilla",
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,  # vLLM's default is false
    }
    assert {k: config.get(k) for k in want} == want
    card = (out / "README.md").read_text()
    command = f'"method": "dspark", "model": "{out.resolve()}", "num_speculative_tokens": 4'
    assert command in card and '"enable_adaptive_verification": true' in card and "2.50" in card


def test_full_vocabulary_drafter_without_markov_confidence(tiny, tmp_path):
    tcfg, drafters = tiny
    out = export(drafters["full-vocab"], "vllm", tmp_path / "out", tcfg, "bf16")
    tensors = load_file(str(out / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in tensors.items()} == DFLASH_KEYS | {  # vLLM uses the target's lm_head
        "markov_head.markov_w1.weight": (V, R),
        "markov_head.markov_w2.weight": (V, R),
        "confidence_head.proj.weight": (1, H),
        "confidence_head.proj.bias": (1,),
    }
    assert json.loads((out / "config.json").read_text())["confidence_head_with_markov"] is False


@pytest.mark.parametrize("name", ["gated", "rnn"])
def test_markov_heads_vllm_does_not_run_are_refused(tiny, tmp_path, name):
    tcfg, drafters = tiny
    with pytest.raises(ExportError, match=f"markov_type={name}.*retrain with head.args.markov_type=vanilla"):
        export(drafters[name], "vllm", tmp_path / "out", tcfg)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "change,message",
    [
        (rename("markov_head.markov_w1.weight", "markov_w1.weight"), "missing key markov_head.markov_w1.weight"),
        (lambda t: t.pop("markov_head.markov_w2.weight"), "missing key markov_head.markov_w2.weight"),
        (rename("confidence_head.proj.weight", "confidence_head.weight"), "missing key confidence_head.proj.weight"),
        (lambda t: t.pop("confidence_head.proj.bias"), "missing key confidence_head.proj.bias"),
        (lambda t: t["d2t"].add_(1), "target ids off"),
        (scale("markov_head.markov_w2.weight", 1.5), "logits off by"),
        (flip_ten("markov_head.markov_w1.weight"), "off by"),
        (scale("confidence_head.proj.weight", 1.5), "confidence off by"),
        (scale("confidence_head.proj.bias", 1.5), "confidence off by"),
        (scale("hidden_norm.weight", 1.5), "hidden off by"),
    ],
)
def test_validator_catches_tensor_errors(tiny, tmp_path, change, message):
    tcfg, drafters = tiny
    out = export(drafters["draft-vocab"], "vllm", tmp_path / "out", tcfg, "fp32")
    edit_weights(out, "vllm", change)
    assert message in validation_failure(drafters["draft-vocab"], "vllm", out, tcfg)


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"sample_from_anchor": False}, "sample_from_anchor=False"),
        ({"enable_confidence_head": False}, "enable_confidence_head=False"),
        ({"confidence_head_with_markov": False}, "confidence_head_with_markov=False"),
        ({"markov_rank": 4}, "markov_rank=4"),
        ({"architectures": ["DFlashDraftModel"]}, "architectures="),
        ({"dflash_config": DFLASH_CONFIG | {"sample_from_anchor": True}}, "dflash_config="),
        ({"dspark_draft_topk": 8}, "dspark_draft_topk"),
    ],
)
def test_validator_catches_config_errors(tiny, tmp_path, changes, message):
    tcfg, drafters = tiny
    out = export(drafters["draft-vocab"], "vllm", tmp_path / "out", tcfg, "fp32")
    set_config(out, **changes)
    assert message in validation_failure(drafters["draft-vocab"], "vllm", out, tcfg)


@pytest.mark.parametrize("changes", [{"sample_from_anchor": False}, {"confidence_head_with_markov": False}])
def test_the_forward_runs_what_the_config_tells_vllm(tiny, tmp_path, changes):
    """Past the config check: vLLM's fill-in block (sample_from_anchor false) drafts other tokens from other
    hidden states, and a confidence head read without W1[prev] other confidences."""
    tcfg, drafters = tiny
    out = export(drafters["draft-vocab"], "vllm", tmp_path / "out", tcfg, "fp32")
    src, f = read_source(drafters["draft-vocab"], tcfg), format_for("dspark", "vllm")
    config, tensors = read_export(out, f)
    assert max(mismatch(*pair) for pair in forward_pairs(src, f, out, tensors, config).values()) < TOLERANCE
    if "confidence_head_with_markov" in changes:  # the weight's width is the drafter's: give vLLM's reading its own
        tensors["confidence_head.proj.weight"] = tensors["confidence_head.proj.weight"][:, :H]
    pairs = forward_pairs(src, f, out, tensors, config | changes)
    key = "hidden" if "sample_from_anchor" in changes else "confidence"
    assert mismatch(*pairs[key]) > TOLERANCE


@pytest.mark.parametrize("key", ["markov_head.markov_w2.weight", "confidence_head.proj.weight", "fc.weight"])
def test_validator_catches_small_tampering_of_a_bf16_export(tiny, tmp_path, key):
    tcfg, drafters = tiny
    out = export(drafters["draft-vocab"], "vllm", tmp_path / "out", tcfg, "bf16")
    edit_weights(out, "vllm", flip_ten(key))
    assert "off by" in validation_failure(drafters["draft-vocab"], "vllm", out, tcfg)
