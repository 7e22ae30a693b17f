"""DFlash export for a tiny random Llama target: vLLM's native `dflash` layout (keys, shapes,
config.json with dflash_config) with and without a draft vocabulary, the model card's vLLM command, and the
validator catching renamed keys, wrong layer ids, a causal-looking config and small tampering of a bf16 export.
The run in vLLM itself is peers/vllm_crosscheck.py (its own environment)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.heads.dflash import DFlashConfig, DFlashHead
from draftsmith.heads.drafter_folder import Recipe, TargetInfo, save_drafter
from draftsmith.serve.export.base import ExportError
from draftsmith.serve.export.pipeline import export, validate
from draftsmith.serve.models.loader import load_model
from draftsmith.serve.models.target import TargetConfig, target_id
from helpers import (
    DFLASH_KEYS,
    DFLASH_VOCAB_KEYS,
    DRAFT_V,
    H,
    V,
    edit_weights,
    flip_ten,
    rename,
    save_tiny_tokenizer,
    scale,
    set_config,
)

LAYERS, D = 2, 16

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir, tmp_path_factory):
    """The target folder (with a tokenizer), its TargetConfig, and dflash drafters with and without a draft
    vocabulary."""
    root = tmp_path_factory.mktemp("export-dflash")
    tdir = root / "target"
    shutil.copytree(tiny_llama_dir("llama"), tdir)
    save_tiny_tokenizer(tdir)
    tcfg = TargetConfig(path=str(tdir))
    target = load_model(tdir)
    info = TargetInfo(target_id(tcfg, tdir), H, V, 3)
    drafters = {}
    for name, vocab in (("draft-vocab", DRAFT_V), ("full-vocab", V)):
        torch.manual_seed(1)
        head = DFlashHead(DFlashConfig.from_target(target.config, num_layers=LAYERS, draft_vocab_size=vocab), target)
        head.set_vocab(torch.rand(V))  # a draft vocabulary that is not the first ids
        with torch.no_grad():  # trained-looking weights: the norms not all ones
            for p in head.parameters():
                if p.requires_grad:
                    p.add_(0.05 * torch.randn_like(p))
        recipe = Recipe(data="tiny", acceptance={"mean_acceptance_length": 2.5})
        drafters[name] = save_drafter(head, head.config, "dflash", info, recipe, root / name)
    return tcfg, drafters


def test_export_keys_shapes_config_and_card(tiny, tmp_path):
    tcfg, drafters = tiny
    out = export(drafters["draft-vocab"], "vllm", tmp_path / "out", tcfg, "fp32")
    tensors = load_file(str(out / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in tensors.items()} == DFLASH_KEYS | DFLASH_VOCAB_KEYS
    target_ids = torch.arange(DRAFT_V) + tensors["d2t"]  # vLLM's draft_id_to_target_id reading
    assert target_ids.unique().numel() == DRAFT_V and tensors["t2d"][target_ids].all()
    config = json.loads((out / "config.json").read_text())
    want = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "num_hidden_layers": LAYERS,
        "hidden_size": H,
        "head_dim": D,
        "vocab_size": V,
        "draft_vocab_size": DRAFT_V,
        "block_size": 4,
        # vLLM's target_layer_ids are one lower than the layer inputs drafted from (it adds 1 back)
        "dflash_config": {"mask_token_id": 2, "target_layer_ids": [-1, 0, 1], "block_size": 4},
        "max_position_embeddings": 256,
        "torch_dtype": "float32",
    }
    assert {k: config.get(k) for k in want} == want and config["rope_parameters"]["rope_theta"] == 10000.0
    assert "layer_types" not in config and "is_causal" not in config  # every layer non-causal, as trained
    card = (out / "README.md").read_text()
    assert '"method": "dflash"' in card and '"num_speculative_tokens": 3' in card and "2.50" in card


def test_full_vocabulary_drafter_shares_the_targets_lm_head(tiny, tmp_path):
    tcfg, drafters = tiny
    out = export(drafters["full-vocab"], "vllm", tmp_path / "out", tcfg, "bf16")
    tensors = load_file(str(out / "model.safetensors"))
    # no lm_head, d2t, t2d: vLLM uses the target's
    assert {k: tuple(v.shape) for k, v in tensors.items()} == DFLASH_KEYS
    assert tensors["fc.weight"].dtype == torch.bfloat16
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == V


@pytest.mark.parametrize(
    "change,message",
    [
        (rename("hidden_norm.weight", "model.hidden_norm.weight"), "missing key hidden_norm.weight"),
        (lambda t: t.pop("layers.1.self_attn.k_norm.weight"), "missing key layers.1.self_attn.k_norm.weight"),
        (lambda t: t.__setitem__("fc.weight", t["fc.weight"][:, :128]), "fc.weight has shape (64, 128)"),
        (scale("layers.0.self_attn.k_norm.weight", 1.5), "hidden off by"),  # the context's keys
        (scale("hidden_norm.weight", 1.5), "hidden off by"),
        (lambda t: t["d2t"].add_(1), "target ids off"),
        (lambda t: t.__setitem__("d2t", t["d2t"].int()), "d2t is torch.int32"),
    ],
)
def test_validator_catches_tensor_errors(tiny, tmp_path, change, message):
    tcfg, drafters = tiny
    out = export(drafters["draft-vocab"], "vllm", tmp_path / "out", tcfg, "fp32")
    validate(drafters["draft-vocab"], "vllm", out, tcfg)  # the untouched export is valid
    edit_weights(out, "vllm", change)
    with pytest.raises(ExportError, match="fails validation") as e:
        validate(drafters["draft-vocab"], "vllm", out, tcfg)
    assert message in str(e.value)


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"dflash_config": {"mask_token_id": 2, "target_layer_ids": [0, 1, 2], "block_size": 4}}, "dflash_config="),
        ({"dflash_config": {"mask_token_id": 5, "target_layer_ids": [-1, 0, 1], "block_size": 4}}, "dflash_config="),
        ({"layer_types": ["sliding_attention"] * 2}, "vLLM may run it causal"),
        ({"num_hidden_layers": 1}, "num_hidden_layers=1"),
        ({"rope_parameters": {"rope_theta": 500.0, "rope_type": "default"}, "rope_theta": 500.0}, "rope settings"),
        ({"architectures": ["Eagle3LlamaForCausalLM"]}, "architectures="),
    ],
)
def test_validator_catches_config_errors(tiny, tmp_path, changes, message):
    tcfg, drafters = tiny
    out = export(drafters["draft-vocab"], "vllm", tmp_path / "out", tcfg, "fp32")
    set_config(out, **changes)
    with pytest.raises(ExportError, match="fails validation") as e:
        validate(drafters["draft-vocab"], "vllm", out, tcfg)
    assert message in str(e.value)


@pytest.mark.parametrize("key", ["layers.1.self_attn.v_proj.weight", "fc.weight", "layers.0.self_attn.q_proj.weight"])
def test_validator_catches_small_tampering_of_a_bf16_export(tiny, tmp_path, key):
    tcfg, drafters = tiny
    out = export(drafters["draft-vocab"], "vllm", tmp_path / "out", tcfg, "bf16")
    edit_weights(out, "vllm", flip_ten(key))
    with pytest.raises(ExportError, match="fails validation"):
        validate(drafters["draft-vocab"], "vllm", out, tcfg)


def test_other_formats_are_refused(tiny, tmp_path):
    tcfg, drafters = tiny
    for fmt in ("sglang", "tgi", "hf"):
        with pytest.raises(ExportError, match=f"format={fmt} cannot hold dflash drafters; use format=vllm"):
            export(drafters["draft-vocab"], fmt, tmp_path / fmt, tcfg)
        assert not (tmp_path / fmt).exists()
